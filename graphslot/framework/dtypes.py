"""Dtype names as specs spell them (``int64``, ``bfloat16``, ``bool``)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

DTYPES = {
    name: dtype
    for name, dtype in vars(torch).items()
    if isinstance(dtype, torch.dtype) and not name.startswith("_")
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any) -> Optional[torch.dtype]:
    """``torch.int64``, ``"int64"`` or ``"torch.int64"`` → the dtype; else None."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return DTYPES.get(value.removeprefix("torch."))
    return None


def value_fits_dtype(value: Any, dtype: torch.dtype) -> bool:
    """Whether a pad value can be stored in ``dtype`` exactly as meant: no wrap-around,
    no overflow, no truncation.

    * ``bool``: ``true``/``false``, or the ints ``0``/``1``;
    * integer dtypes: an int (not a bool) in the dtype's range, or a float with an
      integral value in range (``2.0``); ``1.5``, inf and nan do not fit;
    * floating dtypes: an int or float (not a bool) whose magnitude the dtype can hold
      (``±inf`` and nan are kept as such; a finite value must not become inf);
    * complex dtypes: an int or float.
    """
    if dtype == torch.bool:
        return isinstance(value, bool) or (type(value) is int and value in (0, 1))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if dtype.is_complex:
        return True
    if dtype.is_floating_point:
        if isinstance(value, float) and not math.isfinite(value):
            return True
        try:
            return abs(float(value)) <= torch.finfo(dtype).max
        except OverflowError:  # an int beyond any float
            return False
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return False
        value = int(value)
    try:
        info = torch.iinfo(dtype)
    except TypeError:  # quantized and other exotic dtypes: only plain ints
        return isinstance(value, int) and -(2**63) <= value < 2**63
    return info.min <= value <= info.max
