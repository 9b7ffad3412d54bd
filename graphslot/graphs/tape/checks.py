"""What a tape capture refuses, and the errors it raises: host syncs, data-dependent
shapes, host data copied in, device values copied out, ops the tape cannot record.

Two kinds of check: per ATen op (:func:`op_check`, run by the recorder before the op),
and per ``torch.Tensor`` method for host reads that never reach the dispatcher on a CPU
tensor (:data:`HOST_READS`, patched onto ``torch.Tensor`` while a capture is open).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..backend import GraphCaptureError

#: ``check(op name, args, kwargs)``: the error an op raises at capture, or None.
OpCheck = Callable[[str, tuple, dict], Optional[GraphCaptureError]]
#: ``check(args, kwargs)`` of a patched ``torch.Tensor`` method.
MethodCheck = Callable[[tuple, dict], Optional[GraphCaptureError]]

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
#: Python data turned into a tensor: torch.tensor, as_tensor, from_numpy, new_tensor, x[[0, 1]].
HOST_DATA_OPS = frozenset({"aten.lift_fresh.default", "aten.lift_fresh_copy.default"})
_SYNC_SOURCES = {
    "aten._local_scalar_dense.default": " (from .item(), bool(t), int(t), float(t) or `if t:`)",
}
_HOST_DATA_SOURCE = " (torch.tensor, torch.as_tensor, torch.from_numpy, Tensor.new_tensor or a list index)"
#: funcol's wrapper of a collective's result in an AsyncCollectiveTensor.
ASYNC_WRAPPER_OP = "_c10d_functional._wrap_tensor_autograd.default"
_TAG_SYNC = getattr(torch.Tag, "data_dependent_output", None)
_TAG_SHAPE = getattr(torch.Tag, "dynamic_output_shape", None)


#: Why the tape refuses a higher-order operator (it records ATen ops only).
HOP_WHY = ("it is a higher-order operator, which the tape does not record (auto_functionalized: a compiled "
           "piecewise piece that calls a custom op mutating its inputs; make that op a split op, or compile the "
           "pieces with compile_backend='eager')")


def sync_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"host sync during graph capture: {what}; {_SYNC_HINT}")


def shape_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"data-dependent output shape during graph capture: {what}; {_SHAPE_HINT}")


def host_to_device_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"host-to-device copy during graph capture: {what}; {_H2D_HINT}")


def device_to_host_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(f"device-to-host copy during graph capture: {what}; {_D2H_HINT}")


def unsupported_error(op: str, why: str) -> GraphCaptureError:
    return GraphCaptureError(f"the cpu graph backend cannot record {op}: {why}; {_UNSUPPORTED_HINT}")


# -- per ATen op ---------------------------------------------------------------------------------


def _check_index(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return shape_error(f"{name} with a boolean mask (x[mask] / x[mask] = v)")
    return None


def _check_host_data(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    # A 0-dim host tensor is a scalar operand, which CUDA reads at capture; x[i] = 0.0
    # makes one too.
    return host_to_device_error(name + _HOST_DATA_SOURCE) if args[0].dim() > 0 else None


def _check_repeat(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    return shape_error(f"{name} without output_size") if kwargs.get("output_size") is None else None


def _check_async_wrapper(name: str, args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    torch.ops._c10d_functional.wait_tensor(args[0])  # the collective ran: leave no work pending
    return unsupported_error(name, "torch.distributed._functional_collectives wraps results in "
                             "AsyncCollectiveTensor, a tensor subclass, outside torch.compile; call "
                             "torch.ops._c10d_functional.<collective> and wait_tensor directly")


def op_check(name: str, tags: set) -> Optional[OpCheck]:
    """The check the recorder runs before the op ``name`` (with ``tags``), or None."""
    if name in HOST_DATA_OPS:
        return _check_host_data
    if name == ASYNC_WRAPPER_OP:
        return _check_async_wrapper
    if name in _HOST_SYNC_OPS or _TAG_SYNC in tags:
        return lambda n, a, k: sync_error(n + _SYNC_SOURCES.get(n, ""))
    if name in _INDEX_OPS:
        return _check_index
    if name == "aten.repeat_interleave.Tensor":
        return _check_repeat
    if name in _DYNAMIC_SHAPE_OPS or _TAG_SHAPE in tags:
        return lambda n, a, k: shape_error(n)
    return None


# -- host reads that do not dispatch -------------------------------------------------------------


def _check_to(args: tuple, kwargs: dict) -> Optional[GraphCaptureError]:
    # Only a device spelled as a string is taken for the host: x.to(x.device) is a
    # no-op on a GPU, and on the tape every device is the CPU.
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str) and torch.device(target).type == "cpu":
        return device_to_host_error(f"Tensor.to({target!r})")
    return None


_ON_A_GPU = "(a device-to-host copy, aten._to_copy to cpu on a GPU)"
#: ``torch.Tensor`` methods that read a device value on the host without dispatching.
HOST_READS: dict[str, MethodCheck] = {
    "tolist": lambda a, k: sync_error(f"Tensor.tolist() {_ON_A_GPU}"),
    "numpy": lambda a, k: sync_error(f"Tensor.numpy() {_ON_A_GPU}"),
    "cpu": lambda a, k: device_to_host_error("Tensor.cpu()"),
    "to": _check_to,
}
