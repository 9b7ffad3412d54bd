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
from torch.utils._pytree import tree_flatten, tree_unflatten

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


class SharedOutputs:
    """One set of output buffers for every captured size (``share_outputs=True``).

    Each graph copies its forward's output into the leading rows of these buffers, inside
    the graph, and returns views of them. The forward's own output is then an
    intermediate of the capture, whose memory goes back to the graphs' pool for the next
    size: the graphs keep one largest-size output alive instead of one per size (sglang
    does the same for its prefill graphs). The price is one device copy per output
    tensor per replay, and outputs stay valid only until the next replay of any size.

    The output must be tensors in tuples, lists, dicts or other pytree-registered types
    (transformers' ``ModelOutput`` included), each with ``padded_num_tokens`` or
    ``padded_bs`` rows along dim 0; anything else is kept as captured.
    """

    def __init__(self, max_bs: int, max_num_tokens: int):
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.spec: Any = None
        #: Per output leaf: (buffer, whether its rows are tokens), or None for a non-tensor.
        self.buffers: list = []

    def __call__(self, output: Any, padded_bs: int, padded_num_tokens: int) -> Any:
        leaves, spec = tree_flatten(output)
        if self.spec is None:
            self.spec = spec
            self.buffers = [self._allocate(leaf, i, padded_bs, padded_num_tokens) for i, leaf in enumerate(leaves)]
        elif spec != self.spec:
            raise TypeError(f"share_outputs: the forward of batch size {padded_bs} returned another structure "
                            f"than the first size captured ({spec} vs {self.spec}); every size must return "
                            "the same structure")
        shared = []
        for i, (leaf, entry) in enumerate(zip(leaves, self.buffers)):
            if entry is None:
                shared.append(leaf)
                continue
            buffer, per_token = entry
            rows = padded_num_tokens if per_token else padded_bs
            if not isinstance(leaf, torch.Tensor) or list(leaf.shape) != [rows, *buffer.shape[1:]] \
                    or leaf.dtype != buffer.dtype:
                got = f"{list(leaf.shape)} {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise TypeError(f"share_outputs: output tensor {i} of batch size {padded_bs} is {got}, not the "
                                f"{[rows, *buffer.shape[1:]]} {buffer.dtype} the first size captured implies")
            view = buffer[:rows]
            view.copy_(leaf)
            shared.append(view)
        return tree_unflatten(shared, spec)

    def _allocate(self, leaf: Any, i: int, padded_bs: int, padded_num_tokens: int) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return None
        rows = leaf.shape[0] if leaf.dim() else None
        if rows not in (padded_num_tokens, padded_bs):
            raise TypeError(f"share_outputs: output tensor {i} of shape {list(leaf.shape)} has neither "
                            f"{padded_num_tokens} token rows nor {padded_bs} request rows along dim 0, so "
                            "no buffer of the largest size can hold it; return only tensors with rows "
                            "from DecodeAdapter.forward, or leave share_outputs off")
        per_token = rows == padded_num_tokens
        capacity = self.max_num_tokens if per_token else self.max_bs
        return torch.empty((capacity, *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device), per_token

    def tensors(self) -> list:
        return [entry[0] for entry in self.buffers if entry is not None]
