"""Argument checks of the transformers driver: token ids, counts, numbers, flags.

Each check returns the value as a plain Python type or raises a TypeError/ValueError
whose message names the argument (``where: name ...``) and what it must be. Bools and
floats are never ints here (a token id or a count is never truncated); ints, integral
torch and numpy scalars are.
"""

from __future__ import annotations

import math
import operator
from typing import Any, List, Optional, Tuple

import torch


def as_int(value: Any) -> Optional[int]:
    """An int or an integral torch/numpy scalar as a Python int; None for anything else."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim())):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def count(value: Any, name: str, where: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, or a TypeError/ValueError naming ``name``."""
    n = as_int(value)
    if n is None or n < minimum:
        raise (TypeError if n is None else ValueError)(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return n


def token_id(value: Any, vocab_size: int, what: str) -> int:
    """``value`` as a token id of the model, or a TypeError/ValueError naming ``what``."""
    t = as_int(value)
    if t is None:
        raise TypeError(f"{what} is {value!r} ({type(value).__name__}); token ids must be integers")
    if not 0 <= t < vocab_size:
        raise ValueError(f"{what} is {t}, outside the model's vocabulary (0 <= id < {vocab_size})")
    return t


def token_ids(values: Any, vocab_size: int, what: str) -> List[int]:
    """A sequence, tensor or array of token ids as Python ints (a tensor is read once)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        try:
            if isinstance(values, (str, bytes)):  # iterable, but not of token ids
                raise TypeError
            values = list(values)
        except TypeError:
            raise TypeError(f"{what} must be a sequence of token ids, got {type(values).__name__}") from None
    return [v if type(v) is int and 0 <= v < vocab_size else token_id(v, vocab_size, f"{what}[{i}]")
            for i, v in enumerate(values)]


def stop_ids(value: Any, vocab_size: int, what: str) -> Tuple[int, ...]:
    """One token id or a sequence of them (``()``: none), sorted and without repeats."""
    if as_int(value) is not None or isinstance(value, (bool, float, str, bytes)) or value is None:
        return (token_id(value, vocab_size, what),)
    return tuple(sorted(set(token_ids(value, vocab_size, what))))


def number(value: Any, name: str, where: str, low: float, high: float, *, low_open: bool = False,
           rule: str = "") -> float:
    """``value`` (an int or float, not a bool) as a float in ``[low, high]`` (``(low, high]``
    with ``low_open``), or a TypeError/ValueError naming ``name`` and ``rule``."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok_type and isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype.is_floating_point:
        value = value.item()
        ok_type = True
    x = float(value) if ok_type else math.nan
    if not ok_type or not math.isfinite(x) or not (x > low if low_open else x >= low) or x > high:
        if math.isfinite(high):
            span = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        else:
            span = f"{'>' if low_open else '>='} {low:g}"
        raise (ValueError if ok_type else TypeError)(
            f"{where}: {name} must be a finite number {span}{f' ({rule})' if rule else ''}, got {value!r}")
    return x


def flag(value: Any, name: str, where: str, allow_none: bool = False) -> Optional[bool]:
    """``value`` as a bool (or None when allowed); 0/1 and strings are refused."""
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False{' or None' if allow_none else ''}, got {value!r}")
    return value
