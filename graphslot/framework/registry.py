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
from .stepcheck import StepChecker


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


class ViewMaker:
    """Makes ``extract``'s view: a shallow copy of the batch with some fields replaced.

    The template batch is never modified, and the batch type needs no cooperation:
    plain objects and dataclasses, frozen ones included, get the fields written into the
    copy's ``__dict__`` (no ``__setattr__`` runs); other types (``__slots__``, custom
    copying, a property among ``names``) go through ``copy.copy`` and
    ``object.__setattr__``. The choice is made once per batch type.
    """

    __slots__ = ("names", "spec_name", "_plain")

    def __init__(self, names: Tuple[str, ...], spec_name: str = "?"):
        self.names, self.spec_name, self._plain = names, spec_name, {}

    def _is_plain(self, cls: type) -> bool:
        plain = self._plain.get(cls)
        if plain is None:
            plain = self._plain[cls] = (
                not hasattr(cls, "__slots__") and cls.__reduce_ex__ is object.__reduce_ex__
                and not hasattr(cls, "__copy__")
                and not any(hasattr(getattr(cls, name, None), "__set__") for name in self.names))
        return plain

    def __call__(self, batch: Any, fields: Dict[str, Any]) -> Any:
        cls = batch.__class__
        if self._is_plain(cls):
            new = cls.__new__(cls)
            state = new.__dict__
            state.update(batch.__dict__)
            state.update(fields)
            return new
        new = copy.copy(batch)
        for name, value in fields.items():
            try:
                object.__setattr__(new, name, value)
            except (AttributeError, TypeError) as exc:
                raise SlotError(f"spec {self.spec_name!r}: extract cannot set '{name}' on a copy of "
                                f"{cls.__name__} ({exc}); a batch type with __slots__ must declare every "
                                f"field a view sets: {', '.join(self.names)}") from None
        return new


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
        self.checker = StepChecker(spec.name, self.active, max_bs, max_num_tokens, strict)
        self.make_view = ViewMaker(self.view_names(), spec.name)

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

    def view_names(self) -> Tuple[str, ...]:
        """What ``extract`` may set on the view: ``batch_size`` and every enabled
        top-level slot (dotted slots are never set)."""
        return ("batch_size",) + tuple(s.name for s in self.active if not s.spec.structured)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.spec.name} mode={self.mode} max_bs={self.max_bs} "
                f"max_num_tokens={self.max_num_tokens} slots={self.slot_names()}>")


class InterpretedRegistry(SlotRegistry):
    """The reference semantics, slot by slot (``graphslot/slot_specs/README.md``,
    "Slot semantics")."""

    mode = "interpreted"

    def fill_from(self, fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> None:
        # Sources are copied as data: a source that requires grad is copied by value, and
        # no buffer ever requires grad or records history.
        with torch.no_grad():
            self._fill(fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)

    def _fill(self, fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs) -> None:
        check = self.checker
        raw_bs, padded_bs, raw_num_tokens, padded_num_tokens = check.step(raw_bs, padded_bs, raw_num_tokens,
                                                                          padded_num_tokens)
        ctx = self.fill_context(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)

        # 0. every source (batch fields, source hooks) is read and checked before
        #    anything is written
        copies, hook_copies = [], []
        for slot in check.plain:
            src = check.plain_source(slot, fb, raw_bs, raw_num_tokens)
            if src is not None:
                head = slot.head(slot.count(raw_bs, raw_num_tokens))
                copies += zip(head.unbind(0), src.unbind(0)) if slot.spec.rows else [(head, src)]
        for slot in self.active:
            hook = slot.hooks.get("source") if slot.spec.copy_from_fb else None
            src = None if hook is None else check.hook_source(slot.name, hook(fb, ctx))
            if src is not None:
                hook_copies.append((slot.buffer.narrow(slot.spec.slice_dim, 0, src.shape[slot.spec.slice_dim]), src))

        # 1. copy heads; device copies grouped by dtype pair, one kernel each
        groups: Dict[tuple, Tuple[list, list]] = {}
        for dst, src in copies:
            dsts, srcs = groups.setdefault((dst.device, dst.dtype, src.dtype), ([], []))
            dsts.append(dst)
            srcs.append(src)
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)

        # 2. make the padded tail safe
        for slot in self.active:
            spec = slot.spec
            raw, padded = slot.count(raw_bs, raw_num_tokens), slot.count(padded_bs, padded_num_tokens)
            if spec.resets_tail and raw < padded:
                tail = slot.buffer.narrow(spec.slice_dim, raw, padded - raw)
                if spec.padding == "zero":
                    tail.zero_()
                else:
                    tail.fill_(spec.pad_value)

        # 3. source hooks' results go to [:len(src)], after the resets
        for dst, src in hook_copies:
            dst.copy_(src)

        # 4. computed slots
        for slot in self.active:
            hook = slot.hooks.get("post_fill")
            if hook is not None:
                hook(slot.buffer, fb, ctx)

    def extract(self, fb, padded_bs, padded_num_tokens):
        padded_bs, padded_num_tokens = self.checker.view(padded_bs, padded_num_tokens)
        fields = {"batch_size": padded_bs}
        for slot in self.active:
            spec = slot.spec
            if spec.structured:
                continue
            if spec.plain_copy and getattr(fb, spec.name, None) is None:
                continue  # absent this step: carry the None, never a stale buffer
            fields[spec.name] = slot.slice_for(padded_bs, padded_num_tokens)
        return self.make_view(fb, fields)
