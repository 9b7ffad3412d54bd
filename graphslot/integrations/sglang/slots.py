"""sglang 0.5.23's slot vocabulary: ``PaddingPolicy``, ``FillContext``, ``GraphSlot``.

Same names, fields (in the same order), defaults and methods as sglang's
(``sglang/srt/model_executor/cuda_graph_buffer_registry.py``), written for graphslot:
a ``GraphSlot`` is turned into a spec entry when it is registered
(:mod:`.entries`), and ``slice_for`` / ``reset_padding`` are what runners call by
hand outside ``fill_from``. :class:`SliceDim` is an extension: a ``slice_fn`` that
says which dimension it slices (the factories use it for ``mrope_positions``), so no
probing is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Optional, Tuple

import torch

AXES = ("bs", "tokens", "none")


class PaddingPolicy(Enum):
    """What happens to a slot's padded tail ``[raw:padded]``; the values are
    graphslot's ``padding:`` names (``graphslot/slot_specs/README.md``)."""

    KEEP_PAD = "keep_pad"
    FILL_SENTINEL = "fill_sentinel"
    ZERO = "zero"
    FOREACH_COPY = "foreach_copy"
    FILL_ONCE = "fill_once"


#: Policies whose tail is written at every padded fill.
RESETTING = ("zero", "fill_sentinel")


def policy_name(policy: Any) -> str:
    """A policy's graphslot name: this module's or sglang's ``PaddingPolicy`` (by
    ``.value``), or the name itself; ValueError otherwise."""
    value = getattr(policy, "value", policy)
    if value not in PaddingPolicy._value2member_map_:
        raise ValueError(f"padding_policy {policy!r} is not one of "
                         f"{', '.join(p.name for p in PaddingPolicy)}")
    return value


@dataclass
class FillContext:
    """What ``post_fill(buffer, fb, ctx)`` and ``source_fn(fb, ctx)`` receive: one per
    ``fill_from`` call, shared by every hook of that call. ``params`` (an extension)
    holds the registry's params, live ones evaluated on first read."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    pp_proxy_tensors: Optional[Any] = None
    params: Any = field(default=None, repr=False, compare=False)

    @property
    def side_inputs(self) -> Any:
        """graphslot's name for ``pp_proxy_tensors``."""
        return self.pp_proxy_tensors

    @classmethod
    def make(cls, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, params, side_inputs=None) -> "FillContext":
        """The context factory handed to ``graphslot.build_registry(context=...)``."""
        return cls(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs, params)


class SliceDim:
    """``slice_fn`` slicing one dimension: ``SliceDim(1)(buf, n)`` is ``buf[:, :n]``."""

    __slots__ = ("dim",)

    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        return buffer.narrow(self.dim, 0, n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SliceDim) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash((SliceDim, self.dim))

    def __repr__(self) -> str:
        return f"SliceDim({self.dim})"


@dataclass
class GraphSlot:
    """One batch field mirrored into a static buffer (sglang's ``GraphSlot``).

    ``shape_fn(max_bs, max_num_tokens) -> shape`` is called once, at registration;
    ``device=None`` is the registry's device; ``post_fill(buffer, fb, ctx)`` runs after
    the copies; ``slice_fn(buffer, n)`` replaces ``buffer[:n]``; ``source_fn(fb, ctx)``
    replaces ``fb.<name>`` as the copy source (``None``: no copy this step). The
    registry sets ``buffer``. Fields are read when the slot is registered: changing
    one afterwards does not change what ``fill_from`` does.
    """

    name: str
    shape_fn: Callable[[int, int], Tuple[int, ...]]
    dtype: torch.dtype
    axis: str = "tokens"
    device: Optional[torch.device] = None
    padding_policy: PaddingPolicy = PaddingPolicy.FOREACH_COPY
    pad_value: Optional[Any] = None
    enabled: bool = True
    copy_from_fb: bool = True
    post_fill: Optional[Callable[[torch.Tensor, Any, FillContext], None]] = None
    slice_fn: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None
    source_fn: Optional[Callable[[Any, FillContext], Optional[torch.Tensor]]] = None
    buffer: Optional[torch.Tensor] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.axis not in AXES:
            raise ValueError(f"GraphSlot {self.name!r}: axis must be one of 'bs', 'tokens', 'none', "
                             f"got {self.axis!r}")

    def _count(self, bs: int, num_tokens: int) -> int:
        if self.axis == "bs":
            return bs
        if self.axis == "tokens":
            return num_tokens
        shape = self.buffer.shape if self.buffer is not None else (0,)
        return shape[0] if len(shape) else 1  # a 0-d buffer counts as one row

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The buffer's ``[:padded]`` view (axis ``none``: the buffer itself)."""
        if self.buffer is None:
            raise RuntimeError(f"GraphSlot {self.name!r}: buffer not allocated (the slot is disabled or not "
                               "registered)")
        n = self._count(padded_bs, padded_num_tokens)
        if self.slice_fn is not None:
            return self.slice_fn(self.buffer, n)
        if self.axis == "none":
            return self.buffer
        return self.buffer[:n]

    def reset_padding(self, raw_n: int, padded_n: int) -> None:
        """Make the tail ``[raw_n:padded_n]`` safe by the policy: zero, or the
        sentinel; the other policies leave it alone."""
        if self.buffer is None or raw_n >= padded_n:
            return
        policy = policy_name(self.padding_policy)
        if policy not in RESETTING:
            return
        if isinstance(self.slice_fn, SliceDim):
            tail = self.buffer.narrow(self.slice_fn.dim, raw_n, padded_n - raw_n)
        elif self.slice_fn is not None:  # sglang's rule: the last dimension of the padded view
            head = self.slice_fn(self.buffer, padded_n)
            tail = head[..., raw_n:padded_n] if head.dim() > 1 else head[raw_n:padded_n]
        else:
            tail = self.buffer[raw_n:padded_n]
        if policy == "zero":
            tail.zero_()
        elif self.pad_value is None:
            raise RuntimeError(f"GraphSlot {self.name!r}: FILL_SENTINEL requires pad_value")
        else:
            tail.fill_(self.pad_value)


def same_tensor_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements of the same memory."""
    return (a.data_ptr() == b.data_ptr() and a.device == b.device and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())
