"""The ``cpu`` graph backend: CUDA-graph semantics on the CPU.

Capture runs the callable once under a TorchDispatchMode that records every
ATen op with its tensors *by reference*. Replay re-runs the recorded ops on
those same tensors and writes each result into the tensor the op produced at
capture, so every address stays fixed and Python control flow, Python scalars
and shapes are frozen at capture -- exactly what a CUDA graph does. It is not a
re-run of the Python function, so runner bugs that only a GPU graph would show
(stale inputs, values read on the host, data-dependent shapes, host data copied
in) show up in CPU tests too.

Host data and device values
---------------------------

Everything lives on the CPU here, so the tape models the two sides of a GPU by
where a tensor's data comes from, not by its device:

* every tensor an op reads or writes during capture is a *device value*: the
  static buffers, the parameters, and whatever the graph allocates
  (``torch.zeros/empty/full/arange``, op results, device-to-device copies);
* data made from Python during capture is *host data*: ``torch.tensor``,
  ``torch.as_tensor``, ``torch.from_numpy``, ``Tensor.new_tensor`` and an index
  given as a Python list all reach ATen as ``aten.lift_fresh``, which is
  therefore a host-to-device copy and is rejected -- unless it is 0-dim: a host
  scalar (``x[i] = 0.0`` makes one too) is a constant of the graph, as CUDA
  reads a 0-dim CPU operand at capture;
* ``.item()``, ``bool(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()`` and
  ``.to("cpu")`` are *host reads* of a device value and are rejected. The last
  four do not reach the dispatcher on a CPU tensor, so while any capture is open
  they are patched on ``torch.Tensor`` (once for the whole process, reference
  counted); the patched methods fail only in a thread that has a capture open.

Differences from CUDA graphs
----------------------------

Every row is checked by a test in ``tests/test_tape_cuda_fidelity.py`` marked
``@difference("<id>")``; a test there checks that rows and tests match.

======================  =========================================  ==========================================
id                      CUDA graph capture                         tape (this module)
======================  =========================================  ==========================================
host-to-device          torch.tensor / as_tensor / from_numpy /    rejected at ``aten.lift_fresh``:
                        new_tensor / ``x[[0, 1]]`` data copied     GraphCaptureError naming the op, saying
                        in: "Cannot copy between CPU and CUDA      to allocate the tensor before capture
                        tensors during CUDA graph capture"         (same as CUDA)
host-scalar-tensor      a 0-dim CPU tensor operand (``x *          0-dim host data is a constant of the
                        torch.tensor(2.0)``) is read at capture    graph, restored on every replay; it
                        and frozen; ``torch.tensor(2.0,            cannot tell the ``device=`` spelling
                        device="cuda")`` is a copy and fails       from the host one: allowed (laxer)
device-to-host          ``.cpu()``, ``.to("cpu")`` copy to the     ``Tensor.cpu()`` and ``Tensor.to()`` with
                        host: a sync, the capture fails            the device spelled ``"cpu"`` rejected
                                                                   (same as CUDA)
device-object-to        ``.to(torch.device("cpu"))`` is a          a ``torch.device`` target is taken for the
                        device-to-host copy and fails              device (``x.to(x.device)`` is a no-op on a
                                                                   GPU): allowed (laxer)
host-sync               ``.item()``, ``bool(t)``, ``if t:``,       rejected, naming the op or method
                        ``.tolist()``, ``.numpy()``,               (same as CUDA)
                        ``torch.equal`` sync: the capture fails
dynamic-shape           ``nonzero``, ``x[mask]``, ``unique``...    rejected, naming the op (same as CUDA)
                        sync for their output size
host-tensor-reads       reading a tensor that lives on the host    rejected: every tensor is a device
                        (``seq_lens_cpu.tolist()``) is no sync     value (stricter)
host-tensor-unseen      a host tensor made before capture, used    not seen: a tensor made before capture
                        with device tensors, fails (device         or by a path that does not dispatch
                        mismatch or host-to-device copy)           (``torch.frombuffer``) reads as a device
                                                                   value (laxer); ``external_inputs()``
                                                                   lists it when it is not declared static
hidden-host-read        a host read by any means fails or reads    only the patched methods are caught: a
                        stale data                                 method saved before capture, a
                                                                   ``memoryview`` or ``data_ptr()`` read
                                                                   passes (laxer)
cpu-kernel-sync         CUDA kernels of some ops do not sync       their CPU kernels do (``F.one_hot`` with
                                                                   ``num_classes`` checks indices with
                                                                   ``.item()``): rejected (stricter)
overlapping-captures    work goes to the capture of the current    work goes to the innermost open capture
                        stream; captures on one stream cannot      of the thread; captures overlap and end
                        overlap and ``torch.cuda.graph`` restores  in any order, in any threads; host reads
                        streams last-in-first-out                  fail only in a capturing thread
other-threads           in the default "global" capture mode,      other threads are not checked: their
                        unsafe CUDA calls from other threads       host reads work (laxer)
                        fail while a capture is open
unsupported-op          sparse and other layouts may capture       any op on a tensor that is not dense and
                                                                   strided, or that the tape cannot record,
                                                                   raises GraphCaptureError naming the op
                                                                   (stricter)
memory-pool             the graphs of a backend share one pool:    nothing is freed or shared: every tensor
                        memory freed during capture is reused,     keeps its own memory, so a replay never
                        so replaying one graph may overwrite       overwrites another graph's tensors
                        what another graph keeps there             (laxer)
streams                 replay is queued on a stream: reading an   no streams: replay runs to completion
                        output or writing a static input before    before it returns; nothing races (laxer)
                        a sync races with it
collectives             NCCL collectives (functional or c10d) are  re-issued over the process group (gloo on
                        kernels of the graph, launched on its      the CPU) at their place in the tape and
                        stream at replay; every rank must replay   waited for at once; every rank must
                        the same graph or the ranks hang           replay the same graph or the ranks hang
                                                                   (same); funcol's AsyncCollectiveTensor
                                                                   is rejected: call the ops directly
rng                     random ops use the seed and offset the     random ops re-run on the global CPU
                        graph registered, advanced per replay:     generator: new numbers each replay, the
                        new numbers each replay, not the ones      very ones eager code would have drawn
                        eager code would have drawn                next
======================  =========================================  ==========================================
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.utils._python_dispatch as _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from graphslot.graphs.backend import GraphCaptureError

_SYNC_HINT = (
    "a CUDA graph cannot hand device values to the host during capture; keep the value "
    "on the device (e.g. torch.where instead of a Python branch) or compute it before capture"
)
_SHAPE_HINT = (
    "a CUDA graph needs every shape fixed at capture; use a fixed-shape form (a mask with "
    "torch.where/masked_fill, integer index tensors, nonzero_static, "
    "repeat_interleave(output_size=...)) or do it before capture"
)
_H2D_HINT = (
    "a CUDA graph cannot copy host data to the device during capture; allocate the tensor "
    "before capture (a static buffer filled before each replay), build it on the device "
    "(torch.zeros/full/arange) or use a Python scalar"
)
_D2H_HINT = (
    "a CUDA graph cannot copy device values to the host during capture (the copy syncs); "
    "keep the value on the device or read the graph's output after replay"
)
_UNSUPPORTED_HINT = (
    "run it outside the graph (before capture, or in an eager segment) or use dense "
    "strided tensors"
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
# Python data turned into a tensor: torch.tensor, as_tensor, from_numpy, new_tensor, x[[0, 1]].
_HOST_DATA_OPS = frozenset({"aten.lift_fresh.default", "aten.lift_fresh_copy.default"})
_SYNC_SOURCES = {
    "aten._local_scalar_dense.default": " (from .item(), bool(t), int(t), float(t) or `if t:`)",
}
_HOST_DATA_SOURCE = " (torch.tensor, torch.as_tensor, torch.from_numpy, Tensor.new_tensor or a list index)"
# Collectives: functional collectives (torch.distributed._functional_collectives and the
# ops under it) and c10d's own ops (torch.distributed's Python API). Replay re-issues each
# one and waits for it at once; every rank replays the same graph, so they match up.
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d"})
# Waits have nothing left to do at replay: the collective waited when it ran.
_WAIT_OPS = frozenset({"_c10d_functional.wait_tensor.default", "c10d_functional.wait_tensor.default"})
_ASYNC_WRAPPER_OP = "_c10d_functional._wrap_tensor_autograd.default"
_TAG_SYNC = getattr(torch.Tag, "data_dependent_output", None)
_TAG_SHAPE = getattr(torch.Tag, "dynamic_output_shape", None)


def _sync_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"host sync during graph capture: {what}; {_SYNC_HINT}")


def _shape_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"data-dependent output shape during graph capture: {what}; {_SHAPE_HINT}")


def _host_to_device_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"host-to-device copy during graph capture: {what}; {_H2D_HINT}")


def _device_to_host_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"device-to-host copy during graph capture: {what}; {_D2H_HINT}")


def _unsupported_error(op: str, why: str) -> GraphCaptureError:
    return GraphCaptureError(f"the cpu graph backend cannot record {op}: {why}; {_UNSUPPORTED_HINT}")


def _check_index(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return _shape_error(f"{name} with a boolean mask (x[mask] / x[mask] = v)")
    return None


def _check_host_data(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    # A 0-dim host tensor is a scalar operand, which CUDA reads at capture; x[i] = 0.0
    # makes one too.
    return _host_to_device_error(name + _HOST_DATA_SOURCE) if args[0].dim() > 0 else None


def _check_repeat(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    return _shape_error(f"{name} without output_size") if kwargs.get("output_size") is None else None


@dataclass(frozen=True)
class _OpInfo:
    kind: str  # "alloc" | "scalar" | "view" | "mutate" | "compute" | "collective"
    check: Optional[Callable[[str, tuple, dict], Optional[GraphCaptureError]]]
    out_kwargs: frozenset  # write-only out= arguments: not inputs of the graph


def _check_async_wrapper(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    torch.ops._c10d_functional.wait_tensor(args[0])  # the collective ran: leave no work pending
    return _unsupported_error(name, "torch.distributed._functional_collectives wraps results in "
                              "AsyncCollectiveTensor, a tensor subclass, outside torch.compile; call "
                              "torch.ops._c10d_functional.<collective> and wait_tensor directly")


def _op_check(name: str, tags: set) -> Optional[Callable[[str, tuple, dict], Optional[GraphCaptureError]]]:
    if name in _HOST_DATA_OPS:
        return _check_host_data
    if name == _ASYNC_WRAPPER_OP:
        return _check_async_wrapper
    if name in _HOST_SYNC_OPS or _TAG_SYNC in tags:
        return lambda n, a, k: _sync_error(n + _SYNC_SOURCES.get(n, ""))
    if name in _INDEX_OPS:
        return _check_index
    if name == "aten.repeat_interleave.Tensor":
        return _check_repeat
    if name in _DYNAMIC_SHAPE_OPS or _TAG_SHAPE in tags:
        return lambda n, a, k: _shape_error(n)
    return None


@functools.lru_cache(maxsize=None)
def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    name, tags, schema = str(func), set(func.tags), func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if name in _ALLOC_OPS:
        kind = "alloc"
    elif name in _WAIT_OPS:
        kind = "view"  # returns its argument; replay waited when it re-issued the collective
    elif func.namespace in _COLLECTIVE_NAMESPACES:
        kind = "collective"
    elif name in _HOST_DATA_OPS:
        kind = "scalar"  # only 0-dim host data gets past the check
    elif torch.Tag.inplace_view in tags:
        kind = "view"  # squeeze_, t_, as_strided_ ...: metadata only, no kernel
    elif writes:
        kind = "mutate"
    elif func.is_view or any(r.alias_info is not None for r in schema.returns):
        kind = "view"
    else:
        kind = "compute"
    out_kwargs = frozenset(a.name for a in schema.arguments if getattr(a, "is_out", False))
    return _OpInfo(kind, _op_check(name, tags), out_kwargs)


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


def _meta(t: torch.Tensor) -> tuple:
    return (t.size(), t.stride(), t.storage_offset())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _unrecordable(args: Any) -> Optional[str]:
    """Why the tape cannot record an op on these tensors (arguments and results), or None."""
    for t in _tensors(args):
        if t.is_nested:
            return "it touches a nested tensor"
        if t.layout is not torch.strided:
            return f"it touches a {str(t.layout).removeprefix('torch.')} tensor"
        if _python_dispatch.is_traceable_wrapper_subclass(t):
            return f"it touches a tensor subclass ({type(t).__name__})"
    return None


@dataclass
class _Record:
    func: torch._ops.OpOverload
    info: _OpInfo
    args: tuple
    kwargs: dict
    out: Any
    metas: list  # (tensor, metadata right after the op) for every tensor it touched
    value: Optional[torch.Tensor] = None  # a host scalar's value at capture


class _Capture:
    """The ops of one open capture, and the first error it met."""

    def __init__(self) -> None:
        self.records: list[_Record] = []
        self.error: Optional[GraphCaptureError] = None

    def fail(self, error: GraphCaptureError) -> GraphCaptureError:
        # Like CUDA stream capture, the first error poisons the whole capture even
        # if the callable catches it.
        self.error = self.error or error
        return error

    def record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        info, name = _op_info(func), str(func)
        error = info.check(name, args, kwargs) if info.check is not None else None
        if error is not None:
            raise self.fail(error)
        out = func(*args, **kwargs)
        why = _unrecordable((args, kwargs, out))
        if why is None:
            try:
                metas = [(t, _meta(t)) for t in _tensors((args, kwargs, out))]
            except Exception as e:  # a tensor the checks above let through
                why = f"{type(e).__name__}: {e}"
        if why is not None:
            raise self.fail(_unsupported_error(name, why))
        value = out.clone() if info.kind == "scalar" else None
        self.records.append(_Record(func, info, args, kwargs, out, metas, value))
        return out


class _ThreadRecorder(TorchDispatchMode):
    """One per thread with captures open: records each op into the innermost one
    (the one begun last), as a GPU records into the capture of the current stream."""

    def __init__(self) -> None:
        super().__init__()
        self.captures: list[_Capture] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.captures[-1].record(func, args, kwargs or {})


_thread = threading.local()  # .recorder: this thread's _ThreadRecorder while it captures


def _current_capture() -> Optional[_Capture]:
    recorder = getattr(_thread, "recorder", None)
    return recorder.captures[-1] if recorder is not None and recorder.captures else None


# -- host reads that do not dispatch: patched on torch.Tensor while any capture is open -------


def _check_to(args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    # Only a device spelled as a string is taken for the host: x.to(x.device) is a
    # no-op on a GPU, and on the tape every device is the CPU.
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str) and torch.device(target).type == "cpu":
        return _device_to_host_error(f"Tensor.to({target!r})")
    return None


_ON_A_GPU = "(a device-to-host copy, aten._to_copy to cpu on a GPU)"
_HOST_READS: dict[str, Callable[[tuple, dict], Optional[GraphCaptureError]]] = {
    "tolist": lambda a, k: _sync_error(f"Tensor.tolist() {_ON_A_GPU}"),
    "numpy": lambda a, k: _sync_error(f"Tensor.numpy() {_ON_A_GPU}"),
    "cpu": lambda a, k: _device_to_host_error("Tensor.cpu()"),
    "to": _check_to,
}


def _guarded(original: Callable, check: Callable[[tuple, dict], Optional[GraphCaptureError]]) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        capture = _current_capture()
        error = check(args, kwargs) if capture is not None else None
        if error is not None:
            raise capture.fail(error)
        return original(self, *args, **kwargs)

    return method


# torch keeps "is a dispatch mode on?" in module globals that each mode saves and
# restores on enter/exit; threads interleaving captures would leave them set for
# good (and Dynamo would then stop compiling), so the guard restores them too.
_DISPATCH_FLAGS = ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
                   "_is_in_any_mode_without_ignore_compile_internals")


class _HostReadGuard:
    """Reference counted: the first capture to open patches, the last to close restores."""

    lock = threading.Lock()
    users = 0
    saved_methods: dict[str, Any] = {}  # torch.Tensor.__dict__ entries; None: inherited
    saved_flags: dict[str, Any] = {}

    @classmethod
    def acquire(cls) -> None:
        with cls.lock:
            if cls.users == 0:
                cls.saved_flags = {n: getattr(_python_dispatch, n) for n in _DISPATCH_FLAGS
                                   if hasattr(_python_dispatch, n)}
                for name, check in _HOST_READS.items():
                    cls.saved_methods[name] = torch.Tensor.__dict__.get(name)
                    setattr(torch.Tensor, name, _guarded(getattr(torch.Tensor, name), check))
            cls.users += 1

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                cls._restore()

    @classmethod
    def _restore(cls) -> None:
        for name, old in cls.saved_methods.items():
            if old is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)
        for name, value in cls.saved_flags.items():
            setattr(_python_dispatch, name, value)
        setter = getattr(_python_dispatch, "set_is_in_mode_without_ignore_compile_internals", None)
        if setter is not None and _DISPATCH_FLAGS[2] in cls.saved_flags:
            setter(cls.saved_flags[_DISPATCH_FLAGS[2]])


def _open(capture: _Capture) -> None:
    recorder = getattr(_thread, "recorder", None)
    if recorder is None:
        _HostReadGuard.acquire()
        try:
            recorder = _ThreadRecorder()
            recorder.__enter__()
        except BaseException:
            _HostReadGuard.release()
            raise
        _thread.recorder = recorder
    recorder.captures.append(capture)


def _close(capture: _Capture) -> None:
    recorder = getattr(_thread, "recorder", None)
    if recorder is None or capture not in recorder.captures:
        raise GraphCaptureError("a tape capture must end (or abort) in the thread that began it")
    recorder.captures.remove(capture)
    if not recorder.captures:
        _thread.recorder = None
        try:
            recorder.__exit__(None, None, None)
        finally:
            _HostReadGuard.release()


# -- replay ------------------------------------------------------------------------------------


def _naming_op(rec: _Record, build: Callable[[_Record], Any]) -> Any:
    """``build(rec)``, any failure turned into a GraphCaptureError naming the op."""
    try:
        return build(rec)
    except GraphCaptureError:
        raise
    except Exception as e:
        raise _unsupported_error(str(rec.func), f"{type(e).__name__}: {e}") from e


def _copy_into(dst: torch.Tensor, call: Callable[[], torch.Tensor]) -> None:
    dst.copy_(call())


def _copy_many(pairs: list[tuple[int, torch.Tensor]], call: Callable[[], Any]) -> None:
    result = call()
    for i, dst in pairs:
        dst.copy_(result[i])


def _run_collective(call: Callable[[], Any], fresh: list[tuple[int, torch.Tensor]]) -> None:
    """Issue a recorded collective, wait for it, and put fresh results where capture had them."""
    result = call()
    results = result if isinstance(result, (tuple, list)) else (result,)
    for x in results:
        if isinstance(x, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(x)  # no-op unless work is pending on x
        elif hasattr(x, "wait"):  # c10d's ops return their Work
            x.wait()
    for i, dst in fresh:
        dst.copy_(results[i])


class TapeGraph:
    """A captured op tape; :meth:`replay` re-runs it on the capture's tensors."""

    def __init__(self, records: list[_Record], output: Any) -> None:
        self.output = output
        self.ops: list[str] = [str(r.func) for r in records]
        self._records = [_naming_op(r, self._pin_metadata) for r in records]
        #: Storages the graph allocates or writes: its own, never a stale input.
        self.produced: set[int] = self._produced_storages()
        steps = (_naming_op(r, self._step) for r in self._records)
        self._steps = [s for s in steps if s is not None]

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
            if _meta(t) != meta and id(t) not in new:
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
            elif rec.info.kind == "scalar":  # a host scalar is the graph's own too
                produced.update(_storage(t) for t in _tensors((rec.args, rec.out)))
            elif rec.info.kind in ("compute", "collective"):
                produced.update(_storage(t) for _, t in self._fresh_outputs(rec))
        return produced

    def _step(self, rec: _Record) -> Optional[Callable[[], Any]]:
        kind = rec.info.kind
        if kind in ("alloc", "view"):
            return None  # no kernel; views alias storage that replay updates
        if kind == "scalar":
            return functools.partial(rec.out.copy_, rec.value)
        call = functools.partial(rec.func, *rec.args, **rec.kwargs)
        if kind == "collective":
            return functools.partial(_run_collective, call, self._fresh_outputs(rec))
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
            if rec.info.kind in ("alloc", "scalar"):
                continue  # empty_like(t) reads no data; host scalars are the graph's own
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
    """A tape capture in progress: its thread records into it and cannot read the host.

    Captures may overlap, in one thread or several, and end in any order; ``end`` and
    ``abort`` belong to the thread that began the capture.
    """

    def __init__(self) -> None:
        self._capture: Optional[_Capture] = _Capture()
        _open(self._capture)

    def end(self, output: Any) -> TapeGraph:
        capture = self._finish()
        if capture.error is not None:
            raise capture.error
        return TapeGraph(capture.records, output)

    def abort(self) -> None:
        if self._capture is not None:
            self._finish()

    def _finish(self) -> _Capture:
        capture = self._capture
        if capture is None:
            raise GraphCaptureError("this tape capture has already ended")
        _close(capture)
        self._capture = None
        return capture
