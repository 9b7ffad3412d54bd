"""The raw rows of a graph's static outputs, whatever structure the forward returns.

A replayed graph computes every padded row; handing those back is the silent bug this
module exists to prevent (a caller sampling 4 rows for 3 requests shifts every request
after the first padded one, or samples for a request that does not exist). So slicing
walks the whole output and either cuts every tensor down to its raw rows or raises:

* a tensor's rows are its dim 0. ``padded_num_tokens`` rows are token rows and keep
  ``raw_num_tokens``; ``padded_bs`` rows are request rows and keep ``raw_bs`` (with one
  token per request both are the same). Any other leading size (a 0-d loss, a
  ``[vocab]`` bias) cannot be told apart from an aggregate over padded rows: an error;
* tuples, lists (named tuples too), mappings and dataclasses, transformers'
  ``ModelOutput`` included (an ``OrderedDict`` that is also a dataclass), are rebuilt
  with their members sliced, frozen dataclasses too;
* ``None``, numbers and strings hold no rows and are kept;
* anything else (an object holding tensors the walk cannot see, such as a KV cache
  returned as ``past_key_values``) is a ``TypeError`` naming its type and where it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

_NO_ROWS = (type(None), bool, int, float, complex, str, bytes)

_FIX = ("return only tensors (or tuples, lists, mappings, dataclasses of them) from "
        "DecodeAdapter.forward, e.g. `out.logits` of a transformers model, or override "
        "DecodeAdapter.slice_output")


def slice_rows(output: Any, raw_bs: int, raw_num_tokens: int, padded_bs: int, padded_num_tokens: int,
               where: str = "output") -> Any:
    """``output`` with every tensor cut to the raw batch's rows (see the module doc)."""

    def walk(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            rows = x.shape[0] if x.dim() else None
            if rows == padded_num_tokens:
                return x[:raw_num_tokens]
            if rows == padded_bs:
                return x[:raw_bs]
            shape = list(x.shape)
            raise ValueError(f"{where}: a tensor of shape {shape} has neither {padded_num_tokens} token rows "
                             f"nor {padded_bs} request rows along dim 0, so its padded rows cannot be cut off; "
                             + _FIX)
        if isinstance(x, _NO_ROWS):
            return x
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            # Before Mapping: a ModelOutput is both, and only its constructor keeps the two in step.
            return _rebuild_dataclass(x, where, walk)
        if isinstance(x, Mapping):
            items = {k: walk(v, f"{where}[{k!r}]") for k, v in x.items()}
            return _construct(type(x), where, lambda cls: cls(items))
        if isinstance(x, (tuple, list)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
                return _construct(type(x), where, lambda cls: cls(*items))
            return _construct(type(x), where, lambda cls: cls(items))
        cls = type(x)
        raise TypeError(f"{where}: the runner cannot cut the padded rows out of a {cls.__module__}."
                        f"{cls.__qualname__}; " + _FIX)

    return walk(output, where)


def _rebuild_dataclass(x: Any, where: str, walk) -> Any:
    changes = {}
    for f in dataclasses.fields(x):
        value = getattr(x, f.name)
        sliced = walk(value, f"{where}.{f.name}")
        if f.init:
            changes[f.name] = sliced
        elif sliced is not value:
            raise TypeError(f"{where}.{f.name}: a field set outside __init__ of {type(x).__qualname__} holds "
                            "rows that a copy cannot cut; " + _FIX)
    return _construct(type(x), where, lambda cls: dataclasses.replace(x, **changes))


def _construct(cls: type, where: str, make) -> Any:
    try:
        return make(cls)
    except Exception as exc:  # noqa: BLE001 - any constructor failure gets the same advice
        raise TypeError(f"{where}: could not rebuild a {cls.__module__}.{cls.__qualname__} with its rows cut "
                        f"({type(exc).__name__}: {exc}); " + _FIX) from exc
