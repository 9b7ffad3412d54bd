"""``CudaGraphBufferRegistry``: sglang 0.5.23's registry API over a graphslot registry.

Buffers are allocated eagerly, slot by slot, exactly as sglang's ``register_slot``
does (zeros, then sglang's share pool, then the init fill; ``bind=`` adopts a tensor
as it is), because runners and tests touch ``get_slot(name).buffer`` right away. The
code that fills and views them is graphslot's: the registry's slots form one spec
(the factory's shipped spec, plus one entry per slot registered from Python,
:mod:`.entries`), and ``graphslot.api.build(spec, bind=...)`` binds its
generated ``fill_from`` / ``extract`` to those buffers at the first ``fill_from`` or
``extract_buffer`` after a change. A registration only marks the registry for
rebinding; identical slot sets share one compiled module per process. sglang binds a
tensor of any layout; generated code needs dense buffers (it views those of several
dtypes as one integer dtype, and ``build`` refuses a strided one), so a registry holding
a strided ``bind=`` tensor is filled by graphslot's interpreter, which is proven equal to it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ... import env
from ...api import bind_slot_hooks, build
from ...registry.base import SlotRegistry, ViewMaker
from ...registry.buffers import fits, refuse_strided
from ...registry.interpreter import InterpretedRegistry
from ...registry.stepcheck import describe, overlaps
from ...spec.errors import SlotError, shorten
from ...spec.loading import spec_from_dict
from ...spec.model import RegistrySpec
from ...spec.resolve import resolve_params, resolve_slots
from .entries import ABSENT_FIELDS, CODE_LABEL, buffer_shape, check_entry, slot_entry
from .sglang_env import SGLANG_POOL
from .slots import FillContext, policy_name, same_tensor_view

#: The drop-in allocates what sglang would; graphslot's byte cap does not apply.
NO_CAP = 1 << 62
_SPECS: Dict[Tuple, RegistrySpec] = {}
_SPEC_CACHE_LIMIT = 256


def _no_fill(fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> None:
    return None


class CudaGraphBufferRegistry:
    """Static input buffers mirrored from a forward batch (sglang's registry API).

    ``share_pool=True`` shares allocated buffers through sglang's process-wide pool
    (``input_buffers.share_input_buffer``); any :class:`graphslot.SharePool` object may
    be given instead.
    """

    def __init__(self, *, device: torch.device, max_bs: int, max_num_tokens: int, share_pool: Any = False) -> None:
        self.device = device
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.share_pool = share_pool
        self._slots: Dict[str, Any] = {}
        self._buffers: Dict[str, torch.Tensor] = {}
        self._entries: List[Dict[str, Any]] = []
        self._hooks: Dict[str, Callable] = {}
        #: (spec, params, preset) of a factory's shipped spec; its slots come first.
        self._base: Optional[Tuple[RegistrySpec, Dict[str, Any], Optional[str]]] = None
        self._unbind()

    # ---- registration ------------------------------------------------------------
    def register_slot(self, slot: Any, bind: Optional[torch.Tensor] = None) -> Any:
        """Register ``slot`` (this package's ``GraphSlot`` or sglang's) and allocate its
        buffer, or adopt ``bind``; sets and returns ``slot`` with its ``buffer``."""
        if slot.name in self._slots:
            raise ValueError(f"GraphSlot {slot.name!r} already registered")
        if not slot.enabled:
            self._slots[slot.name] = slot
            return slot
        shape = buffer_shape(slot.name, slot.shape_fn(self.max_bs, self.max_num_tokens))
        fresh = self._zeros(slot.name, shape, slot.dtype, slot.device) if bind is None else None
        probe = self._checked_bind(slot.name, bind, shape, slot.dtype, slot.device) if bind is not None else fresh
        entry, hooks = slot_entry(slot, probe, self.max_bs, self.max_num_tokens, torch.device(self.device))
        check_entry(entry)
        init = None
        if bind is None and policy_name(slot.padding_policy) in ("fill_sentinel", "fill_once"):
            init = slot.pad_value
        self._add(slot, self._share(slot.name, fresh, init) if bind is None else bind)
        self._entries.append(entry)
        self._hooks.update(hooks)
        return slot

    def _add(self, slot: Any, buffer: torch.Tensor) -> None:
        slot.buffer = buffer
        self._slots[slot.name] = slot
        self._buffers[slot.name] = buffer
        self._unbind()

    def _zeros(self, name: str, shape: tuple, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """A fresh buffer for slot ``name``; an allocation torch refuses is a RuntimeError naming it."""
        where = self._where(device)
        try:
            return torch.zeros(shape, dtype=dtype, device=where)
        except RuntimeError as exc:  # out of memory, or a size torch cannot represent
            raise RuntimeError(f"GraphSlot {name!r}: cannot allocate its {shape} "
                               f"{str(dtype).removeprefix('torch.')} buffer on {where}: {exc}") from exc

    def _where(self, device: Any) -> torch.device:
        return torch.device(self.device if device is None else device)

    def _share(self, name: str, buffer: torch.Tensor, init: Any) -> torch.Tensor:
        pool = SGLANG_POOL if self.share_pool is True else (self.share_pool or None)
        if pool is not None:
            buffer = self._shared(name, buffer, pool.share(name, buffer, init))
        if init is not None:
            buffer.fill_(init)
        return buffer

    def _shared(self, name: str, buffer: torch.Tensor, shared: Any) -> torch.Tensor:
        """The tensor of the share pool's ``(tensor, fresh)`` for slot ``name``; a ValueError naming
        ``share_pool=`` and the slot unless it has ``buffer``'s shape, dtype and device."""
        tensor = shared[0] if isinstance(shared, tuple) and len(shared) == 2 else None
        pool = "True (sglang's share_input_buffer)" if self.share_pool is True else type(self.share_pool).__name__
        if isinstance(tensor, torch.Tensor) and fits(tensor, buffer.shape, buffer.dtype, buffer.device):
            for first, second, nbytes in overlaps([*self._buffers.items(), (name, tensor)]):
                if name in (first, second):  # fills of the two would overwrite each other
                    raise ValueError(f"GraphSlot {name!r}: share_pool={pool} returned memory slot "
                                     f"{first if second == name else second!r} holds ({nbytes} bytes): a share pool "
                                     "must return a tensor of its own for each slot name of a registry")
            return tensor
        got = describe(tensor if isinstance(tensor, torch.Tensor) else shared)
        raise ValueError(f"GraphSlot {name!r}: share_pool={pool} returned {got}, expected (tensor, fresh) with a "
                         f"{buffer.dtype} tensor of shape {list(buffer.shape)} on {buffer.device}: a share pool "
                         "must return a tensor of the shape, dtype and device it was given")

    def _checked_bind(self, name: str, bind: Any, shape: tuple, dtype: torch.dtype, device: Any) -> torch.Tensor:
        if not isinstance(bind, torch.Tensor):
            raise ValueError(f"bind for slot {name!r} is a {type(bind).__name__}, expected a torch.Tensor")
        if tuple(bind.shape) != shape:
            raise ValueError(f"bind tensor for slot {name!r} has shape {tuple(bind.shape)}, expected {shape}.")
        if bind.dtype != dtype:
            raise ValueError(f"bind tensor for slot {name!r} has dtype {bind.dtype}, expected {dtype}.")
        where = self._where(device)
        if bind.device.type != where.type:
            raise ValueError(f"bind tensor for slot {name!r} is on {bind.device}, expected {where}.")
        return bind

    def has_slot(self, name: str) -> bool:
        slot = self._slots.get(name)
        return slot is not None and bool(slot.enabled)

    def get_slot(self, name: str) -> Any:
        return self._slots[name]

    def slot_names(self) -> List[str]:
        return [name for name, slot in self._slots.items() if slot.enabled]

    # ---- binding (off the per-step path) -----------------------------------------
    def _unbind(self) -> None:
        self._bound: Any = None
        self._fill: Optional[Callable] = None
        self._extract: Optional[Callable] = None
        self._fills: Dict[Any, Callable] = {}

    @property
    def spec(self) -> Optional[RegistrySpec]:
        """The graphslot spec this registry's slots form (None while it has none)."""
        if not self._buffers:
            return None
        return composite_spec(self._base[0] if self._base else None, self._entries)

    @property
    def graphslot(self) -> Any:
        """The graphslot registry bound to these buffers (bound now if needed)."""
        if self._fill is None:
            self._bind()
        return self._bound

    def _bind(self) -> None:
        if not self._buffers:
            make_view = ViewMaker(("batch_size",), "sglang")
            self._fill = _no_fill
            self._extract = lambda fb, *, padded_bs, padded_num_tokens: make_view(fb, {"batch_size": padded_bs})
            return
        base, params, preset = self._base if self._base else (None, {}, None)
        spec = composite_spec(base, self._entries)
        if all(map(dense, self._buffers.values())):
            self._bound = build(spec, device=self.device, max_bs=self.max_bs, max_num_tokens=self.max_num_tokens,
                                params=params, preset=preset, hooks=self._hooks, bind=self._buffers,
                                context=FillContext.make, max_bytes=NO_CAP)
        else:
            self._bound = self._interpreted(spec, params, preset)
        self._fill, self._extract = self._bound.fill_from, self._bound.extract

    def _interpreted(self, spec: RegistrySpec, params: Dict[str, Any], preset: Optional[str]) -> SlotRegistry:
        """graphslot's interpreter over these buffers, strided ones included (``build`` refuses
        those for generated code's sake); the buffers were checked at ``register_slot``."""
        resolved = resolve_params(spec, params, preset)
        slots = resolve_slots(spec, resolved, self.max_bs, self.max_num_tokens)
        hooks = bind_slot_hooks(spec, slots, resolved, self._hooks)
        return InterpretedRegistry(spec, slots, hooks, resolved, max_bs=self.max_bs, max_num_tokens=self.max_num_tokens,
                                   device=torch.device(self.device), buffers=self._buffers,
                                   strict=env.STRICT.enabled(), context=FillContext.make)

    def _fill_skipping(self, skip_slots: Any) -> Callable:
        if self._fill is None:
            self._bind()
        if not skip_slots:
            return self._fill
        key = skip_set(skip_slots)
        fill = self._fills.get(key)
        if fill is None:
            fill = self._fills[key] = (self._bound.fill_from_skipping(key) if self._bound is not None
                                       else self._fill)
        return fill

    # ---- per step ----------------------------------------------------------------
    def fill_from(self, forward_batch: Any, *, raw_bs: int, padded_bs: int, raw_num_tokens: int,
                  padded_num_tokens: int, pp_proxy_tensors: Any = None, skip_slots: Any = frozenset()) -> None:
        """Copy the batch into the buffers and make padded tails safe (graphslot's
        generated code); ``skip_slots`` are left alone (no reset, copy or hook)."""
        if skip_slots:
            try:
                fill = self._fills.get(skip_slots)
            except TypeError:  # an unhashable set
                fill = None
            if fill is None:
                fill = self._fill_skipping(skip_slots)
        else:
            fill = self._fill
            if fill is None:
                fill = self._fill_skipping(skip_slots)
        fill(forward_batch, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_num_tokens,
             padded_num_tokens=padded_num_tokens, side_inputs=pp_proxy_tensors)

    def extract_buffer(self, *, padded_bs: int, padded_num_tokens: int, forward_batch_template: Any) -> Any:
        """A copy of the batch with ``batch_size=padded_bs`` and the slots' ``[:padded]``
        views (a plain copied slot whose field is None this step keeps the None)."""
        extract = self._extract
        if extract is None:
            self._bind()
            extract = self._extract
        return extract(forward_batch_template, padded_bs=padded_bs, padded_num_tokens=padded_num_tokens)

    def copy_slots(self, sources: Dict[str, torch.Tensor]) -> None:
        """Copy each source into ``buffer[:len(source)]`` of the slot it names (no
        resets, no hooks); a source that already is that view is not copied."""
        groups: Dict[tuple, Tuple[list, list]] = {}
        for name, src in sources.items():
            dst = self._slots[name].buffer[: src.shape[0]]
            if not same_tensor_view(dst, src):
                dsts, srcs = groups.setdefault((dst.device, dst.dtype, src.dtype), ([], []))
                dsts.append(dst)
                srcs.append(src)
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)


def dense(tensor: torch.Tensor) -> bool:
    """Whether generated code can take ``tensor`` as a buffer (graphslot's rule, :func:`refuse_strided`)."""
    try:
        refuse_strided("", "bind", tensor)
    except SlotError:
        return False
    return True


def skip_set(skip_slots: Any) -> frozenset:
    """``fill_from``'s ``skip_slots`` as a frozenset; TypeError naming the argument for
    what is not a collection of names, a str first (sglang's ``name in "input_ids"``
    tests substrings)."""
    if not isinstance(skip_slots, (str, bytes)):
        try:
            return frozenset(skip_slots)
        except TypeError:
            pass
    hint = f": pass {{{shorten(skip_slots)}}}" if isinstance(skip_slots, str) else ""
    raise TypeError(f"skip_slots must be a collection of slot names (a set, frozenset, list or tuple), got the "
                    f"{type(skip_slots).__name__} {shorten(skip_slots)}{hint}")


def composite_spec(base: Optional[RegistrySpec], entries: List[Dict[str, Any]]) -> RegistrySpec:
    """The spec of a base (or none) plus code-built entries, validated once per
    process for each distinct combination."""
    key = (None if base is None else (base.identity, base.path),
           tuple(json.dumps(e, sort_keys=True) for e in entries))
    spec = _SPECS.get(key)
    if spec is None:
        if not entries:
            spec = base
        else:
            data = base.to_dict() if base is not None else {"name": "sglang", "absent_fields": ABSENT_FIELDS,
                                                            "slots": []}
            # A base slot an entry names is one the factory left disabled (register_slot
            # refuses a registered name): as in sglang, which never registered it, the name is the entry's.
            names = {e["name"] for e in entries}
            data["slots"] = [s for s in data["slots"] if s["name"] not in names] + list(entries)
            spec = spec_from_dict(data, label=base.path if base is not None else CODE_LABEL)
        if len(_SPECS) >= _SPEC_CACHE_LIMIT:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec
