"""How many bytes a KV pool may take, and how many slots and positions that makes.

Bytes only: what one slot costs comes from the pool's geometry
(:func:`.geometry.bytes_per_slot` over what each layer writes, :func:`.cache.kv_geometry`),
so a multi-query, MLA or per-layer-shaped model is sized by what it really caches.

* :func:`kv_budget`: the budget of a :class:`~.engine.ContinuousBatcher`:
  ``kv_cache_bytes=N`` when given, else :data:`KV_MEMORY_FRACTION` of the device's free
  memory (``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of ``/proc/meminfo``
  on the CPU) when the batcher is built, lowered to ``GRAPHSLOT_MAX_KV_BYTES`` when
  that is set.
* :func:`pool_size`: the pool's slots and the longest context from the budget, which
  covers the pool (``num_slots x bytes per slot``) and the request table
  (``(max_requests + 1) x max_context_len x 8`` bytes, :func:`table_bytes`).
  ``max_context_len`` defaults to ``min(max_position_embeddings, num_slots - 1)``: one
  request may fill the whole pool, none may be longer than the model's positions. A
  128k-position model therefore gets the context its pool can hold, not a 32 GiB pool
  for 32 rows of 131072 positions. The pool never exceeds ``max_requests x
  max_context_len + 1`` slots (every row full), so a small ``max_context_len`` costs
  only its rows. With context buckets a long ``max_context_len`` costs memory only
  (the request table), not time.
* :func:`device_memory`: a device's total or free memory; the total is
  :class:`~.cache.PagedCache`'s default cap on a pool of any size.
* :func:`check_decode_graphs`: the decode graphs ``max_bs`` asks for against the free
  memory the KV budget leaves, before anything is allocated. A graph of ``bs`` rows at a
  context of ``L`` positions keeps about ``bs x (per_row + (L - 1) x per_position)``
  bytes: ``per_row`` what one token's forward makes (:class:`Allocations`, counted in
  the probe), ``per_position`` its gathered K and V (the pool's bytes per slot). The
  CPU tape keeps every graph's tensors, so they add up; CUDA graphs share one pool, of
  at least the largest graph's rows at one position.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...graphs.backend import backend_name
from ...runners.decode import DecodeRunnerConfig
from ...runners.dispatch import capture_sizes, context_ladder
from ...spec.budget import BufferBudgetError, byte_cap, format_bytes

#: Caps a KV pool's bytes (PagedCache) and the default budget (ContinuousBatcher).
MAX_KV_BYTES_ENV = "GRAPHSLOT_MAX_KV_BYTES"
#: The share of the device's free memory the default KV budget takes. CUDA keeps the
#: rest for the graphs' activations and the eager prefill; on the CPU the pool is
#: zero-filled, so it is resident memory.
KV_MEMORY_FRACTION = {"cuda": 0.6, "cpu": 0.25}
#: The request table's entries (int64 slot ids).
TABLE_ITEMSIZE = 8


class PoolSize(NamedTuple):
    num_slots: int
    max_context_len: int
    #: The budget and where it came from ("kv_cache_bytes", the env variable, or the device's free memory).
    budget: int
    origin: str


def table_bytes(max_requests: int, max_context_len: int) -> int:
    """Bytes of the request table: ``max_requests`` rows and the dummy row 0."""
    return (max_requests + 1) * max_context_len * TABLE_ITEMSIZE


def device_memory(device: torch.device, free: bool = False) -> Optional[int]:
    """The total (``free``: the free) memory of ``device``, host RAM for the CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if free else torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    if free:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES" if free else "SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def free_memory(device: torch.device) -> Optional[int]:
    """Free memory of ``device`` now (host RAM available for the CPU), or None where unknown."""
    return device_memory(device, free=True)


def kv_budget(device: torch.device, kv_cache_bytes: Optional[int]) -> Tuple[Optional[int], str]:
    """The KV budget in bytes and where it came from (see the module docstring); None
    when neither is given and the device's free memory is unknown."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes, "kv_cache_bytes"
    cap, origin = byte_cap(None, MAX_KV_BYTES_ENV, None)
    free = free_memory(device)
    fraction = KV_MEMORY_FRACTION.get(device.type)
    share = None if free is None or fraction is None else int(free * fraction)
    if share is not None and (cap is None or share < cap):
        return share, f"{fraction:g} of the {format_bytes(free)} free on {device}"
    return cap, origin


def pool_size(per_slot: int, device: torch.device, *, max_requests: int, max_context_len: Optional[int],
              positions: Optional[int], kv_cache_bytes: Optional[int]) -> PoolSize:
    """The pool's slots (of ``per_slot`` bytes each) and the longest context, from the
    budget (nothing is allocated). ``positions``: the model's ``max_position_embeddings``
    (None: unbounded). Without a budget (free memory unknown) a given
    ``max_context_len`` sizes the pool with every row full, under PagedCache's cap."""
    budget, origin = kv_budget(device, kv_cache_bytes)
    per_position = table_bytes(max_requests, 1)
    context = max_context_len
    if budget is None:
        if context is None:
            raise ValueError(f"ContinuousBatcher: the free memory of {device} is unknown, so there is no default KV "
                             f"budget: pass kv_cache_bytes=N or max_context_len, or set {MAX_KV_BYTES_ENV}=N")
        slots = max_requests * context + 1
        return PoolSize(slots, context, slots * per_slot + table_bytes(max_requests, context),
                        "every row full (no budget: the free memory is unknown)")
    if context is None:
        # the longest c whose table leaves c + 1 slots: (budget - c * per_position) >= (c + 1) * per_slot
        context = max(1, (budget - per_slot) // (per_slot + per_position))
        if positions:
            context = min(context, positions)
    table = table_bytes(max_requests, context)
    slots = min(max(budget - table, 0) // per_slot, max_requests * context + 1)
    if slots < context + 1:
        raise BufferBudgetError(
            f"ContinuousBatcher: a KV budget of {format_bytes(budget)} ({origin}) holds {max(slots, 0)} token slots "
            f"of {per_slot} bytes after the request table ({max_requests + 1} rows (max_requests={max_requests} and a "
            f"dummy) x max_context_len={context} x {TABLE_ITEMSIZE} bytes = {format_bytes(table)}), fewer than "
            f"max_context_len + 1 = {context + 1}, so a request of max_context_len could never be admitted. Nothing "
            f"was allocated. Raise the budget (kv_cache_bytes=N, or {MAX_KV_BYTES_ENV}=N) or lower max_context_len "
            f"or max_bs")
    return PoolSize(int(slots), int(context), budget, origin)


class Allocations(TorchDispatchMode):
    """Counts the bytes of the new storages the ops run under it make (``bytes``); a view
    or an in-place result shares an input's storage and is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {_storage(t)[0] for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            ptr, nbytes = _storage(t)
            if ptr not in seen:
                seen.add(ptr)
                self.bytes += nbytes
        return out


def _storage(value: Any) -> Tuple[Optional[int], int]:
    """``(data_ptr, nbytes)`` of a tensor's storage; ``(None, 0)`` for anything else, and
    for a tensor subclass without one (a quantized weight's wrapper)."""
    if not isinstance(value, torch.Tensor):
        return None, 0
    try:
        storage = value.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, 0


def check_graph_memory(device: torch.device, kv: PoolSize, *, max_bs: int, sizes: Sequence[int],
                       contexts: Sequence[int], per_row: int, per_position: int, kept: bool) -> None:
    """Refuse (BufferBudgetError naming ``max_bs``) decode graphs of ``sizes`` rows at
    ``contexts`` positions that cannot fit the device's free memory beside the KV budget
    ``kv`` (see the module docstring; ``kept``: each graph keeps its own tensors). Where
    the free memory is unknown nothing is checked."""
    free = free_memory(device)
    if free is None:
        return
    if kept:
        need = sum(bs * (per_row + (length - 1) * per_position) for bs in sizes for length in contexts)
        how = "each graph keeping its own (the cpu tape)"
    else:
        need = max(sizes) * per_row
        how = "sharing one pool (at least the largest graph's rows at one position)"
    room = free - kv.budget
    if need <= room:
        return
    raise BufferBudgetError(
        f"ContinuousBatcher: max_bs={max_bs} needs about {format_bytes(need)} for the decode graphs: "
        f"{len(sizes) * len(contexts)} graphs of up to {max(sizes)} rows and contexts up to {max(contexts)} "
        f"positions, at {per_row} bytes per row (the tensors one token's forward makes) and {per_position} bytes per "
        f"row and position (its K and V), {how}; the free memory is {format_bytes(free)} on {device}, "
        f"{format_bytes(max(room, 0))} of it left after the KV budget of {format_bytes(kv.budget)} ({kv.origin}). "
        f"Nothing was allocated. Lower max_bs (or max_requests, or the captured sizes: capture_bs, context_buckets)")


def check_decode_graphs(device: torch.device, kv: PoolSize, config: DecodeRunnerConfig, max_requests: int,
                        per_row: int, per_position: int) -> None:
    """:func:`check_graph_memory` for the graphs a runner of ``config`` captures over a
    request pool of ``max_requests`` rows and ``kv.max_context_len`` positions."""
    context = kv.max_context_len
    check_graph_memory(
        device, kv, max_bs=config.max_bs, per_row=per_row, per_position=per_position,
        sizes=capture_sizes(config.max_bs, config.capture_bs, config.capture_bs_multiple, max_requests),
        contexts=context_ladder(config.context_buckets, context) or [context],
        kept=backend_name(config.backend, device) == "cpu")
