"""Dtype names as specs spell them (``int64``, ``bfloat16``, ``bool``), without torch.

The spec toolchain (``validate``, ``show``, ``schema``, ``generate``) never imports
torch: there a dtype is a :class:`DTypeName` (a ``str``: ``"int64"``) and what the checks
need to know about it — its kind, itemsize and value range — comes from the table below.
``torch.dtype`` objects are made only where tensors are (registries, buffers), by
:func:`torch_dtype`. The table is torch 2.13's dtypes; tests/test_torch_free.py holds it
to the installed torch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Union

from .errors import did_you_mean


@dataclass(frozen=True)
class DTypeInfo:
    """What the spec layer knows about a dtype: no torch needed."""

    name: str  # canonical: str(torch.<name>) without "torch."
    kind: str  # "bool", "int", "float" or "complex"
    itemsize: int
    min: Optional[int] = None  # int dtypes: the range torch.iinfo gives; None where it gives none
    max: Union[int, float, None] = None  # float dtypes: torch.finfo(...).max; None where it has none


def _int(name: str, itemsize: int, lo: Optional[int] = None, hi: Optional[int] = None) -> DTypeInfo:
    return DTypeInfo(name, "int", itemsize, lo, hi)


def _float(name: str, itemsize: int, fmax: Optional[float]) -> DTypeInfo:
    return DTypeInfo(name, "float", itemsize, None, fmax)


_CANONICAL = [
    _int("uint8", 1, 0, 255),
    _int("int8", 1, -128, 127),
    _int("int16", 2, -(2**15), 2**15 - 1),
    _int("int32", 4, -(2**31), 2**31 - 1),
    _int("int64", 8, -(2**63), 2**63 - 1),
    _float("float16", 2, 65504.0),
    _float("float32", 4, 3.4028234663852886e38),
    _float("float64", 8, 1.7976931348623157e308),
    DTypeInfo("complex32", "complex", 4),
    DTypeInfo("complex64", "complex", 8),
    DTypeInfo("complex128", "complex", 16),
    DTypeInfo("bool", "bool", 1),
    _int("qint8", 1, -128, 127),
    _int("quint8", 1, 0, 255),
    _int("qint32", 4, -(2**31), 2**31 - 1),
    _float("bfloat16", 2, 3.3895313892515355e38),
    _int("quint4x2", 1, 0, 255),
    _int("quint2x4", 1, 0, 255),
    _int("bits1x8", 1),
    _int("bits2x4", 1),
    _int("bits4x2", 1),
    _int("bits8", 1),
    _int("bits16", 2),
    _float("float8_e5m2", 1, 57344.0),
    _float("float8_e4m3fn", 1, 448.0),
    _float("float8_e5m2fnuz", 1, 57344.0),
    _float("float8_e4m3fnuz", 1, 240.0),
    _int("uint16", 2, 0, 2**16 - 1),
    _int("uint32", 4, 0, 2**32 - 1),
    _int("uint64", 8, 0, 2**64 - 1),
    *(_int(f"uint{n}", 1) for n in range(1, 8)),
    *(_int(f"int{n}", 1) for n in range(1, 8)),
    _float("float8_e8m0fnu", 1, 1.7014118346046923e38),
    _float("float4_e2m1fn_x2", 1, None),  # packed pairs: torch.finfo has no range for it
]

# torch's other names for the same dtypes (torch.long is torch.int64).
_ALIASES = {
    "short": "int16",
    "int": "int32",
    "long": "int64",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "chalf": "complex32",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "bit": "uint1",
}

# Spellings other tools use (numpy, JAX, model configs), never accepted -- a spec names
# torch's dtypes -- but answered with the name meant: "fp32" gets "did you mean 'float32'".
SPELLINGS = {
    "fp64": "float64",
    "f64": "float64",
    "fp32": "float32",
    "f32": "float32",
    "fp16": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "bfloat": "bfloat16",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "uint": "uint32",
    "boolean": "bool",
    "b8": "bool",
    "c64": "complex64",
    "c128": "complex128",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

_BY_CANONICAL = {info.name: info for info in _CANONICAL}
# Every name a spec may write, aliases included → its dtype's facts.
DTYPES: Dict[str, DTypeInfo] = {**_BY_CANONICAL, **{a: _BY_CANONICAL[c] for a, c in _ALIASES.items()}}


class DTypeName(str):
    """A dtype in the spec layer: its canonical name (``"int64"``), with its facts.

    A ``str``, so it prints, compares and hashes as the name; expressions still type it
    as ``dtype`` and generated code writes it as ``torch.<name>``.
    """

    __slots__ = ()

    @property
    def info(self) -> DTypeInfo:
        return DTYPES[self]

    @property
    def itemsize(self) -> int:
        return self.info.itemsize

    @property
    def is_floating_point(self) -> bool:
        return self.info.kind == "float"

    @property
    def is_complex(self) -> bool:
        return self.info.kind == "complex"


def is_torch_dtype(value: Any) -> bool:
    """Whether ``value`` is a ``torch.dtype``, without importing torch."""
    kind = type(value)
    return kind.__name__ == "dtype" and kind.__module__ == "torch"


def parse_dtype(value: Any) -> Optional[DTypeName]:
    """``torch.int64``, ``"int64"``, ``"torch.int64"`` or ``"long"`` → ``DTypeName("int64")``;
    anything else → None."""
    if is_torch_dtype(value):
        value = str(value)
    if isinstance(value, str):
        info = DTYPES.get(value.removeprefix("torch."))
        if info is not None:
            return DTypeName(info.name)
    return None


def dtype_hint(value: Any, others: Iterable[str] = ()) -> str:
    """A ``; did you mean 'float32'?`` suffix for a name that is not a dtype: the name
    another tool's spelling stands for (``fp32``, ``bf16``, ``i64``), else the closest
    dtype name or one of ``others`` (dtype params); empty when nothing is close."""
    return spelling_hint(value) or (did_you_mean(value, [*DTYPES, *others]) if isinstance(value, str) else "")


def spelling_hint(value: Any) -> str:
    """``; did you mean 'float32'?`` for another tool's spelling of a dtype (``fp32``),
    else an empty string."""
    meant = SPELLINGS.get(value.removeprefix("torch.").lower()) if isinstance(value, str) else None
    return "" if meant is None else f"; did you mean '{meant}'?"


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype given as a torch dtype or a name."""
    parsed = parse_dtype(dtype)
    return str(parsed) if parsed is not None else str(dtype).removeprefix("torch.")


TORCH_MISSING = (
    "graphslot's runtime needs torch, which is not installed here: install your engine's torch "
    "build, or pip install 'graphslot[torch]' (validate, show, schema and generate run without it)"
)


def import_torch() -> Any:
    """torch, imported where graphslot first makes tensors. A torch without NumPy beside it
    warns on import; graphslot never uses NumPy, so that one message is silenced (the
    warning filters are restored afterwards)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        try:
            import torch
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            raise ModuleNotFoundError(TORCH_MISSING, name="torch") from None
    return torch


_TORCH_DTYPES: Dict[str, Any] = {}


def torch_dtype(dtype: Any) -> Any:
    """The ``torch.dtype`` for a name (or a torch dtype): the runtime boundary, which
    imports torch."""
    if is_torch_dtype(dtype):
        return dtype
    cached = _TORCH_DTYPES.get(dtype)
    if cached is not None:
        return cached
    name = parse_dtype(dtype)
    if name is None:
        raise ValueError(f"not a dtype: {dtype!r}")
    torch = import_torch()
    result = getattr(torch, name, None)
    if not is_torch_dtype(result):
        raise ValueError(f"dtype {name} is not available in torch {torch.__version__}")
    _TORCH_DTYPES[dtype] = result
    return result


def value_fits_dtype(value: Any, dtype: Any) -> bool:
    """Whether a pad value can be stored in ``dtype`` (a name or a torch dtype) exactly as
    meant: no wrap-around, no overflow, no truncation.

    * ``bool``: ``true``/``false``, or the ints ``0``/``1``;
    * integer dtypes: an int (not a bool) in the dtype's range, or a float with an
      integral value in range (``2.0``); ``1.5``, inf and nan do not fit;
    * floating dtypes: an int or float (not a bool) whose magnitude the dtype can hold
      (``±inf`` and nan are kept as such; a finite value must not become inf);
    * complex dtypes: an int or float.
    """
    parsed = parse_dtype(dtype)
    if parsed is None:
        raise ValueError(f"not a dtype: {dtype!r}")
    info = parsed.info
    if info.kind == "bool":
        return isinstance(value, bool) or (type(value) is int and value in (0, 1))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if info.kind == "complex":
        return True
    if info.kind == "float":
        if isinstance(value, float) and not math.isfinite(value):
            return True
        if info.max is None:  # no known range (packed float4): nothing fits
            return False
        try:
            return abs(float(value)) <= info.max
        except OverflowError:  # an int beyond any float
            return False
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return False
        value = int(value)
    if info.min is None:  # bits and sub-byte dtypes: only plain ints
        return isinstance(value, int) and -(2**63) <= value < 2**63
    return info.min <= value <= info.max
