"""How big a :class:`ContinuousBatcher`'s KV pool is: a byte budget, not the model's longest context.

The pool holds ``num_slots`` token positions, shared by every request: one slot takes
``layers x kv_heads x head_dim x 2 (K and V) x itemsize`` bytes
(:func:`kv_bytes_per_token`), and the request table ``req_to_token`` takes
``(max_requests + 1) x max_context_len x 8`` bytes more. The budget covers both:

* ``kv_cache_bytes=N`` when given;
* else :data:`KV_MEMORY_FRACTION` of the device's free memory (``torch.cuda.mem_get_info``
  on CUDA, ``MemAvailable`` of ``/proc/meminfo`` on the CPU) when the batcher is built,
  lowered to ``GRAPHSLOT_MAX_KV_BYTES`` when that is set.

``max_context_len`` defaults to ``min(max_position_embeddings, num_slots - 1)``: one
request may fill the whole pool, none may be longer than the model's positions. A
128k-position model therefore gets the context its pool can hold, not a 32 GiB pool
for 32 rows of 131072 positions. The pool never exceeds ``max_requests x
max_context_len + 1`` slots (every row full), so a small ``max_context_len`` costs only
its rows. Requests are admitted while the pool can hold every admitted request's prompt
and all its new tokens (a reservation), so a running request never runs out of slots.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

import torch

from ...spec.budget import BufferBudgetError, byte_cap, format_bytes
from .cache import MAX_KV_BYTES_ENV, attention_layers, head_dim

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


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one cached token takes in the pool: every layer's K and V."""
    config = text_config(config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return len(attention_layers(config)) * heads * head_dim(config) * 2 * dtype.itemsize


def free_memory(device: torch.device) -> Optional[int]:
    """Free memory of ``device`` now (host RAM available for the CPU), or None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        if hasattr(os, "sysconf"):
            try:
                return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            except (ValueError, OSError):
                return None
    return None


def kv_budget(device: torch.device, kv_cache_bytes: Optional[int]) -> Tuple[int, str]:
    """The KV budget in bytes and where it came from (see the module docstring)."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes, "kv_cache_bytes"
    cap, origin = byte_cap(None, MAX_KV_BYTES_ENV, None)
    free = free_memory(device)
    fraction = KV_MEMORY_FRACTION.get(device.type)
    share = None if free is None or fraction is None else int(free * fraction)
    if share is not None and (cap is None or share < cap):
        return share, f"{fraction:g} of the {format_bytes(free)} free on {device}"
    if cap is None:
        raise ValueError(f"ContinuousBatcher: the free memory of {device} is unknown, so there is no default KV "
                         f"budget: pass kv_cache_bytes=N or max_context_len, or set {MAX_KV_BYTES_ENV}=N")
    return cap, origin


def pool_size(config, dtype: torch.dtype, device: torch.device, *, max_requests: int,
              max_context_len: Optional[int], kv_cache_bytes: Optional[int]) -> PoolSize:
    """The pool's slots and the longest context, from the budget (nothing is allocated)."""
    budget, origin = kv_budget(device, kv_cache_bytes)
    per_token = kv_bytes_per_token(config, dtype)
    positions = getattr(text_config(config), "max_position_embeddings", None)
    per_position = (max_requests + 1) * TABLE_ITEMSIZE  # of the request table
    context = max_context_len
    if context is None:  # the longest c whose table leaves c + 1 slots: (budget - c * per_position) >= (c + 1) * per_token
        context = max(1, (budget - per_token) // (per_token + per_position))
        if positions:
            context = min(context, positions)
    table = per_position * context
    slots = min(max(budget - table, 0) // per_token, max_requests * context + 1)
    if slots < context + 1:
        raise BufferBudgetError(
            f"ContinuousBatcher: a KV budget of {format_bytes(budget)} ({origin}) holds {max(slots, 0)} token slots "
            f"of {per_token} bytes after the request table ({max_requests + 1} rows (max_requests={max_requests} and a "
            f"dummy) x max_context_len={context} x {TABLE_ITEMSIZE} bytes = {format_bytes(table)}), fewer than "
            f"max_context_len + 1 = {context + 1}, so a request of max_context_len could never be admitted. Nothing "
            f"was allocated. Raise the budget (kv_cache_bytes=N, or {MAX_KV_BYTES_ENV}=N) or lower max_context_len "
            f"or max_bs")
    return PoolSize(int(slots), int(context), budget, origin)
