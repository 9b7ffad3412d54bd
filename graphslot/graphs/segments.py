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
from torch.utils._pytree import tree_flatten

from .backend import GraphCaptureError, InspectableGraph


def _tensor_leaves(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class EagerStep:
    """An eager call between two segments. Replay re-runs it on the arguments it got at
    capture (static tensors, fixed addresses) and copies its result into the tensors it
    returned at capture, which the next segment reads."""

    def __init__(self, name: str, fn: Callable, args: tuple, kwargs: dict, result: Any) -> None:
        self.name, self.fn, self.args, self.kwargs, self.result = name, fn, args, kwargs, result
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
        self.steps, self.output = steps, output

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
