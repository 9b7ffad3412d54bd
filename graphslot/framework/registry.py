"""Slot registries, and the interpreter: the executable definition of the semantics.

``SlotRegistry`` holds the buffers and answers questions about them; its ``fill_from`` /
``extract`` are supplied either by the interpreter below (``mode="interpreted"``) or by
generated code. The interpreter is written for clarity, not speed: it is what generated
code is proven equal to.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .buffers import allocate_slot_buffer
from .errors import SlotError, did_you_mean
from .hooks import CaptureContext, FillContext
from .model import RegistrySpec
from .pool import BufferPool
from .resolve import ResolvedSlot
from .strict import check_fill


class Slot:
    """One slot of a registry: its resolved spec and (when enabled) its buffer."""

    __slots__ = ("spec", "buffer", "hooks")

    def __init__(self, spec: ResolvedSlot, buffer: Optional[torch.Tensor], hooks: Dict[str, Callable]):
        self.spec, self.buffer, self.hooks = spec, buffer, hooks

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def enabled(self) -> bool:
        return self.spec.enabled

    def count(self, bs: int, num_tokens: int) -> Optional[int]:
        """How many rows of the sliced dimension a step uses (None: the whole buffer)."""
        axis = self.spec.axis
        return bs if axis == "bs" else num_tokens if axis == "tokens" else None

    def head(self, n: Optional[int]) -> torch.Tensor:
        return self.buffer if n is None else self.buffer.narrow(self.spec.slice_dim, 0, n)

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The view a step exposes: ``[:padded]`` along the slot's sliced dimension."""
        if self.buffer is None:
            raise SlotError(f"slot '{self.name}' is disabled with these params and has no buffer")
        return self.head(self.count(padded_bs, padded_num_tokens))

    def __repr__(self) -> str:
        s = self.spec
        state = f"shape={list(s.shape)} dtype={s.dtype}" if s.enabled else "disabled"
        return f"<Slot {s.name} axis={s.axis} padding={s.padding} {state}>"


def shallow_copy(batch: Any) -> Any:
    """``copy.copy`` without its protocol overhead for plain (``__dict__``) objects."""
    cls = batch.__class__
    if hasattr(batch, "__dict__") and cls.__reduce_ex__ is object.__reduce_ex__ and not hasattr(cls, "__slots__"):
        new = cls.__new__(cls)
        new.__dict__.update(batch.__dict__)
        return new
    return copy.copy(batch)


class SlotRegistry:
    """Buffers for one spec at fixed capacities; ``fill_from``/``extract`` per step."""

    mode = "abstract"

    def __init__(
        self,
        spec: RegistrySpec,
        slots: List[ResolvedSlot],
        hooks: Dict[str, Dict[str, Callable]],
        params: Mapping[str, Any],
        *,
        max_bs: int,
        max_num_tokens: int,
        device: torch.device,
        buffers: Optional[Dict[str, torch.Tensor]] = None,
        pool: Optional[BufferPool] = None,
        source: Any = None,
        strict: bool = False,
    ):
        self.spec, self.params = spec, dict(params)
        self.max_bs, self.max_num_tokens, self.device = max_bs, max_num_tokens, torch.device(device)
        self.strict = strict
        self._slots: Dict[str, Slot] = {}
        for resolved in slots:
            buffer = None
            if resolved.enabled:
                buffer = (buffers or {}).get(resolved.name)
                if buffer is None:
                    buffer = allocate_slot_buffer(resolved, self.device, pool, source)
            self._slots[resolved.name] = Slot(resolved, buffer, hooks.get(resolved.name, {}))
        self.active: Tuple[Slot, ...] = tuple(s for s in self._slots.values() if s.enabled)

    # -- introspection -------------------------------------------------------------
    def slot(self, name: str) -> Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no slot '{name}' in spec '{self.spec.name}'" + did_you_mean(name, self._slots)) from None

    def has_slot(self, name: str) -> bool:
        """True for an enabled slot (one with a buffer)."""
        return name in self._slots and self._slots[name].enabled

    def slot_names(self) -> List[str]:
        return [s.name for s in self.active]

    def all_slots(self) -> List[Slot]:
        """Every slot of the spec, disabled ones included."""
        return list(self._slots.values())

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() * s.buffer.element_size() for s in self.active)

    def fill_context(self, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> FillContext:
        return FillContext(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, self.params, side_inputs)

    def run_pre_capture(self, bs: int, num_tokens: int, side_inputs: Any = None) -> None:
        """Run every ``pre_capture`` hook before a graph of this size is captured."""
        ctx = CaptureContext(bs, num_tokens, self.params, side_inputs)
        for slot in self.active:
            hook = slot.hooks.get("pre_capture")
            if hook is not None:
                hook(slot.buffer, ctx)

    def check_fill(self, fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> None:
        """Strict mode's check of a step's sources (raises SlotError)."""
        check_fill(self, fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.spec.name} mode={self.mode} max_bs={self.max_bs} "
                f"max_num_tokens={self.max_num_tokens} slots={self.slot_names()}>")


class InterpretedRegistry(SlotRegistry):
    """The reference semantics, slot by slot (see DESIGN.md, "Slot semantics")."""

    mode = "interpreted"

    def fill_from(self, fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> None:
        if self.strict:
            self.check_fill(fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)
        ctx = self.fill_context(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)

        # 1. make the padded tail safe
        for slot in self.active:
            spec = slot.spec
            raw, padded = slot.count(raw_bs, raw_num_tokens), slot.count(padded_bs, padded_num_tokens)
            if spec.resets_tail and raw < padded:
                tail = slot.buffer.narrow(spec.slice_dim, raw, padded - raw)
                if spec.padding == "zero":
                    tail.zero_()
                else:
                    tail.fill_(spec.pad_value)

        # 2. copy sources into heads; device copies grouped by dtype pair, one kernel each
        groups: Dict[Tuple[torch.dtype, torch.dtype], Tuple[list, list]] = {}
        host_copies = []
        for slot in self.active:
            spec = slot.spec
            if not spec.copy_from_fb:
                continue
            source_hook = slot.hooks.get("source")
            if spec.source is not None:
                src = source_hook(fb, ctx) if source_hook is not None else None
                if not isinstance(src, torch.Tensor):
                    continue
                dst = slot.head(src.shape[spec.slice_dim])
            else:
                src = getattr(fb, spec.name, None)
                if not isinstance(src, torch.Tensor):
                    continue
                dst = slot.head(slot.count(raw_bs, raw_num_tokens))
            if spec.host:
                host_copies.append((dst, src))
            else:
                dsts, srcs = groups.setdefault((dst.dtype, src.dtype), ([], []))
                dsts.append(dst)
                srcs.append(src)
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)
        for dst, src in host_copies:
            dst.copy_(src)

        # 3. computed slots
        for slot in self.active:
            hook = slot.hooks.get("post_fill")
            if hook is not None:
                hook(slot.buffer, fb, ctx)

    def extract(self, fb, padded_bs, padded_num_tokens):
        view = shallow_copy(fb)
        view.batch_size = padded_bs
        for slot in self.active:
            spec = slot.spec
            if spec.structured:
                continue
            if spec.plain_copy and getattr(fb, spec.name, None) is None:
                continue  # absent this step: carry the None, never a stale buffer
            setattr(view, spec.name, slot.slice_for(padded_bs, padded_num_tokens))
        return view
