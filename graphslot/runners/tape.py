"""The ``cpu`` graph backend: CUDA-graph semantics on the CPU.

Capture runs the callable once under a TorchDispatchMode that records every
ATen op with its tensors *by reference*. Replay re-runs the recorded ops on
those same tensors and writes each result into the tensor the op produced at
capture, so every address stays fixed and Python control flow, Python scalars
and shapes are frozen at capture -- exactly what a CUDA graph does. It is not a
re-run of the Python function, so runner bugs that only a GPU graph would show
(stale inputs, values read on the host, data-dependent shapes) show up in CPU
tests too.

Differences from a GPU that cannot be helped, since every tensor here lives on
the "device":

* ``.tolist()`` and ``.numpy()`` do not reach the dispatcher on a CPU tensor
  (on a GPU ``.tolist()`` is an ``aten._to_copy`` to the host), so capture
  patches both methods on ``torch.Tensor`` for its duration; a tensor meant to
  stay on the host cannot be read either, and other threads see the patch.
* ``.cpu()`` / ``.to("cpu")`` are no-ops here, not device-to-host copies.
* Some CPU kernels sync where their CUDA kernels do not (``F.one_hot`` with a
  given ``num_classes`` checks its indices with ``.item()`` on the CPU only).
* Nothing is freed during capture, so intermediates never share memory.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphslot.runners.graph_backend import GraphCaptureError

_SYNC_HINT = (
    "a CUDA graph cannot hand device values to the host during capture; keep the value "
    "on the device (e.g. torch.where instead of a Python branch) or compute it before capture"
)
_SHAPE_HINT = (
    "a CUDA graph needs every shape fixed at capture; use a fixed-shape form (a mask with "
    "torch.where/masked_fill, integer index tensors, nonzero_static, "
    "repeat_interleave(output_size=...)) or do it before capture"
)
# Explicit lists back up the tags, which older torch versions lack on some ops.
_HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default",  # .item(), bool(t), int(t), float(t), if t:
    "aten.item.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
    "aten.allclose.default",
})
_DYNAMIC_SHAPE_OPS = frozenset({
    "aten.nonzero.default", "aten.nonzero.out", "aten.nonzero_numpy.default",
    "aten.masked_select.default", "aten.masked_select.out",
    "aten._unique.default", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten.bincount.default",
    "aten.repeat_interleave.Tensor",
})
# Boolean-mask indexing needs nonzero() (a sync) inside the kernel; integer indices are fine.
_INDEX_OPS = frozenset({
    "aten.index.Tensor", "aten.index.Tensor_out", "aten.index_put.default",
    "aten.index_put_.default", "aten._index_put_impl_.default",
})
# Allocation only: on a GPU these launch no kernel, so there is nothing to replay.
_ALLOC_OPS = frozenset({
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.new_empty.default", "aten.new_empty_strided.default",
})
# torch.tensor(data) inside capture: a host constant copied in (a memcpy node on a GPU).
_CONST_OPS = frozenset({"aten.lift_fresh.default", "aten.lift_fresh_copy.default"})
_SYNC_SOURCES = {
    "aten._local_scalar_dense.default": " (from .item(), bool(t), int(t), float(t) or `if t:`)",
}
_TAG_SYNC = getattr(torch.Tag, "data_dependent_output", None)
_TAG_SHAPE = getattr(torch.Tag, "dynamic_output_shape", None)


def _sync_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"host sync during graph capture: {what}; {_SYNC_HINT}")


def _shape_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"data-dependent output shape during graph capture: {what}; {_SHAPE_HINT}")


def _check_index(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return _shape_error(f"{name} with a boolean mask (x[mask] / x[mask] = v)")
    return None


def _check_repeat(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    return _shape_error(f"{name} without output_size") if kwargs.get("output_size") is None else None


@dataclass(frozen=True)
class _OpInfo:
    kind: str  # "alloc" | "const" | "view" | "mutate" | "compute"
    check: Optional[Callable[[str, tuple, dict], Optional[GraphCaptureError]]]
    out_kwargs: frozenset  # write-only out= arguments: not inputs of the graph


@functools.lru_cache(maxsize=None)
def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    name, tags, schema = str(func), set(func.tags), func._schema
    check = None
    if name in _HOST_SYNC_OPS or _TAG_SYNC in tags:
        check = lambda n, a, k: _sync_error(n + _SYNC_SOURCES.get(n, ""))
    elif name in _INDEX_OPS:
        check = _check_index
    elif name == "aten.repeat_interleave.Tensor":
        check = _check_repeat
    elif name in _DYNAMIC_SHAPE_OPS or _TAG_SHAPE in tags:
        check = lambda n, a, k: _shape_error(n)
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if name in _ALLOC_OPS:
        kind = "alloc"
    elif name in _CONST_OPS:
        kind = "const"
    elif torch.Tag.inplace_view in tags:
        kind = "view"  # squeeze_, t_, as_strided_ ...: metadata only, no kernel
    elif writes:
        kind = "mutate"
    elif func.is_view or any(r.alias_info is not None for r in schema.returns):
        kind = "view"
    else:
        kind = "compute"
    out_kwargs = frozenset(a.name for a in schema.arguments if getattr(a, "is_out", False))
    return _OpInfo(kind, check, out_kwargs)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """Tensor leaves of op args: ATen nests at most Tensor[] inside the arg tuple."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _swap(x: Any, new: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return new.get(id(x), x)
    if isinstance(x, (tuple, list)):
        return type(x)(_swap(y, new) for y in x)
    if isinstance(x, dict):
        return {k: _swap(v, new) for k, v in x.items()}
    return x


def _meta(t: torch.Tensor) -> Optional[tuple]:
    return (t.size(), t.stride(), t.storage_offset()) if t.layout is torch.strided else None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class _Record:
    func: torch._ops.OpOverload
    info: _OpInfo
    args: tuple
    kwargs: dict
    out: Any
    metas: list  # (tensor, metadata right after the op) for every tensor it touched
    const: Optional[torch.Tensor] = None  # value of a host constant at capture


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[_Record] = []
        self.error: Optional[GraphCaptureError] = None

    def fail(self, error: GraphCaptureError) -> GraphCaptureError:
        # Like CUDA stream capture, the first error poisons the whole capture even
        # if the callable catches it.
        self.error = self.error or error
        return error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = _op_info(func)
        if info.check is not None:
            error = info.check(str(func), args, kwargs)
            if error is not None:
                raise self.fail(error)
        out = func(*args, **kwargs)
        metas = [(t, _meta(t)) for t in _tensors((args, kwargs, out))]
        const = out.clone() if info.kind == "const" else None
        self.records.append(_Record(func, info, args, kwargs, out, metas, const))
        return out


@contextlib.contextmanager
def _host_reads_forbidden(recorder: _Recorder) -> Iterator[None]:
    """Make ``.tolist()``/``.numpy()`` fail: they read CPU storage without dispatching."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy")}

    def forbid(name: str) -> Callable:
        def method(self, *args, **kwargs):
            raise recorder.fail(_sync_error(
                f"Tensor.{name}() (a device-to-host copy, aten._to_copy to cpu on a GPU)"))
        return method

    for name in saved:
        setattr(torch.Tensor, name, forbid(name))
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)


def _copy_into(dst: torch.Tensor, call: Callable[[], torch.Tensor]) -> None:
    dst.copy_(call())


def _copy_many(pairs: list[tuple[int, torch.Tensor]], call: Callable[[], Any]) -> None:
    result = call()
    for i, dst in pairs:
        dst.copy_(result[i])


class TapeGraph:
    """A captured op tape; :meth:`replay` re-runs it on the capture's tensors."""

    def __init__(self, records: list[_Record], output: Any) -> None:
        self.output = output
        self.ops: list[str] = [str(r.func) for r in records]
        self._records = [self._pin_metadata(r) for r in records]
        #: Storages the graph allocates or writes: its own, never a stale input.
        self.produced: set[int] = self._produced_storages()
        self._steps = [s for s in map(self._step, self._records) if s is not None]

    @property
    def num_replay_ops(self) -> int:
        return len(self._steps)

    def replay(self) -> None:
        # Inference mode: no autograd bookkeeping, and in-place writes into
        # inference tensors made by a capture under inference_mode are allowed.
        with torch.inference_mode():
            for step in self._steps:
                step()

    @staticmethod
    def _pin_metadata(rec: _Record) -> _Record:
        """Point the record at its tensors as they were when the op ran.

        An in-place view op later in the capture (``squeeze_`` inside
        ``F.linear`` on 1-D input) changes a tensor object's shape; the op that
        ran before it must keep seeing the old shape, on the same storage.
        """
        new = {}
        for t, meta in rec.metas:
            if meta is not None and _meta(t) != meta and id(t) not in new:
                with torch.no_grad():
                    new[id(t)] = t.as_strided(*meta)
        if new:
            rec.args, rec.kwargs, rec.out = _swap((rec.args, rec.kwargs, rec.out), new)
        rec.metas = []
        return rec

    @staticmethod
    def _fresh_outputs(rec: _Record) -> list[tuple[int, torch.Tensor]]:
        """(position, tensor) of outputs in new memory; ``_unsafe_view`` is a view by another name."""
        inputs = {_storage(t) for t in _tensors((rec.args, rec.kwargs))}
        outs = rec.out if isinstance(rec.out, (tuple, list)) else (rec.out,)
        return [(i, t) for i, t in enumerate(outs)
                if isinstance(t, torch.Tensor) and _storage(t) not in inputs]

    def _produced_storages(self) -> set[int]:
        produced: set[int] = set()
        for rec in self._records:
            if rec.info.kind == "alloc":
                produced.update(_storage(t) for t in _tensors(rec.out))
            elif rec.info.kind == "const":  # the host constant is the graph's own too
                produced.update(_storage(t) for t in _tensors((rec.args, rec.out)))
            elif rec.info.kind == "compute":
                produced.update(_storage(t) for _, t in self._fresh_outputs(rec))
        return produced

    def _step(self, rec: _Record) -> Optional[Callable[[], Any]]:
        kind = rec.info.kind
        if kind in ("alloc", "view"):
            return None  # no kernel; views alias storage that replay updates
        if kind == "const":
            return functools.partial(rec.out.copy_, rec.const)
        call = functools.partial(rec.func, *rec.args, **rec.kwargs)
        if kind == "mutate":
            return call
        if isinstance(rec.out, torch.Tensor):
            fresh = self._fresh_outputs(rec)
            return functools.partial(_copy_into, rec.out, call) if fresh else None
        if isinstance(rec.out, (tuple, list)):
            fresh = self._fresh_outputs(rec)
            return functools.partial(_copy_many, fresh, call) if fresh else None
        return call  # no tensor output (an assert, say): re-run it for its effect

    def external_inputs(self, statics: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Tensors the graph reads that it neither made nor was told are static.

        On a GPU these are addresses baked into the graph at capture: writing a
        new tensor to the same Python name later does not reach the graph.
        In-place targets count as reads; write-only ``out=`` arguments do not.
        One tensor per storage, in the order the graph first reads them.
        """
        known = self.produced | {_storage(t) for t in statics}
        found: dict[int, torch.Tensor] = {}
        for rec in self._records:
            if rec.info.kind in ("alloc", "const"):
                continue  # empty_like(t) reads no data; constants are the graph's own
            reads = [rec.args] + [v for k, v in rec.kwargs.items() if k not in rec.info.out_kwargs]
            for t in _tensors(reads):
                ptr = _storage(t)
                if ptr and ptr not in known and ptr not in found:
                    found[ptr] = t
        return list(found.values())

    def describe_external_inputs(self, statics: Iterable[torch.Tensor] = ()) -> list[str]:
        """``"(4, 8) float32"`` per external input, for error messages."""
        return [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                for t in self.external_inputs(statics)]

    def __repr__(self) -> str:
        return f"TapeGraph({len(self.ops)} ops, {self.num_replay_ops} replayed)"


class TapeBackend:
    """Graph backend ``cpu``: captures :class:`TapeGraph` s."""

    name = "cpu"

    def capture(self, fn: Callable[[], Any], *, warmup: int = 1) -> TapeGraph:
        for _ in range(warmup):
            fn()
        capture = self.begin_capture()
        try:
            output = fn()
        except BaseException:
            capture.abort()
            raise
        return capture.end(output)

    def begin_capture(self) -> "OpenTapeCapture":
        """Start recording now; ``end(output)`` returns the graph. For runners that cut
        one run of Python code into several graphs (breakable capture)."""
        return OpenTapeCapture()


class OpenTapeCapture:
    """A tape capture in progress: the recorder and the host-read guard are entered."""

    def __init__(self) -> None:
        self.recorder = _Recorder()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_host_reads_forbidden(self.recorder))
        self._stack.enter_context(self.recorder)

    def end(self, output: Any) -> TapeGraph:
        self._stack.close()
        if self.recorder.error is not None:
            raise self.recorder.error
        return TapeGraph(self.recorder.records, output)

    def abort(self) -> None:
        self._stack.close()
