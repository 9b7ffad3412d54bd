"""Dtype names as specs spell them (``int64``, ``bfloat16``, ``bool``)."""

from __future__ import annotations

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
    """Whether a pad value can be stored in ``dtype`` without changing meaning."""
    if dtype == torch.bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return isinstance(value, (int, float))
    return isinstance(value, int)
