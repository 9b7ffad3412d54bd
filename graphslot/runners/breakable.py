"""The breakable prefill graph runner: graph segments with eager steps between them.

``@eager_on_graph`` marks a function that must run eagerly inside a capture (for the
reference model: attention, whose extend metadata depends on per-request lengths).
While a breakable capture is active, calling it

1. ends the current graph segment,
2. runs the function eagerly and records an eager step that, at replay, re-runs it
   with the *same* arguments (static tensors, fixed addresses) and copies its result
   into the tensors it returned at capture,
3. opens the next segment.

Replay alternates segments and eager steps. Outside a breakable capture (eager runs,
warm-up, the decode runner) the decorator is a plain call.

Segments are captured with the low-level begin/end form of capture that CUDA graphs
have (``capture_begin``/``capture_end``): a backend may provide
``begin_capture() -> handle`` with ``handle.end(output) -> Graph`` and
``handle.abort()``; the two shipped backends (``cpu`` tape, ``cuda``) are handled
here (on CUDA every segment is its own ``CUDAGraph`` in the backend's shared pool).

The runner captures the adapter's layer stack once per token bucket over the prefill
spec's token-padded buffers (batch size not padded), so one graph serves batches of
any number of requests; the embedding head and the logits tail run eagerly on the
live batch, and the attention metadata hook runs on the live batch at every replay.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten
from tqdm import tqdm

from ..api import build_registry
from .graph_backend import GraphCaptureError, get_graph_backend
from .prefill_adapter import PrefillAdapter, resolve_layer_stack

# --------------------------------------------------------------------------- decorator

_STATE = threading.local()


def _active() -> Optional["_BreakableCapture"]:
    return getattr(_STATE, "capture", None)


def eager_on_graph(fn: Callable) -> Callable:
    """Mark ``fn`` to run eagerly (a graph break) inside a breakable capture."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cap = _active()
        if cap is None or cap.in_eager:
            return fn(*args, **kwargs)
        return cap.break_for(fn, args, kwargs)

    wrapper.__graphslot_eager_on_graph__ = fn
    return wrapper


def is_eager_on_graph(fn: Callable) -> bool:
    return hasattr(fn, "__graphslot_eager_on_graph__")


# ------------------------------------------------------------------ segment capture


def begin_segment(backend: Any) -> Any:
    """Open a capture on ``backend``; the handle's ``end(output)`` returns its Graph."""
    begin = getattr(backend, "begin_capture", None)
    if not callable(begin):
        raise GraphCaptureError(
            f"graph backend {getattr(backend, 'name', type(backend).__name__)!r} cannot capture "
            "segments; give it begin_capture() returning a handle with end(output) and abort()")
    return begin()


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


class EagerStep:
    """An eager call between two segments; replay re-runs it on the captured arguments
    and copies the result into the tensors it returned at capture."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, result: Any) -> None:
        self.fn, self.args, self.kwargs, self.result = fn, args, kwargs, result
        self.name = _fn_name(fn)
        self._leaves = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]

    def __call__(self) -> None:
        with torch.no_grad():
            new = self.fn(*self.args, **self.kwargs)
        leaves = [t for t in tree_flatten(new)[0] if isinstance(t, torch.Tensor)]
        if len(leaves) != len(self._leaves):
            raise GraphCaptureError(f"eager step {self.name} returned {len(leaves)} tensors at replay, "
                                    f"{len(self._leaves)} at capture")
        for dst, src in zip(self._leaves, leaves):
            if dst.shape != src.shape:
                raise GraphCaptureError(f"eager step {self.name} returned shape {tuple(src.shape)} at "
                                        f"replay, {tuple(dst.shape)} at capture; its shapes must be fixed")
            if dst is not src:
                dst.copy_(src)

    def __repr__(self) -> str:
        return f"EagerStep({self.name})"


class BreakableGraph:
    """Segments (backend graphs) alternating with :class:`EagerStep` s."""

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

    def external_inputs(self, statics: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
        """What the segments read that nothing keeps current (tape segments only).

        Tensors made by an earlier segment, or returned by an eager step, count as
        the graph's own; what the eager steps read is not checked (they run eagerly).
        """
        known = {t.untyped_storage().data_ptr() for t in statics}
        found: Dict[int, torch.Tensor] = {}
        for step in self.steps:
            if isinstance(step, EagerStep):
                known.update(t.untyped_storage().data_ptr() for t in step._leaves)
                continue
            if not hasattr(step, "external_inputs"):
                raise NotImplementedError("this graph backend cannot list its inputs; capture with 'cpu'")
            for t in step.external_inputs():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in known and ptr not in found:
                    found[ptr] = t
            known.update(getattr(step, "_produced", ()))
        return list(found.values())

    def __repr__(self) -> str:
        return f"BreakableGraph({self.num_segments} segments, {self.num_eager_steps} eager steps)"


class _BreakableCapture:
    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.steps: List[Any] = []
        self.in_eager = False
        self.segment: Any = None
        self.last_break = "the start"

    def _open(self) -> None:
        self.segment = begin_segment(self.backend)

    def _close(self, output: Any) -> Any:
        seg, self.segment = self.segment, None
        try:
            return seg.end(output)
        except GraphCaptureError as e:
            raise self._located(e) from e

    def _located(self, e: GraphCaptureError) -> GraphCaptureError:
        return GraphCaptureError(f"breakable capture, segment {len(self.segments_done())} "
                                 f"(after {self.last_break}): {e}")

    def segments_done(self) -> List[Any]:
        return [s for s in self.steps if not isinstance(s, EagerStep)]

    def break_for(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self.steps.append(self._close(None))
        self.in_eager = True
        try:
            result = fn(*args, **kwargs)
        finally:
            self.in_eager = False
        self.steps.append(EagerStep(fn, args, kwargs, result))
        self.last_break = f"eager step {_fn_name(fn)}"
        self._open()
        return result

    def run(self, fn: Callable[[], Any]) -> BreakableGraph:
        if _active() is not None:
            raise GraphCaptureError("breakable captures cannot nest")
        _STATE.capture = self
        try:
            self._open()
            try:
                output = fn()
            except GraphCaptureError as e:
                raise self._located(e) from e
            self.steps.append(self._close(output))
        finally:
            _STATE.capture = None
            if self.segment is not None:
                self.segment.abort()
                self.segment = None
        return BreakableGraph(self.steps, output)


def capture_breakable(backend: Any, fn: Callable[[], Any], *, warmup: int = 1) -> BreakableGraph:
    """Capture ``fn`` as segments split at :func:`eager_on_graph` calls."""
    for _ in range(warmup):
        fn()  # no capture active: marked functions run as plain calls
    return _BreakableCapture(backend).run(fn)


# ------------------------------------------------------------------------- runner


def default_token_buckets(max_num_tokens: int) -> List[int]:
    """sglang-like piecewise schedule: fine steps for small counts, coarser above."""
    sched = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, 1 << 20, 512)))
    return [n for n in sched if n <= max_num_tokens]


def token_buckets(max_num_tokens: int, explicit: Optional[Sequence[int]] = None) -> List[int]:
    """Buckets to capture, largest first; a default schedule also gets its cap."""
    if explicit is None:
        sizes = default_token_buckets(max_num_tokens)
        if max_num_tokens >= 1 and max_num_tokens not in sizes:
            sizes.append(max_num_tokens)
    else:
        sizes = [n for n in explicit if n >= 1]
    if not sizes:
        raise ValueError(f"no token bucket to capture (max_num_tokens={max_num_tokens}, buckets={explicit})")
    return sorted(set(int(n) for n in sizes), reverse=True)


@dataclass
class BreakableRunnerConfig:
    #: Most requests one prefill batch may hold (the batch size is not padded).
    max_bs: int = 8
    #: Cap of the default bucket schedule.
    max_num_tokens: int = 256
    #: Explicit token buckets; None takes :func:`default_token_buckets`.
    token_buckets: Optional[Sequence[int]] = None
    backend: str = "auto"
    mode: Any = "generated"
    #: Prefill spec params, over the adapter's :meth:`~PrefillAdapter.spec_params`.
    params: Mapping[str, Any] = field(default_factory=dict)
    progress: Optional[bool] = None
    warmup: int = 1


class BreakableGraphRunner:
    """Captures the layer stack per token bucket on construction."""

    def __init__(self, adapter: PrefillAdapter, config: Optional[BreakableRunnerConfig] = None,
                 **overrides: Any):
        config = dataclasses.replace(config or BreakableRunnerConfig(), **overrides)
        self.adapter, self.config = adapter, config
        self.stack = resolve_layer_stack(adapter)
        self.buckets = token_buckets(config.max_num_tokens, config.token_buckets)
        self._ascending = sorted(self.buckets)
        self.max_bs = int(config.max_bs)
        max_tokens = self.buckets[0]
        params = {**adapter.spec_params(), **config.params, "register_input_embeds": True,
                  "hidden_size": adapter.hidden_size, "embed_dtype": adapter.hidden_dtype}
        self.registry = build_registry("prefill", self.max_bs, max_tokens, adapter.device,
                                       params=params, mode=config.mode)
        self.backend = get_graph_backend(config.backend, adapter.device)
        self._side = adapter.side_inputs()
        self.graphs: Dict[int, BreakableGraph] = {}
        self.capture_seconds = self._capture_all()

    # -- capture ---------------------------------------------------------------------
    def _capture_all(self) -> float:
        self.adapter.init_graph_state(self.max_bs, self.buckets[0])
        show = self.config.progress
        start = time.perf_counter()
        bar = tqdm(self.buckets, desc="Capturing breakable prefill graphs", unit="graph", leave=False,
                   disable=None if show is None else not show)
        for n in bar:
            bar.set_postfix(tokens=n)
            self.graphs[n] = self._capture_one(n)
        return time.perf_counter() - start

    def _capture_one(self, n: int) -> BreakableGraph:
        adapter, reg = self.adapter, self.registry
        reg.run_pre_capture(0, n, self._side)
        dummy = adapter.make_dummy_batch(n)
        reg.fill_from(dummy, 0, 0, 0, n, self._side)  # every token row is padding
        view = reg.extract(dummy, 0, n)
        adapter.init_capture_metadata(n, view)
        hidden = view.input_embeds
        stack = self.stack

        def run():
            with torch.no_grad():
                return adapter.run_layer_stack(stack, hidden, view)

        try:
            return capture_breakable(self.backend, run, warmup=self.config.warmup)
        except GraphCaptureError as e:
            raise GraphCaptureError(f"token bucket {n}: {e}") from e

    # -- replay ----------------------------------------------------------------------
    def can_run(self, fb: Any) -> bool:
        if not self.adapter.is_prefill(fb):
            return False
        bs, n = self.adapter.batch_size(fb), self.adapter.num_tokens(fb)
        return 1 <= bs <= self.max_bs and 1 <= n <= self.buckets[0]

    def bucket(self, fb: Any) -> int:
        n = self.adapter.num_tokens(fb)
        return self._ascending[bisect.bisect_left(self._ascending, n)]

    def prepare_replay(self, n: int, view: Any, fb: Any) -> None:
        """The per-replay metadata hook on the live batch (runs at EVERY replay)."""
        self.adapter.init_replay_metadata(n, view, fb)

    def replay(self, fb: Any) -> Any:
        """The eager tail's result for ``fb`` (e.g. logits ``[raw_tokens, vocab]``)."""
        adapter, reg = self.adapter, self.registry
        bs, raw = adapter.batch_size(fb), adapter.num_tokens(fb)
        n = self.bucket(fb)
        with torch.no_grad():
            reg.fill_from(fb, bs, bs, raw, n, self._side)
            view = reg.extract(fb, bs, n)
            view.input_embeds[:raw].copy_(adapter.embed(fb))
            self.prepare_replay(n, view, fb)
            graph = self.graphs[n]
            graph.replay()
            return adapter.logits(graph.output[:raw], fb)

    def __call__(self, fb: Any) -> Any:
        """Replay when a bucket fits, else the eager forward."""
        return self.replay(fb) if self.can_run(fb) else self.adapter.forward_eager(fb)

    # -- figures ---------------------------------------------------------------------
    @property
    def static_bytes(self) -> int:
        return self.registry.nbytes

    def external_inputs(self, n: int) -> List[torch.Tensor]:
        statics = [s.buffer for s in self.registry.active] + list(self.adapter.static_tensors())
        return self.graphs[n].external_inputs(statics)

    def __repr__(self) -> str:
        return f"<BreakableGraphRunner backend={self.backend.name} buckets={self.buckets}>"
