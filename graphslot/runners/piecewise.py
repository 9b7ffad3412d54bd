"""Piecewise capture: traced once, split at declared ops, each piece compiled once, then
one graph per piece per size.

**One trace.** What the phase runner captures (the decode forward, or the prefill layer
stack) is compiled with ``torch.compile(fn, backend=<graphslot backend>, fullgraph=False)``
(:func:`compile_piecewise`). Before each capture the runner marks the padded dimension of
every ``tokens``- and ``bs``-axis slot in the staged view dynamic (:func:`mark_dynamic_rows`),
so Dynamo traces the first (largest) key with that dimension symbolic, and the compiled
function keeps no guards (``guard_filter_fn=torch.compiler.skip_all_guards_unsafe``, as
vLLM compiles): every later key runs that one graph. With guards, a size-1 key would trace
again (a symbolic size is specialised at 0 and 1, and a view of a size-1 dimension guards
on it). That is safe because the runner calls the function with nothing changed between
keys but the marked sizes (the same model, buffers and code; its own code object, so no
other compile of the same model class shares its cache), and a model that branches on
a size in Python would be wrong at other sizes, which the graph == eager tests check.
(Unbacked sizes, which need no guards, fail on models that compare sizes in Python: the
transformers cache checks its slot count against batch x tokens.) ``traces`` counts the
Dynamo graphs.

**A split.** The graphslot backend is a Dynamo custom backend: it splits the FX graph at
every call of a declared *split op* (``split_ops``, op names such as
``"graphslot_ref::attention"``; register the op with ``torch.library.custom_op`` and a
fake impl so Dynamo does not trace into it), with
:func:`torch.fx.passes.split_module.split_module`. Each split op is a submodule of its own
that runs eagerly; every other submodule is a *piece*.

**A compile per piece.** Each piece is compiled once, for the symbolic shape, by
``compile_backend`` (:func:`compile_pieces`: the split module run on the trace's fake
inputs, each piece handed to the compiler with its fake arguments):

* ``"inductor"``, the default on CUDA, as the engines compile;
* ``"aot_eager"``, the default on the CPU tape: AOTAutograd lowers the piece to ATen ops
  (functionalised, decomposed) and runs them through the dispatcher, where the tape's
  recorder sees every one, so a tape graph of an ``aot_eager`` piece replays what the
  compiled piece computes (tests/test_piecewise_runner.py checks graph == eager bit for
  bit, and that the tape recorded the pieces' ops). Inductor's CPU kernels are C++ the
  tape cannot record: under them a capture would record nothing and replay nothing;
* ``"eager"``: no compiler, the pieces run as plain FX modules (for debugging).

A backend that raises on a piece is a ``GraphCaptureError`` naming the piece and the backend
(Dynamo would report its own ``BackendCompilerFailed``; :class:`PiecewiseFunction` unwraps it).

**Captures per size** (:func:`capture_piecewise`). The compiled function runs once as a
warm-up for the key (not once per piece), then once as a *capture pass*: each piece is
captured through the graph backend (``backend.capture(lambda: piece(*inputs), warmup=0,
stream=)``; its inputs are static buffers or what earlier pieces and split ops returned,
so their addresses are fixed) and each split op runs eagerly and is recorded as an
:class:`~graphslot.graphs.segments.EagerStep`. The result is a
:class:`~graphslot.graphs.segments.SegmentedGraph` whose segments are the pieces: replay
runs ``[piece, split op, piece, ..., piece]``; the compiled function itself runs only in
warm-ups and capture passes. The pieces' intermediate outputs are then held weakly
(:meth:`~graphslot.graphs.segments.SegmentedGraph.hold_weakly`): a key keeps its last
piece's output and what its split ops returned. A split op that takes an output buffer
(a mutated ``out`` argument, allocated by the traced code before the call, as the
reference attention does) writes where the next piece reads, with no copy at replay.

Dynamo traces the function with its batch argument (the registry's padded view); its
tensor fields become graph inputs, which are the registry's static buffers, so no
wrapper module is needed. A graph break (more than one Dynamo graph per capture pass)
is an error: Python code between two Dynamo graphs would run at capture only.

Split-op handles (:func:`op_handle`, :func:`op_object`) live in :mod:`.handles`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.passes.split_module import split_module

from ..graphs.backend import GraphBackend, GraphCaptureError
from ..graphs.segments import EagerStep, SegmentedGraph
from ..graphs.util import entered, stream_kwargs, warm_up
from .handles import op_handle, op_object

__all__ = ["COMPILE_BACKENDS", "PiecewiseFunction", "PiecewiseModule", "capture_piecewise", "compile_pieces",
           "compile_piecewise", "default_compile_backend", "make_graphslot_backend", "mark_dynamic_rows", "op_handle",
           "op_name", "op_object", "split_graph", "view_rows"]

#: The compilers a piece may be compiled by (any other Dynamo backend name is passed on).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

_STATE = threading.local()


def default_compile_backend(graph_backend: str) -> str:
    """``"inductor"`` for CUDA graphs, ``"aot_eager"`` for the tape (module docstring)."""
    return "inductor" if graph_backend == "cuda" else "aot_eager"


def op_name(target: Any) -> Optional[str]:
    """``"ns::name"`` of an FX call_function target that is a torch op, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


# ------------------------------------------------------------ split and compile


class PiecewiseModule:
    """What the graphslot backend returns for one Dynamo graph: the split module (its
    pieces compiled), run plainly, or piece by piece while a capture pass is recording."""

    def __init__(self, split_gm: torch.fx.GraphModule, split_names: Mapping[str, str], num_pieces: int,
                 custom_ops: Sequence[str] = ()):
        self.split_gm = split_gm
        self.split_names = dict(split_names)
        self.num_pieces = num_pieces
        #: Non-aten ops the Dynamo graph calls: what a mistyped split op should have named.
        self.custom_ops = tuple(custom_ops)
        #: Pieces compiled (once each, for the symbolic shape).
        self.compiled_pieces = 0

    @property
    def num_split_ops(self) -> int:
        return len(self.split_names)

    @property
    def piece_names(self) -> List[str]:
        calls = [n.target for n in self.split_gm.graph.nodes if n.op == "call_module"]
        return [name for name in calls if name not in self.split_names]

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


def _tuple_output(piece: torch.fx.GraphModule) -> bool:
    """Make ``piece`` return a tuple (what the compilers take); whether it returned one value."""
    output = next(n for n in piece.graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return False
    output.args = ((output.args[0],),)
    piece.recompile()
    return True


def _first(compiled: Callable) -> Callable:
    def single(*args: Any) -> Any:
        return compiled(*args)[0]

    return single


def piece_label(index: int, target: str, after: str) -> str:
    """How an error names a piece: ``piece 1 (submod_2, after <split op>)``."""
    return f"piece {index} ({target}, after {after})"


def backend_name(compile_backend: Any) -> str:
    return compile_backend if isinstance(compile_backend, str) else getattr(compile_backend, "__name__", "?")


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split module on fake inputs, compiling each piece with its fake arguments."""

    def __init__(self, module: PiecewiseModule, compiler: Callable, name: str):
        super().__init__(module.split_gm)
        self.extra_traceback = False
        self.pieces = set(module.piece_names)
        self.split_names = module.split_names
        self.compiler = compiler
        self.name = name  # the compile_backend, as errors name it
        self.count = 0
        self.after = "the start"  # the last split op run

    def call_module(self, target, args, kwargs):
        output = super().call_module(target, args, kwargs)
        self.after = self.split_names.get(target, self.after)
        if target in self.pieces:
            piece = self.fetch_attr(target)
            single = _tuple_output(piece)
            try:
                compiled = self.compiler(piece, list(args))
            except Exception as e:  # Dynamo would report it as its own BackendCompilerFailed: PiecewiseFunction
                where = piece_label(self.count, target, self.after)
                fix = ("compile the pieces with compile_backend='eager' (no compiler) to tell the backend's failure "
                       "from the model's")
                raise GraphCaptureError(f"{where}: compile_backend '{self.name}' raised {type(e).__name__}: {e}; "
                                        f"{fix}") from e
            self.module.__dict__[target] = _first(compiled) if single else compiled  # shadows the submodule
            self.count += 1
        return output


def compile_pieces(module: PiecewiseModule, example_inputs: Sequence[Any], compile_backend: Any) -> None:
    """Compile every piece of ``module`` once with ``compile_backend`` (a Dynamo backend
    name, or a ``(gm, example_inputs)`` callable; ``"eager"``: left as they are)."""
    if compile_backend == "eager":
        return
    compiler = torch._dynamo.lookup_backend(compile_backend) if isinstance(compile_backend, str) else compile_backend
    fake_mode = detect_fake_mode(example_inputs) or detect_fake_mode()
    fake = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    runner = _PieceCompiler(module, compiler, backend_name(compile_backend))
    shape_env = fake_mode.shape_env
    # The trace bound the sizes a piece makes (an .item() Dynamo was told to keep); running the
    # pieces again on fake inputs makes them anew, bound by nothing: not an error here.
    fresh = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
    with fake_mode, enable_python_dispatcher(), fresh:
        runner.run(*fake)
    module.compiled_pieces = runner.count


def make_graphslot_backend(split_ops: Sequence[str], compiled: Optional[list] = None, compile_backend: Any = "eager"):
    """A Dynamo backend ``(gm, example_inputs) -> callable`` splitting at ``split_ops`` and
    compiling each piece with ``compile_backend``; each :class:`PiecewiseModule` it makes
    is appended to ``compiled``."""

    def graphslot_backend(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> PiecewiseModule:
        module = split_graph(gm, split_ops)
        if module.split_names:  # else nothing splits: capture_piecewise says so, naming the ops there are
            compile_pieces(module, example_inputs, compile_backend)
        if compiled is not None:
            compiled.append(module)
        return module

    return graphslot_backend


#: Compiles one function may make (only a graph break or a guard on something other than
#: the marked sizes recompiles; the room is so that this never turns into eager runs).
RECOMPILE_LIMIT = 1024


def _dynamo_limits():
    cfg = torch._dynamo.config
    names = [k for k in ("recompile_limit", "accumulated_recompile_limit") if hasattr(cfg, k)]
    return cfg.patch(**{k: max(getattr(cfg, k), RECOMPILE_LIMIT) for k in names})


def _no_size_guards(entries: Sequence[Any]) -> List[bool]:
    """Keep every guard but the shape environment's (what the marked sizes satisfied at the
    trace: ``!= 1``, ranges, relations), module docstring."""
    return [entry.guard_type != "SHAPE_ENV" for entry in entries]


def _own_frame(fn: Callable) -> Callable:
    """A function calling ``fn`` whose code object is its own: Dynamo keeps its compiled
    graphs on the code object of the frame it compiles, so this function's one graph is
    the only entry there, whatever else compiled ``fn``'s code (another runner over the
    same model class, whose graph, with no guards either, would otherwise run here)."""

    def frame(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    frame.__code__ = frame.__code__.replace()
    return frame


class PiecewiseFunction:
    """``fn`` compiled to split at the split ops (:func:`compile_piecewise`), with no
    guards (module docstring); call it as ``fn``."""

    def __init__(self, fn: Callable, split_ops: Sequence[str], compile_backend: Any):
        self.split_ops = tuple(split_ops)
        self.compile_backend = compile_backend
        #: One :class:`PiecewiseModule` per Dynamo graph compiled.
        self.compiled_modules: List[PiecewiseModule] = []
        backend = make_graphslot_backend(split_ops, self.compiled_modules, compile_backend)
        self._compiled = torch.compile(_own_frame(fn), backend=backend, fullgraph=False,
                                       options={"guard_filter_fn": _no_size_guards})

    @property
    def traces(self) -> int:
        """Dynamo traces so far: 1 for any number of sizes, when the sizes are marked."""
        return len(self.compiled_modules)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with _dynamo_limits():
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as failed:
            error = failed.inner_exception
            if not isinstance(error, GraphCaptureError):
                raise
        raise error.with_traceback(None) from error.__cause__  # a piece's compile failed: ours, not Dynamo's


def compile_piecewise(fn: Callable, split_ops: Sequence[str], compile_backend: Any = "aot_eager") -> PiecewiseFunction:
    """``fn`` (a module or function) compiled to split at ``split_ops``, each piece compiled
    once by ``compile_backend`` (module docstring)."""
    return PiecewiseFunction(fn, split_ops, compile_backend)


RowDims = Iterable[Tuple[torch.Tensor, int]]


def mark_dynamic_rows(dims: RowDims) -> None:
    """Mark each ``(tensor, dim)`` -- the padded dimension of a staged slot -- dynamic, so
    that the trace is symbolic in it (module docstring); a size Dynamo specialises (0, 1:
    a runner whose only key is 1) is no error."""
    for tensor, dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def view_rows(view: Any, registry: Any, axes: Union[Tuple[str, ...], Sequence[str]] = ("bs", "tokens")) -> RowDims:
    """``(tensor, dim)`` of every ``axes`` slot the view carries: the padded dimension."""
    for slot in registry.active:
        spec = slot.resolved
        tensor = getattr(view, spec.name, None)
        if str(spec.axis) in axes and isinstance(tensor, torch.Tensor) and not spec.structured:
            yield tensor, spec.slice_dim


# ------------------------------------------------------------ the capture pass


class _Recording:
    """Active during one capture pass: compiled graphs capture into it."""

    def __init__(self, backend: Any, context: Optional[Callable[[], Any]] = None, stream: Any = None) -> None:
        self.backend = backend
        self.context = context
        self.stream = stream
        self.steps: List[Any] = []
        self.calls = 0
        self.module: Optional[PiecewiseModule] = None  # the Dynamo graph that ran


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
        super().__init__(split_gm, garbage_collect_values=False)  # every value lives through the pass
        self.extra_traceback = False  # our errors name the piece; FX would append its node dump
        self.split_names = split_names
        self.rec = rec

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
                graph = rec.backend.capture(piece, warmup=0, **stream_kwargs(rec.stream))
        except GraphCaptureError as e:
            after = next((s.name for s in reversed(rec.steps) if isinstance(s, EagerStep)), "the start")
            index = sum(not isinstance(s, EagerStep) for s in rec.steps)
            raise GraphCaptureError(f"{piece_label(index, target, after)}: {e}") from e
        rec.steps.append(graph)
        return graph.output


def capture_piecewise(backend: GraphBackend, run: Callable[[], Any], split_ops: Sequence[str], *, warmup: int = 1,
                      context: Optional[Callable[[], Any]] = None, stream: Any = None) -> SegmentedGraph:
    """``warmup`` plain runs of ``run`` (which calls a :func:`compile_piecewise` function;
    the first traces and compiles), then one capture pass: its pieces captured on
    ``backend`` (on ``stream``; each inside ``context()`` when given), its split ops eager."""
    with torch.no_grad():
        warm_up(backend, run, warmup, stream)
    rec = _Recording(backend, context, stream)
    with _recording(rec), torch.no_grad():
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
    graph = SegmentedGraph(rec.steps, output)
    graph.hold_weakly()
    return graph
