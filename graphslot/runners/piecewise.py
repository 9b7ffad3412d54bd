"""The piecewise prefill graph runner: ``torch.compile`` split at declared ops.

The adapter's layer stack is compiled with ``torch.compile(stack,
backend=<graphslot backend>, dynamic=False, fullgraph=False)``. The graphslot backend
is a Dynamo custom backend: it splits the FX graph at every call of a declared *split
op* (``split_ops``, op names such as ``"graphslot_ref::attention"``; register the op
with ``torch.library.custom_op`` and a fake impl so Dynamo does not trace into it),
with :func:`torch.fx.passes.split_module.split_module`. Each split op is a submodule of
its own that runs eagerly; every other submodule is a *piece*.

Capture, per token bucket ``n`` (largest first), over the prefill spec's
token-padded buffers (batch size not padded), exactly as the breakable runner: a
*capture pass* runs the compiled stack once on the all-padding dummy batch, with
``input_embeds[:n]`` as the hidden input. During that pass each piece is captured
through the graph backend (``backend.capture(lambda: piece(*inputs))``; its inputs are
the stack's static inputs or what earlier pieces and split ops returned, so their
addresses are fixed) and each split op runs eagerly and is recorded as an
:class:`~graphslot.graphs.segments.EagerStep`. The result is a
:class:`~graphslot.graphs.segments.SegmentedGraph` whose segments are the pieces:
replay runs ``[piece, split op, piece, ..., piece]``; the compiled function itself runs
only in capture passes.

Per replay: ``fill_from`` (tokens padded to the bucket), the eager embedding into
``input_embeds[:raw]``, the attention metadata hook on the live batch (EVERY replay),
the recorded sequence, then the eager logits on ``output[:raw]``.

Dynamo traces the stack with its batch argument (the registry's padded view); its
tensor fields become graph inputs, which are the registry's static buffers, so no
wrapper module is needed. A graph break (more than one Dynamo graph per capture pass)
is an error: Python code between two Dynamo graphs would run at capture only.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from ..graphs.backend import GraphCaptureError
from .prefill import PrefillGraphRunner, PrefillRunnerConfig
from ..graphs.segments import EagerStep, SegmentedGraph

# ------------------------------------------------------------ the Dynamo backend

_STATE = threading.local()


def op_name(target: Any) -> Optional[str]:
    """``"ns::name"`` of an FX call_function target that is a torch op, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


class _Recording:
    """Active during one capture pass: compiled graphs capture into it."""

    def __init__(self, backend: Any, warmup: int) -> None:
        self.backend, self.warmup = backend, warmup
        self.steps: List[Any] = []
        self.calls = 0
        self.module: Optional["PiecewiseModule"] = None  # the Dynamo graph that ran


@contextlib.contextmanager
def _recording(rec: _Recording):
    if getattr(_STATE, "recording", None) is not None:
        raise GraphCaptureError("piecewise captures cannot nest")
    _STATE.recording = rec
    try:
        yield rec
    finally:
        _STATE.recording = None


class _PieceRunner(torch.fx.Interpreter):
    """Runs the split module's top level, capturing pieces and recording split ops."""

    def __init__(self, split_gm: torch.fx.GraphModule, split_names: Mapping[str, str], rec: _Recording):
        super().__init__(split_gm, garbage_collect_values=False)
        self.extra_traceback = False  # our errors name the piece; FX would append its node dump
        self.split_names, self.rec = split_names, rec

    def call_module(self, target, args, kwargs):
        submod = self.fetch_attr(target)
        rec = self.rec
        if target in self.split_names:
            with torch.no_grad():
                result = submod(*args, **kwargs)
            rec.steps.append(EagerStep(self.split_names[target], submod, tuple(args), dict(kwargs), result))
            return result

        def piece():
            with torch.no_grad():
                return submod(*args, **kwargs)

        try:
            graph = rec.backend.capture(piece, warmup=rec.warmup)
        except GraphCaptureError as e:
            after = next((s.name for s in reversed(rec.steps) if isinstance(s, EagerStep)), "the start")
            raise GraphCaptureError(f"piece {sum(not isinstance(s, EagerStep) for s in rec.steps)} "
                                    f"({target}, after {after}): {e}") from e
        rec.steps.append(graph)
        return graph.output


class PiecewiseModule:
    """What the graphslot backend returns for one Dynamo graph: the split module, run
    plainly, or piece by piece while a capture pass is recording."""

    def __init__(self, split_gm: torch.fx.GraphModule, split_names: Mapping[str, str], num_pieces: int,
                 custom_ops: Sequence[str] = ()):
        self.split_gm, self.split_names, self.num_pieces = split_gm, dict(split_names), num_pieces
        #: Non-aten ops the Dynamo graph calls: what a mistyped split op should have named.
        self.custom_ops = tuple(custom_ops)

    @property
    def num_split_ops(self) -> int:
        return len(self.split_names)

    def __call__(self, *args: Any) -> Any:
        rec = getattr(_STATE, "recording", None)
        if rec is None:
            return self.split_gm(*args)
        rec.calls += 1
        rec.module = self
        return _PieceRunner(self.split_gm, self.split_names, rec).run(*args)


def split_graph(gm: torch.fx.GraphModule, split_ops: Sequence[str]) -> PiecewiseModule:
    """Split ``gm`` at every call of an op in ``split_ops`` (each its own submodule)."""
    wanted = set(split_ops)
    part: Dict[torch.fx.Node, int] = {}
    split_parts: Dict[int, str] = {}
    custom_ops: Dict[str, None] = {}
    pid = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        name = op_name(node.target) if node.op == "call_function" else None
        if name is not None and not name.startswith(("aten::", "prims::")):
            custom_ops[name] = None
        if name in wanted:
            pid += 1
            part[node] = pid
            split_parts[pid] = name
            pid += 1
        else:
            part[node] = pid
    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    names = {f"submod_{p}": n for p, n in split_parts.items()}
    submods = [n.target for n in split_gm.graph.nodes if n.op == "call_module"]
    return PiecewiseModule(split_gm, names, sum(t not in names for t in submods), list(custom_ops))


def make_graphslot_backend(split_ops: Sequence[str], compiled: Optional[list] = None):
    """A Dynamo backend ``(gm, example_inputs) -> callable`` splitting at ``split_ops``;
    each :class:`PiecewiseModule` it makes is appended to ``compiled``."""

    def graphslot_backend(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> PiecewiseModule:
        module = split_graph(gm, split_ops)
        if compiled is not None:
            compiled.append(module)
        return module

    return graphslot_backend


def _dynamo_limits(n: int):
    """Room for one compile per bucket (``dynamic=False`` recompiles per shape)."""
    cfg = torch._dynamo.config
    names = [k for k in ("recompile_limit", "accumulated_recompile_limit") if hasattr(cfg, k)]
    return cfg.patch(**{k: max(getattr(cfg, k), n) for k in names})


# ------------------------------------------------------------------------- runner


@dataclass
class PiecewiseRunnerConfig(PrefillRunnerConfig):
    #: Op names (``"ns::name"``) the compiled graph is split at; they run eagerly.
    #: None takes the adapter's :attr:`~graphslot.runners.prefill_adapter.PrefillAdapter.split_ops`.
    split_ops: Optional[Sequence[str]] = None


class PiecewiseGraphRunner(PrefillGraphRunner):
    """Compiles the layer stack and captures its pieces per token bucket."""

    config_class = PiecewiseRunnerConfig
    kind = "piecewise"

    def setup(self) -> None:
        split_ops = self.config.split_ops
        if split_ops is None:
            split_ops = self.adapter.split_ops
        if not split_ops:
            raise ValueError("no split ops: pass split_ops=(\"ns::op\", ...) (the custom ops the compiled "
                             "layer stack is split at, e.g. attention)")
        self.split_ops: Tuple[str, ...] = tuple(split_ops)
        self.compiled_modules: List[PiecewiseModule] = []
        self.compiled = torch.compile(self.stack, backend=make_graphslot_backend(self.split_ops,
                                                                                 self.compiled_modules),
                                      dynamic=False, fullgraph=False)

    def _capture_all(self) -> float:
        with _dynamo_limits(4 * len(self.buckets) + 64):
            return super()._capture_all()

    def capture_stack(self, n: int, hidden: torch.Tensor, view: Any) -> SegmentedGraph:
        rec = _Recording(self.backend, self.config.warmup)
        with _recording(rec), torch.no_grad():
            output = self.adapter.run_layer_stack(self.compiled, hidden, view)
        if rec.calls != 1:
            raise GraphCaptureError(
                f"the compiled layer stack ran {rec.calls} Dynamo graphs, not 1 (a graph break, or Dynamo "
                "skipped the frame); code between graphs would not be replayed. Make the stack traceable, "
                "with only the split ops opaque")
        if not rec.module.split_names:
            found = ", ".join(rec.module.custom_ops) or "none"
            raise GraphCaptureError(
                f"none of the split ops {list(self.split_ops)} occurs in the compiled layer stack, so nothing "
                f"would run eagerly between pieces; custom ops it calls: {found}. Name the op as "
                "torch.library registered it (\"namespace::name\")")
        return SegmentedGraph(rec.steps, output)

    def __repr__(self) -> str:
        return f"<PiecewiseGraphRunner backend={self.backend.name} buckets={self.buckets} split_ops={self.split_ops}>"
