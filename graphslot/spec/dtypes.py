"""Dtype names as specs spell them (``int64``), without torch: the spec toolchain never
imports it, and takes a dtype's kind, itemsize and range from the table below (torch
2.13's dtypes; tests/test_torch_free.py holds it to the installed torch)."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Dict, Iterable, NamedTuple, Optional, Union

from .errors import did_you_mean


class DTypeInfo(NamedTuple):
    """What the spec layer knows about a dtype: no torch needed."""

    name: str  # canonical: str(torch.<name>) without "torch."
    kind: str  # "bool", "int", "float" or "complex"
    itemsize: int
    min: Optional[int] = None  # int dtypes: the range torch.iinfo gives; None where it gives none
    max: Union[int, float, None] = None  # float dtypes: torch.finfo(...).max; None where it has none


def _int(name: str, itemsize: int) -> DTypeInfo:
    """An int dtype with the range of its size, unsigned where its name says so (``uint8``, ``quint8``)."""
    span = 2 ** (8 * itemsize)
    lo = 0 if name.lstrip("q").startswith("u") else -span // 2
    return DTypeInfo(name, "int", itemsize, lo, lo + span - 1)


# Int dtypes by itemsize: with the range of their size; bits and sub-byte ones without (torch.iinfo gives none).
_INTS = {1: "int8 qint8 uint8 quint8 quint4x2 quint2x4", 2: "int16 uint16", 4: "int32 qint32 uint32", 8: "int64 uint64"}
_BITS = {1: "bits1x8 bits2x4 bits4x2 bits8 " + " ".join(f"uint{n} int{n}" for n in range(1, 8)), 2: "bits16"}
_FLOATS = {"float16": (2, 65504.0), "float32": (4, 3.4028234663852886e38), "float64": (8, 1.7976931348623157e308)}
_FLOATS.update(bfloat16=(2, 3.3895313892515355e38), float8_e5m2=(1, 57344.0), float8_e4m3fn=(1, 448.0))
_FLOATS.update(float8_e5m2fnuz=(1, 57344.0), float8_e4m3fnuz=(1, 240.0), float8_e8m0fnu=(1, 1.7014118346046923e38))
_FLOATS.update(float4_e2m1fn_x2=(1, None))  # packed pairs: torch.finfo has no range for it
_CANONICAL = [
    *(_int(name, size) for size, names in _INTS.items() for name in names.split()),
    *(DTypeInfo(name, "int", size) for size, names in _BITS.items() for name in names.split()),
    *(DTypeInfo(name, "float", size, None, fmax) for name, (size, fmax) in _FLOATS.items()),
    *(DTypeInfo(f"complex{8 * size}", "complex", size) for size in (4, 8, 16)),
    DTypeInfo("bool", "bool", 1),
]


def _pairs(text: str) -> Dict[str, str]:
    return dict(pair.split("=") for pair in text.split())


# torch's other names for the same dtypes (torch.long is torch.int64).
_ALIASES = _pairs(
    "short=int16 int=int32 long=int64 half=float16 float=float32 double=float64 chalf=complex32 cfloat=complex64 "
    "cdouble=complex128 bit=uint1"
)

# Spellings other tools use (numpy, JAX, model configs), never accepted -- a spec names
# torch's dtypes -- but answered with the name meant: "fp32" gets "did you mean 'float32'".
SPELLINGS = _pairs(
    "fp64=float64 f64=float64 fp32=float32 f32=float32 fp16=float16 f16=float16 bf16=bfloat16 bfloat=bfloat16 "
    "i8=int8 i16=int16 i32=int32 i64=int64 u8=uint8 u16=uint16 u32=uint32 u64=uint64 uint=uint32 boolean=bool "
    "b8=bool c64=complex64 c128=complex128 fp8=float8_e4m3fn fp8_e4m3=float8_e4m3fn fp8_e5m2=float8_e5m2"
)

_BY_CANONICAL = {info.name: info for info in _CANONICAL}
# Every name a spec may write, aliases included → its dtype's facts.
DTYPES: Dict[str, DTypeInfo] = {**_BY_CANONICAL, **{a: _BY_CANONICAL[c] for a, c in _ALIASES.items()}}


class DTypeName(str):
    """A dtype in the spec layer: its canonical name (a ``str``: prints, compares and hashes
    as ``"int64"``), with its facts; generated code writes it as ``torch.<name>``."""

    __slots__ = ()

    @property
    def itemsize(self) -> int:
        return DTYPES[self].itemsize


def is_torch_dtype(value: Any) -> bool:
    """Whether ``value`` is a ``torch.dtype``, without importing torch."""
    kind = type(value)
    return kind.__name__ == "dtype" and kind.__module__ == "torch"


def parse_dtype(value: Any) -> Optional[DTypeName]:
    """``torch.int64``, ``"int64"``, ``"torch.int64"`` or ``"long"`` → ``DTypeName("int64")``;
    anything else → None."""
    if is_torch_dtype(value):
        value = str(value)
    info = DTYPES.get(value.removeprefix("torch.")) if isinstance(value, str) else None
    return None if info is None else DTypeName(info.name)


def dtype_hint(value: Any, others: Iterable[str] = ()) -> str:
    """A ``; did you mean 'float32'?`` suffix for a name that is not a dtype: for another tool's
    spelling (``fp32``), else the closest dtype name or one of ``others`` (dtype params)."""
    return spelling_hint(value) or (did_you_mean(value, [*DTYPES, *others]) if isinstance(value, str) else "")


def spelling_hint(value: Any) -> str:
    """``; did you mean 'float32'?`` for another tool's spelling of a dtype (``fp32``), else ``""``."""
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
    """torch, imported where graphslot first makes tensors; its warning about a missing
    NumPy (which graphslot never uses) silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        try:
            import torch
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            raise ModuleNotFoundError(TORCH_MISSING, name="torch") from None
    return torch


@functools.lru_cache(maxsize=None)
def torch_dtype(dtype: Any) -> Any:
    """The ``torch.dtype`` for a name (or a torch dtype): the runtime boundary, which imports torch."""
    if is_torch_dtype(dtype):
        return dtype
    name = parse_dtype(dtype)
    if name is None:
        raise ValueError(f"not a dtype: {dtype!r}")
    torch = import_torch()
    result = getattr(torch, name, None)
    if not is_torch_dtype(result):
        raise ValueError(f"dtype {name} is not available in torch {torch.__version__}")
    return result


def value_fits_dtype(value: Any, dtype: Any) -> bool:
    """Whether a pad value can be stored in ``dtype`` (a name or a torch dtype) exactly as
    meant: no wrap-around, no overflow (a finite value must not become inf), no truncation."""
    parsed = parse_dtype(dtype)
    if parsed is None:
        raise ValueError(f"not a dtype: {dtype!r}")
    info = DTYPES[parsed]
    if info.kind == "bool":
        return isinstance(value, bool) or (type(value) is int and value in (0, 1))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if info.kind == "complex" or info.kind == "float" and isinstance(value, float) and not math.isfinite(value):
        return True
    if info.kind == "float":
        try:  # no known range (packed float4): nothing fits
            return info.max is not None and abs(float(value)) <= info.max
        except OverflowError:  # an int beyond any float
            return False
    if isinstance(value, float) and not value.is_integer():  # nor inf, nor nan
        return False
    if info.min is None:  # bits and sub-byte dtypes: the int64 range
        return -(2**63) <= value < 2**63
    return info.min <= value <= info.max
