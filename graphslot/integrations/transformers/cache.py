"""A paged KV cache behind transformers' ``Cache`` protocol, indexed by the decode slots.

Why not transformers' ``StaticCache``: it fixes its batch size on first use and keeps
one length counter for all rows, which warm-up and capture advance; a graph runner
captures several batch sizes over the same cache and serves requests of different
lengths that join and leave. Here every row of a step says where its tokens go and
which request it is, through the decode spec's slots, so one pool serves every
captured size:

* the pool holds K and V per layer as ``[num_slots, kv_heads, head_dim]``
  (:class:`graphslot.kvpool.PagedKVCache`), and ``req_to_token[r, p]`` is the
  slot of position ``p`` of the request in row ``r``
  (:class:`~graphslot.kvpool.ReqToTokenPool`). Slot 0 and row 0 are
  reserved dummies: a padded row (``req_pool_indices`` 0, ``out_cache_loc`` 0,
  ``positions`` 0) writes and reads only them;
* before a forward, :meth:`PagedCache.bind` points the cache at the step's
  ``out_cache_loc`` (``[B*T]``, request-major) and ``req_pool_indices`` (``[B]``): the
  static views of the registry in a graph, the live batch's tensors eagerly;
* ``update(key_states, value_states, layer_idx)``, called by every attention layer
  with ``[B, kv_heads, T, head_dim]``, writes the step's tokens at ``out_cache_loc``
  and returns each row's whole context row, ``[B, kv_heads, max_context_len,
  head_dim]``, gathered through ``req_to_token``;
* which of those positions a query sees is the mask's business
  (:meth:`PagedCache.attention_mask`): position ``j`` is visible to a query at position
  ``p`` when ``j <= p`` (and ``j > p - window`` on a sliding-window layer, as
  transformers' own sliding mask). Unused and stale positions are masked out; their
  values are finite (the pool starts at zero), so they add nothing.

Every shape is fixed by the batch size and ``max_context_len`` and nothing is read on
the host, so the whole forward can be captured. The price is a gather of
``max_context_len`` positions per row and layer, whatever the row's length: keep
``max_context_len`` to what the engine needs (a production engine would use a paged
attention kernel instead).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...spec.budget import BufferBudgetError, byte_cap, format_bytes
from ...kvpool import PagedKVCache, ReqToTokenPool

FULL, SLIDING = "full_attention", "sliding_attention"
#: Overrides PagedCache's default cap on its pool's bytes (the device's total memory).
MAX_KV_BYTES_ENV = "GRAPHSLOT_MAX_KV_BYTES"


def device_memory(device: torch.device) -> Optional[int]:
    """The total memory of ``device`` (host RAM for the CPU), or None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def attention_layers(config) -> List[Tuple[str, Optional[int]]]:
    """``(layer type, sliding window or None)`` per decoder layer of a transformers config.

    ``config.layer_types`` when the config has it (Qwen2/Qwen3), else every layer is
    sliding when ``config.sliding_window`` is set (Mistral) and full otherwise (Llama).
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or [SLIDING if window else FULL] * n
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"{type(config).__name__}: layer types {unknown} are not supported by PagedCache, which "
                         f"serves '{FULL}' and '{SLIDING}' layers only")
    if SLIDING in types and not window:
        raise ValueError(f"{type(config).__name__} has '{SLIDING}' layers but no sliding_window")
    return [(t, window if t == SLIDING else None) for t in types]


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class PagedCacheLayer(CacheLayerMixin):
    """One decoder layer's view of the shared pool (transformers' per-layer protocol)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "PagedCache", layer_idx: int, layer_type: str, window: Optional[int]):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.layer_type, self.sliding_window = layer_type, window
        self.is_sliding = window is not None
        self.is_initialized = True  # the pool is allocated up front

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool exists before the first token."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.write_and_gather(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.cache.max_context_len, 0

    def get_seq_length(self) -> int:
        raise NotImplementedError(
            "a PagedCache holds requests of different lengths, so it has no one sequence length: pass "
            "position_ids and attention_mask=cache.attention_mask(position_ids) to the model")

    def get_max_length(self) -> int:
        return self.cache.max_context_len

    get_max_cache_shape = get_max_length  # the abstract method's name in older releases (5.4 has it)

    def reset(self) -> None:
        raise NotImplementedError("a PagedCache is shared by requests; free a request's row and slots instead")


class PagedCache(Cache):
    """transformers ``Cache`` over a paged pool; see the module docstring for the layout.

    ``max_requests`` rows (plus the dummy row 0) of ``max_context_len`` positions;
    ``num_slots`` KV slots (default: enough for every row to be full, plus slot 0).
    """

    def __init__(self, config, *, max_requests: int, max_context_len: int, num_slots: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                 max_bytes: Optional[int] = None):
        if max_requests < 1 or max_context_len < 1:
            raise ValueError(f"PagedCache needs max_requests >= 1 and max_context_len >= 1, got {max_requests} "
                             f"and {max_context_len}")
        self.config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.layer_kinds = attention_layers(self.config)
        self.max_requests, self.max_context_len = max_requests, max_context_len
        self.device, self.dtype = torch.device(device), dtype
        self.num_kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        self.head_dim = head_dim(self.config)
        num_slots = num_slots or max_requests * max_context_len + 1
        self._check_bytes(num_slots, max_bytes)
        self.pool = PagedKVCache(len(self.layer_kinds), self.num_kv_heads, self.head_dim,
                                 num_slots, dtype=dtype, device=self.device)
        self.req_to_token_pool = ReqToTokenPool(max_requests + 1, max_context_len, self.device)
        #: ``[1, 1, max_context_len]`` positions of the gathered keys, made once (a static input).
        self.kv_positions = torch.arange(max_context_len, device=self.device).view(1, 1, -1)
        self._loc: Optional[torch.Tensor] = None
        self._rows: Optional[torch.Tensor] = None
        super().__init__(layers=[PagedCacheLayer(self, i, t, w) for i, (t, w) in enumerate(self.layer_kinds)])

    def _check_bytes(self, num_slots: int, max_bytes: Optional[int]) -> None:
        """Refuse, before allocating, a pool over the cap: ``max_bytes``, else
        ``GRAPHSLOT_MAX_KV_BYTES``, else the device's total memory (what can never fit)."""
        itemsize = self.dtype.itemsize
        kv = num_slots * len(self.layer_kinds) * self.num_kv_heads * self.head_dim * 2 * itemsize
        table = (self.max_requests + 1) * self.max_context_len * 8  # req_to_token, int64
        cap, origin = byte_cap(max_bytes, MAX_KV_BYTES_ENV, device_memory(self.device),
                               f"the total memory of {self.device}")
        if cap is not None and kv + table > cap:
            raise BufferBudgetError(
                f"PagedCache: max_requests={self.max_requests} x max_context_len={self.max_context_len} need a KV "
                f"pool of {num_slots} slots x {len(self.layer_kinds)} layers x {self.num_kv_heads} KV heads x "
                f"head_dim {self.head_dim} x 2 (K and V) x {itemsize} bytes = {format_bytes(kv)}, plus "
                f"{format_bytes(table)} of request table: over the cap of {format_bytes(cap)} ({origin}). Nothing "
                f"was allocated. Lower max_requests (ContinuousBatcher's max_bs) or max_context_len, or raise the "
                f"cap: PagedCache(max_bytes=N) or the environment variable {MAX_KV_BYTES_ENV}=N")

    # -- the step ------------------------------------------------------------------
    def bind(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """Point the next forward at a step's slots (the same tensors a graph was captured on)."""
        self._loc, self._rows = out_cache_loc, req_pool_indices

    def write_and_gather(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if self._loc is None:
            raise RuntimeError("PagedCache.update before bind(): bind the step's out_cache_loc and "
                               "req_pool_indices before running the model")
        b, h, t, d = key_states.shape
        if self._loc.shape[0] != b * t or self._rows.shape[0] != b:
            raise ValueError(f"PagedCache: the bound step has {self._rows.shape[0]} requests and "
                             f"{self._loc.shape[0]} token slots, the model ran {b} x {t} tokens")
        self.pool.set_kv(layer_idx, self._loc, key_states.transpose(1, 2).reshape(b * t, h, d),
                         value_states.transpose(1, 2).reshape(b * t, h, value_states.shape[-1]))
        slots = self.req_to_token_pool.req_to_token.index_select(0, self._rows).view(-1)
        length = self.max_context_len
        keys = self.pool.k_buffer[layer_idx].index_select(0, slots).view(b, length, h, d)
        values = self.pool.v_buffer[layer_idx].index_select(0, slots).view(b, length, h, -1)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def attention_mask(self, positions: torch.Tensor, dtype: Optional[torch.dtype] = None
                       ) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
        """Additive masks ``[B, 1, T, max_context_len]`` for queries at ``positions``
        (``[B, T]``): one tensor when every layer has the same kind, else a mapping by
        layer type (what Qwen2/Qwen3 take). transformers uses a 4-D mask as given."""
        dtype = dtype or self.dtype
        pos = positions.unsqueeze(-1)  # [B, T, 1]
        visible = self.kv_positions <= pos
        masks: Dict[str, torch.Tensor] = {}
        for kind, window in dict.fromkeys(self.layer_kinds):
            seen = visible if window is None else visible & (self.kv_positions > pos - window)
            masks[kind] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
                ~seen, torch.finfo(dtype).min).unsqueeze(1)
        return next(iter(masks.values())) if len(masks) == 1 else masks

    # -- request bookkeeping (host) -------------------------------------------------
    def alloc_request(self) -> int:
        return self.req_to_token_pool.alloc(1)[0]

    def alloc_tokens(self, row: int, start: int, count: int) -> List[int]:
        """``count`` new slots for positions ``start..`` of row ``row``, recorded in ``req_to_token``."""
        if start + count > self.max_context_len:
            raise ValueError(f"a request of {start + count} tokens does not fit max_context_len "
                             f"{self.max_context_len}; build the cache with a larger one")
        slots = self.pool.alloc(count)
        self.req_to_token_pool.write(row, start, slots)
        return slots.tolist()

    def free_request(self, row: int, slots: Sequence[int]) -> None:
        self.pool.free(list(slots))
        self.req_to_token_pool.free(row)

    @property
    def available_slots(self) -> int:
        return self.pool.available

    @property
    def available_requests(self) -> int:
        return self.req_to_token_pool.available

    def static_tensors(self):
        """Tensors a captured forward reads that no slot owns."""
        yield from self.pool.k_buffer
        yield from self.pool.v_buffer
        yield self.req_to_token_pool.req_to_token
        yield self.kv_positions
