"""Graphs cut into segments with eager steps between them.

The breakable and piecewise capture modes capture one run of a runner's callable (the
decode forward, the prefill layer stack) as graph *segments* that alternate with *eager
steps*: calls that are not captured (attention) and so run eagerly at every replay. The
breakable mode cuts at :func:`~graphslot.runners.breakable.eager_on_graph` calls, the
piecewise mode at the split ops of a compiled FX graph; what they build is the same
:class:`SegmentedGraph`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .backend import GraphCaptureError, InspectableGraph


def _tensor_leaves(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def non_owning(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory alive: what a graph keeps
    of an intermediate whose memory is the graph's own (on a GPU, its pool's)."""
    memory = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(memory.data_ptr(), t.device, memory.nbytes())
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.size(), t.stride())


def owns_memory(t: torch.Tensor) -> bool:
    """False for a :func:`non_owning` tensor (its storage is not the allocator's)."""
    return t.untyped_storage().resizable()


def _swapped(value: Any, new: Dict[int, torch.Tensor]) -> Any:
    return tree_map(lambda x: new.get(id(x), x) if isinstance(x, torch.Tensor) else x, value)


class EagerStep:
    """An eager call between two segments. Replay re-runs it on the arguments it got at
    capture (static tensors, fixed addresses) and copies its result into the tensors it
    returned at capture, which the next segment reads."""

    def __init__(self, name: str, fn: Callable, args: tuple, kwargs: dict, result: Any) -> None:
        self.name = name
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.result = result
        self.outputs = _tensor_leaves(result)

    def __call__(self) -> None:
        with torch.no_grad():
            new = _tensor_leaves(self.fn(*self.args, **self.kwargs))
        if len(new) != len(self.outputs):
            raise GraphCaptureError(f"eager step {self.name} returned {len(new)} tensors at replay, "
                                    f"{len(self.outputs)} at capture")
        for dst, src in zip(self.outputs, new):
            if dst.shape != src.shape:
                raise GraphCaptureError(f"eager step {self.name} returned shape {tuple(src.shape)} at "
                                        f"replay, {tuple(dst.shape)} at capture; its shapes must be fixed")
            if dst is not src:
                dst.copy_(src)

    def __repr__(self) -> str:
        return f"EagerStep({self.name})"


class SegmentedGraph:
    """Segments (backend graphs) alternating with :class:`EagerStep` s; ``output`` is
    what the last segment returned at capture, rewritten in place by every replay."""

    def __init__(self, steps: List[Any], output: Any) -> None:
        self.steps = steps
        self.output = output

    @property
    def segments(self) -> List[Any]:
        return [s for s in self.steps if not isinstance(s, EagerStep)]

    @property
    def eager_steps(self) -> List[EagerStep]:
        return [s for s in self.steps if isinstance(s, EagerStep)]

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_eager_steps(self) -> int:
        return len(self.eager_steps)

    def replay(self) -> None:
        for step in self.steps:
            if isinstance(step, EagerStep):
                step()
            else:
                step.replay()

    def hold_weakly(self) -> None:
        """Keep every segment's output but the last's through :func:`non_owning` tensors, in
        the segments and in the eager steps that read them. That memory is the graphs' own:
        on a GPU it goes back to their pool after capture, where the next capture may place
        its tensors (the graphs of one pool never run at once; a replay writes it before the
        eager step that reads it), so a pool holds one key's intermediates, not every key's.
        What the eager steps returned (made outside any graph) and the last output stay owned."""
        weak: Dict[int, torch.Tensor] = {}
        for segment in self.segments[:-1]:
            for t in _tensor_leaves(segment.output):
                weak.setdefault(id(t), non_owning(t))
            segment.output = _swapped(segment.output, weak)
        for step in self.eager_steps:
            step.args = _swapped(step.args, weak)
            step.kwargs = _swapped(step.kwargs, weak)

    def owned_tensors(self, statics: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
        """The tensors this graph's segments and eager steps keep alive (one per storage),
        leaving out ``statics`` (buffers, weights: kept by their owners anyway) and what a
        backend graph keeps inside itself (the tape's records): what would pin graph memory
        on a GPU after capture."""
        skip = {t.untyped_storage().data_ptr() for t in statics}
        found: Dict[int, torch.Tensor] = {}
        held = [self.output] + [s.output for s in self.segments]
        held += [(s.args, s.kwargs, s.result) for s in self.eager_steps]
        for t in _tensor_leaves(held):
            ptr = t.untyped_storage().data_ptr()
            if owns_memory(t) and ptr not in skip:
                found.setdefault(ptr, t)
        return list(found.values())

    def external_inputs(self, statics: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
        """What the segments read that nothing keeps current (segments that are
        :class:`~graphslot.graphs.backend.InspectableGraph` s, the tape's, only).

        Tensors made by an earlier segment, or returned by an eager step, count as the
        graph's own; what the eager steps read is not checked (they run eagerly).
        """
        if not all(isinstance(s, InspectableGraph) for s in self.segments):
            raise NotImplementedError("this graph backend cannot list its inputs; capture with 'cpu'")
        known = {t.untyped_storage().data_ptr() for t in statics}
        found: Dict[int, torch.Tensor] = {}
        for step in self.steps:
            if isinstance(step, EagerStep):
                known.update(t.untyped_storage().data_ptr() for t in step.outputs)
                continue
            for t in step.external_inputs():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in known and ptr not in found:
                    found[ptr] = t
            known.update(step.produced)
        return list(found.values())

    def __repr__(self) -> str:
        return f"SegmentedGraph({self.num_segments} segments, {self.num_eager_steps} eager steps)"
