"""The stale-input audit: what a captured graph reads that nothing keeps current.

A graph bakes in the address of every tensor it reads. Slot buffers are refilled each
step and the adapter's static tensors (weights, pools, metadata buffers) are meant to
stay, but any other tensor -- typically a batch field the spec does not stage -- keeps
the value it had at capture: every later step silently reads the dummy batch's data.

The audit captures each size once more on the CPU tape, whatever the runner's backend
(recording ops is cheap; nothing is replayed), lists the tensors the graph reads that are
neither slots, declared statics nor made by the graph, and names each by where it was
found: a field of the captured batch (``fb.logit_bias``) or an attribute reachable from
the adapter (``adapter.runtime.model.extra``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..graphs.tape import TapeBackend, TapeGraph
from ..runners.phase import PhaseRunner

#: How deep the name search walks attributes from the batch and the adapter.
NAME_SEARCH_DEPTH = 4


@dataclass
class ExternalInput:
    """A tensor graphs read that is neither a slot, a declared static nor their own."""

    name: Optional[str]  # where it was found ("fb.logit_bias"), or None
    shape: Tuple[int, ...]
    dtype: str
    sizes: List[int] = field(default_factory=list)  # the captured sizes whose graph reads it

    @property
    def is_batch_field(self) -> bool:
        return bool(self.name) and self.name.startswith("fb.")

    def describe(self) -> str:
        where = self.name or "a tensor found on neither the batch nor the adapter"
        fix = ("declare it as a slot of the spec (or stage it into a static buffer) so each step refills it"
               if self.is_batch_field else "declare it in DecodeAdapter.static_tensors() (or, a model's, "
               "in static_modules()) if it never changes, else make it a slot")
        sizes = ", ".join(map(str, self.sizes))
        return (f"{where} {list(self.shape)} {self.dtype}: read by the graph of size(s) {sizes} at its "
                f"capture-time address, never refilled; {fix}")

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "sizes": self.sizes}


def capture_on_tape(runner: PhaseRunner, bs: int, context: Optional[int] = None) -> Tuple[TapeGraph, Any]:
    """Key ``(bs, context)`` of a phase runner (decode: batch size and context bucket;
    prefill: token bucket and request slots) captured again on the CPU tape, whatever its
    backend: ``(graph, view)`` (:meth:`~graphslot.runners.step.StepPath.capture_key_on`). It
    writes what a capture writes (slot buffers, attention metadata), so call it between
    steps."""
    return runner.capture_key_on(TapeBackend(), bs, context)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _children(obj: Any) -> Iterator[Tuple[str, Any]]:
    if isinstance(obj, torch.nn.Module):
        yield from ((f".{n}", t) for n, t in obj.named_parameters(recurse=False))
        yield from ((f".{n}", t) for n, t in obj.named_buffers(recurse=False))
        yield from ((f".{n}", m) for n, m in obj.named_children())
    if isinstance(obj, Mapping):
        yield from ((f"[{k!r}]", v) for k, v in list(obj.items())[:64])
    elif isinstance(obj, (list, tuple)):
        yield from ((f"[{i}]", v) for i, v in enumerate(obj[:64]))
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        yield from ((f".{k}", v) for k, v in list(vars(obj).items()) if not k.startswith("__"))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # one with __slots__
        yield from ((f".{f.name}", getattr(obj, f.name, None)) for f in dataclasses.fields(obj))


def find_names(roots: Dict[str, Any], storages: set, depth: int = NAME_SEARCH_DEPTH) -> Dict[int, str]:
    """storage pointer -> the first (shallowest) path from ``roots`` to a tensor on it."""
    found: Dict[int, str] = {}
    seen: set = set()
    level = list(roots.items())
    for _ in range(depth + 1):
        following = []
        for path, obj in level:
            if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                ptr = _storage(obj) if obj.layout is torch.strided else 0
                if ptr in storages and ptr not in found:
                    found[ptr] = path
                continue
            following += [(path + step, child) for step, child in _children(obj)]
        level = following
    return found


def audit_external_inputs(runner: PhaseRunner) -> List[ExternalInput]:
    """External inputs of every captured key of a phase runner (decode: sizes and context
    buckets; prefill: token buckets and request slots), merged by tensor."""
    statics = runner.declared_statics()
    merged: Dict[int, ExternalInput] = {}
    for bs, context in sorted(runner.graph_keys, key=lambda key: (key[0], key[1] or 0)):
        graph, view = capture_on_tape(runner, bs, context)
        tensors = graph.external_inputs(statics)
        if not tensors:
            continue
        names = find_names({"fb": view, "adapter": runner.adapter}, {_storage(t) for t in tensors})
        for t in tensors:
            name = names.get(_storage(t))
            key = hash((name, tuple(t.shape), t.dtype)) if name else _storage(t)
            entry = merged.setdefault(key, ExternalInput(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
            if bs not in entry.sizes:
                entry.sizes.append(bs)
    return list(merged.values())
