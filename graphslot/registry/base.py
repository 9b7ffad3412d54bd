"""Slot registries: one full-capacity buffer per enabled slot, and the questions a runner asks about them;
``fill_from`` / ``extract`` come from the interpreter (:mod:`.interpreter`) or generated code."""

from __future__ import annotations

import copy
from typing import AbstractSet, Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from ..spec.errors import SlotError, did_you_mean
from ..spec.hooks import CaptureContext, FillContext
from ..spec.live import context_factory, live_view
from ..spec.model import RegistrySpec
from ..spec.resolve import ResolvedSlot
from .buffers import SharePool, owned_buffers, refuse_shared_memory, slot_buffers
from .stepcheck import StepChecker


class Slot:
    """One slot of a registry: its resolved declaration and, when enabled, its buffer (the one the graph reads); a
    staged slot also has ``host``, the host buffer a fill writes (``buffer`` itself when one tensor is both)."""

    __slots__ = ("resolved", "buffer", "hooks", "name", "enabled", "host")

    def __init__(
        self,
        resolved: ResolvedSlot,
        buffer: Optional[torch.Tensor],
        hooks: Dict[str, Callable],
        host: Optional[torch.Tensor] = None,
    ):
        self.resolved = resolved
        self.buffer = buffer
        self.hooks = hooks
        self.host = host
        self.name = resolved.name
        self.enabled = resolved.enabled

    @property
    def filled(self) -> Optional[torch.Tensor]:
        """The buffer a fill writes: a staged slot's host buffer, else the buffer."""
        return self.buffer if self.host is None else self.host

    @property
    def binding(self) -> Any:
        """What generated code binds: the buffer, or a staged slot's ``(host, device)`` pair."""
        return self.buffer if self.host is None else (self.host, self.buffer)

    def buffers(self) -> Tuple[torch.Tensor, ...]:
        """Its distinct buffers (a staged slot's two, unless one tensor is both)."""
        return (self.buffer,) if self.host is None or self.host is self.buffer else (self.host, self.buffer)

    def count(self, bs: int, num_tokens: int) -> Optional[int]:
        """How many rows of the sliced dimension a step uses, ``extra_rows`` included (None: the whole buffer)."""
        n = self.resolved.axis.select(bs, num_tokens)
        return n if n is None else n + self.resolved.extra_rows

    def head(self, n: Optional[int]) -> torch.Tensor:
        """The first ``n`` rows of the buffer a fill writes."""
        return self.filled if n is None else self.filled.narrow(self.resolved.slice_dim, 0, n)

    def tail_end(self, padded_bs: int, padded_num_tokens: int) -> int:
        """Where the tail a policy writes ends: the padded count, or the buffer's end under ``reset_to: capacity``."""
        if self.resolved.to_capacity:
            return self.buffer.shape[self.resolved.slice_dim]
        return self.count(padded_bs, padded_num_tokens)

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The view a step exposes: ``[:padded]`` along the slot's sliced dimension, of the buffer the graph reads."""
        if self.buffer is None:
            raise SlotError(f"slot '{self.name}' is disabled with these params and has no buffer")
        n = self.count(padded_bs, padded_num_tokens)
        return self.buffer if n is None else self.buffer.narrow(self.resolved.slice_dim, 0, n)

    def __repr__(self) -> str:
        s = self.resolved
        state = f"shape={list(s.shape)} dtype={s.dtype}" if s.enabled else "disabled"
        return f"<Slot {s.name} axis={s.axis} padding={s.padding} {state}>"


class ViewMaker:
    """Makes ``extract``'s view: a shallow copy of the batch with some fields replaced. Plain objects and
    dataclasses (frozen ones too) get them written into the copy's ``__dict__``; other types (``__slots__``,
    custom copying, a property among ``names``) go through ``copy.copy`` and ``object.__setattr__``."""

    __slots__ = ("names", "spec_name", "_plain")

    def __init__(self, names: Tuple[str, ...], spec_name: str = "?"):
        self.names = names
        self.spec_name = spec_name
        self._plain = {}

    def __call__(self, batch: Any, fields: Dict[str, Any]) -> Any:
        cls = batch.__class__
        plain = self._plain.get(cls)
        if plain is None:
            copying = hasattr(cls, "__copy__") or cls.__reduce_ex__ is not object.__reduce_ex__
            setters = any(hasattr(getattr(cls, n, None), "__set__") for n in self.names)
            plain = self._plain[cls] = not (hasattr(cls, "__slots__") or copying or setters)
        if plain:
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
                where = f"spec {self.spec_name!r}: extract cannot set '{name}' on a copy of {cls.__name__} ({exc})"
                fix = f"a batch type with __slots__ must declare every field a view sets: {', '.join(self.names)}"
                raise SlotError(f"{where}; {fix}") from None
        return new


class SlotRegistry:
    """Buffers for one spec at fixed capacities; ``fill_from``/``extract`` per step."""

    impl = "abstract"

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
        pool: Optional[SharePool] = None,
        adopt: Any = None,
        strict: bool = False,
        context: Optional[Callable[..., Any]] = None,
    ):
        self.spec = spec
        self.params = dict(params)
        self.strict = strict
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        # Makes each fill's hook context (FillContext, or ``context``) with live params resolved.
        self.make_context = context_factory(context or FillContext, self.params)
        self._skipping: Dict[frozenset, Callable[..., None]] = {}
        given = buffers or {}
        self._slots: Dict[str, Slot] = {}
        for resolved in slots:
            host, buffer = slot_buffers(resolved, given.get(resolved.name), self.device, pool, adopt)
            self._slots[resolved.name] = Slot(resolved, buffer, hooks.get(resolved.name, {}), host)
        self.active: Tuple[Slot, ...] = tuple(s for s in self._slots.values() if s.enabled)
        refuse_shared_memory(spec.name, owned_buffers(self.active), pool, adopt)
        self.checker = StepChecker(spec.name, self.active, max_bs, max_num_tokens, strict)
        self.make_view = ViewMaker(self.view_names(), spec.name)

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
        return sum(b.numel() * b.element_size() for s in self.active for b in s.buffers())

    def host_buffer(self, name: str) -> torch.Tensor:
        """The host buffer of slot ``name``: a staged slot's (the one the fill writes and the engine's host code
        reads), or a ``device: cpu`` slot's buffer."""
        slot = self.slot(name)
        if slot.enabled and (slot.host is not None or slot.resolved.host):
            return slot.filled
        why = "is disabled with these params" if not slot.enabled else "is neither staged nor device: cpu"
        raise SlotError(f"spec '{self.spec.name}', slot '{name}' has no host buffer: it {why}")

    def fill_from_skipping(self, names: AbstractSet[str]) -> Callable[..., None]:
        """A fill like ``fill_from`` that leaves the enabled slots among ``names`` alone (the engine staged them;
        others are ignored, as sglang does): no reset, copy or hook. Made once per set (``_fill_skipping``)."""
        skip = frozenset(names) & frozenset(self.slot_names())
        if not skip:
            return self.fill_from
        fill = self._skipping.get(skip)
        if fill is None:
            fill = self._skipping[skip] = self._fill_skipping(skip)
        return fill

    def check_step(self, fb: Any, *, raw_bs: int, raw_num_tokens: int) -> None:
        """Raise the :class:`SlotError` a fill at these raw counts would raise for them or a batch field, for
        any padded counts; write nothing (the DP runner asks before its exchange). Hooks are not run."""
        self.checker.sources(fb, raw_bs, raw_num_tokens)

    def run_pre_capture(self, bs: int, num_tokens: int, side_inputs: Any = None) -> None:
        """Run every ``pre_capture`` hook before a graph of this size is captured."""
        params = live_view(self.params)  # a live param read here: its provider gets this context
        ctx = CaptureContext(bs, num_tokens, params, side_inputs)
        if params is not self.params:
            params.ctx = ctx
        for slot in self.active:
            hook = slot.hooks.get("pre_capture")
            if hook is not None:
                hook(slot.buffer, ctx)

    def view_names(self) -> Tuple[str, ...]:
        """What ``extract`` may set: ``batch_size`` and every enabled top-level (undotted) slot."""
        return ("batch_size",) + tuple(s.name for s in self.active if not s.resolved.structured)

    def __repr__(self) -> str:
        sizes = f"max_bs={self.max_bs} max_num_tokens={self.max_num_tokens}"
        return f"<{type(self).__name__} {self.spec.name} impl={self.impl} {sizes} slots={self.slot_names()}>"
