"""Piecewise capture: ``torch.compile`` split at declared ops, each piece a graph.

What the phase runner captures (the decode forward, or the prefill layer stack) is
compiled with ``torch.compile(fn, backend=<graphslot backend>, dynamic=False,
fullgraph=False)`` (:func:`compile_piecewise`). The graphslot backend
is a Dynamo custom backend: it splits the FX graph at every call of a declared *split
op* (``split_ops``, op names such as ``"graphslot_ref::attention"``; register the op
with ``torch.library.custom_op`` and a fake impl so Dynamo does not trace into it),
with :func:`torch.fx.passes.split_module.split_module`. Each split op is a submodule of
its own that runs eagerly; every other submodule is a *piece*.

Capture, per graph key (:func:`capture_piecewise`): a *capture pass* runs the compiled
function once on the staged dummy batch. During that pass each piece is captured
through the graph backend (``backend.capture(lambda: piece(*inputs))``, inside the
engine's capture context; its inputs are static buffers or what earlier pieces and
split ops returned, so their addresses are fixed) and each split op runs eagerly and
is recorded as an :class:`~graphslot.graphs.segments.EagerStep`. The result is a
:class:`~graphslot.graphs.segments.SegmentedGraph` whose segments are the pieces:
replay runs ``[piece, split op, piece, ..., piece]``; the compiled function itself runs
only in capture passes.

Dynamo traces the function with its batch argument (the registry's padded view); its
tensor fields become graph inputs, which are the registry's static buffers, so no
wrapper module is needed. A graph break (more than one Dynamo graph per capture pass)
is an error: Python code between two Dynamo graphs would run at capture only.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from ..graphs.backend import GraphBackend, GraphCaptureError
from ..graphs.segments import EagerStep, SegmentedGraph
from ..graphs.util import entered, stream_kwargs

# ------------------------------------------------------------ the Dynamo backend

_STATE = threading.local()
_OP_OBJECTS: Dict[int, "weakref.ref[Any]"] = {}
_NEXT_HANDLE = itertools.count(1)


def op_handle(obj: Any) -> int:
    """An integer naming ``obj`` to a split op (a custom op takes no Python objects): one per
    object, kept on it as ``obj._graphslot_handle``, which :func:`op_object` reads back when
    the op runs. The handle holds ``obj`` weakly: a model dropped with its runner is freed
    (``obj`` must take weak references, as modules and plain objects do)."""
    handle = getattr(obj, "_graphslot_handle", None)
    if handle is None or op_object_or_none(handle) is not obj:
        handle = next(_NEXT_HANDLE)
        try:
            _OP_OBJECTS[handle] = weakref.ref(obj, functools.partial(_forget, handle))
        except TypeError:
            raise TypeError(f"op_handle() needs an object that takes weak references; a {type(obj).__name__} "
                            "does not (give its class __weakref__ in __slots__, or pass an object that holds it)") from None
        obj._graphslot_handle = handle
    return handle


def _forget(handle: int, _ref: Any) -> None:
    _OP_OBJECTS.pop(handle, None)
    _FREED.add(handle)


#: Handles whose objects were freed: op_object says so rather than "never given out".
_FREED: Set[int] = set()


def op_object_or_none(handle: int) -> Any:
    """The object :func:`op_handle` named ``handle``, or None (never named, or freed)."""
    ref = _OP_OBJECTS.get(handle)
    return None if ref is None else ref()


def op_object(handle: int) -> Any:
    """The object :func:`op_handle` named ``handle``; a LookupError once it was freed."""
    obj = op_object_or_none(handle)
    if obj is not None:
        return obj
    if handle in _FREED:
        raise LookupError(f"split-op handle {handle} names an object that was freed: a split op ran after the model "
                          "(or attention backend) it belongs to was dropped")
    raise LookupError(f"split-op handle {handle} was never given out by op_handle()")


def op_name(target: Any) -> Optional[str]:
    """``"ns::name"`` of an FX call_function target that is a torch op, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


class _Recording:
    """Active during one capture pass: compiled graphs capture into it."""

    def __init__(self, backend: Any, warmup: int, context: Optional[Callable[[], Any]] = None,
                 stream: Any = None) -> None:
        self.backend, self.warmup, self.context, self.stream = backend, warmup, context, stream
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
            with entered(rec.context):
                graph = rec.backend.capture(piece, warmup=rec.warmup, **stream_kwargs(rec.stream))
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


#: Compiles one function may make: ``dynamic=False`` recompiles per graph key.
RECOMPILE_LIMIT = 1024


def _dynamo_limits():
    """Room for one compile per graph key."""
    cfg = torch._dynamo.config
    names = [k for k in ("recompile_limit", "accumulated_recompile_limit") if hasattr(cfg, k)]
    return cfg.patch(**{k: max(getattr(cfg, k), RECOMPILE_LIMIT) for k in names})


def compile_piecewise(fn: Callable, split_ops: Sequence[str]) -> Callable:
    """``fn`` (a module or function) compiled to split at ``split_ops``; its
    :class:`PiecewiseModule` s are appended to the result's ``compiled_modules``."""
    modules: List[PiecewiseModule] = []
    compiled = torch.compile(fn, backend=make_graphslot_backend(split_ops, modules), dynamic=False, fullgraph=False)
    compiled.compiled_modules = modules
    return compiled


def capture_piecewise(backend: GraphBackend, run: Callable[[], Any], split_ops: Sequence[str], *, warmup: int = 1,
                      context: Optional[Callable[[], Any]] = None, stream: Any = None) -> SegmentedGraph:
    """One capture pass of ``run`` (which calls a :func:`compile_piecewise` function):
    its pieces captured on ``backend`` (each inside ``context()``), its split ops eager."""
    rec = _Recording(backend, warmup, context, stream)
    with _recording(rec), _dynamo_limits(), torch.no_grad():
        output = run()
    if rec.calls != 1:
        raise GraphCaptureError(
            f"the compiled function ran {rec.calls} Dynamo graphs, not 1 (a graph break, or Dynamo skipped the "
            "frame); code between graphs would not be replayed. Make it traceable, with only the split ops opaque")
    if not rec.module.split_names:
        found = ", ".join(rec.module.custom_ops) or "none"
        raise GraphCaptureError(
            f"none of the split ops {list(split_ops)} occurs in the compiled function, so nothing would run "
            f"eagerly between pieces; custom ops it calls: {found}. Name the op as torch.library registered it "
            "(\"namespace::name\")")
    return SegmentedGraph(rec.steps, output)
