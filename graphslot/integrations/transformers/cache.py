"""A paged KV cache behind transformers' ``Cache`` protocol, indexed by the decode slots.

Why not transformers' ``StaticCache``: it fixes its batch size on first use and keeps
one length counter for all rows, which warm-up and capture advance; a graph runner
captures several batch sizes over the same cache and serves requests of different
lengths that join and leave. Here every row of a step says where its tokens go and
which request it is, through the decode spec's slots, so one pool serves every
captured size:

* the pool holds K and V per layer as ``[num_slots, heads, width]``
  (:class:`graphslot.kvpool.PagedKVCache`), and ``req_to_token[r, p]`` is the
  slot of position ``p`` of the request in row ``r``
  (:class:`~graphslot.kvpool.ReqToTokenPool`). Slot 0 and row 0 are
  reserved dummies: a padded row (``req_pool_indices`` 0, ``out_cache_loc`` 0,
  ``positions`` 0) writes and reads only them. The pool's size is ``num_slots``, not
  ``max_requests x max_context_len``: :func:`.budget.pool_size` turns a byte budget
  into slots (what :func:`bytes_per_slot` of the geometry costs each), and requests
  are admitted while slots are free;
* the heads and widths of each layer's K and V (:class:`LayerGeometry`) are what the
  layer writes, learnt by one eager forward of one token (:meth:`PagedCache.probe`,
  which :class:`~.adapter.HFDecodeAdapter` runs before any capture): a multi-query
  model writes one KV head, Falcon's new architecture broadcasts K and V to every head
  first, and an MLA model (DeepSeek-V2/V3, MiniCPM3) caches its compressed latent, whose
  K and V widths differ. Until then the config's guess stands; the pool is allocated at
  its first use, so a probe before that allocates once;
* before a forward, :meth:`PagedCache.bind` points the cache at the step's
  ``out_cache_loc`` (``[B*T]``, request-major) and ``req_pool_indices`` (``[B]``): the
  static views of the registry in a graph, the live batch's tensors eagerly;
* ``update(key_states, value_states, layer_idx)``, called by every attention layer
  with ``[B, heads, T, width]``, writes the step's tokens at ``out_cache_loc`` and
  returns the first ``L`` positions of each row's context, ``[B, heads, L, width]``,
  gathered through ``req_to_token``. ``L`` is the gather length: ``max_context_len``,
  or the context bucket a graph was captured for (:meth:`PagedCache.gathering`), so a
  step's attention costs its bucket, not the longest context the cache allows. Every
  row's context must fit in ``L`` (the runner picks the bucket from the step's longest);
* which of those positions a query sees is the mask's business (:mod:`.masks`:
  :meth:`PagedCache.attention_mask`, :meth:`PagedCache.packed_mask`, and the query
  offset transformers asks of a 2-D mask, :meth:`PagedCache.get_query_offset`).

:meth:`PagedCache.get_seq_length` is 0: the cache has no one length, and with
``position_ids`` and a mask given the families that ask (OPT, BioGPT, CTRL, XGLM,
Falcon, Bloom, MPT) use it only to derive what the caller passed.

Every shape is fixed by the batch size and the gather length and nothing is read on
the host, so the whole forward can be captured.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...kvpool import ReqToTokenPool, free_request
from ...spec.budget import BufferBudgetError, byte_cap, format_bytes
from .budget import MAX_KV_BYTES_ENV, device_memory, table_bytes
from .forward import with_cache
from .geometry import (
    GeometryKVPool,
    KVGeometry,
    LayerGeometry,
    attention_layers,
    bytes_per_slot,
    config_geometry,
    describe_slot,
    text_config,
)
from .masks import AttentionMasks, Mask


def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buffer[slots]``, written into a tensor made for it (``out=``): a graph replays the
    gather into that tensor, where a result in new memory would be copied into it (the
    CPU tape backend copies every such result; these are the step's largest)."""
    out = torch.empty((slots.shape[0], *buffer.shape[1:]), dtype=buffer.dtype, device=buffer.device)
    return torch.index_select(buffer, 0, slots, out=out)


class PagedCacheLayer(CacheLayerMixin):
    """One decoder layer's view of the shared pool (transformers' per-layer protocol)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "PagedCache", layer_idx: int, layer_type: str, window: Optional[int]):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        self.sliding_window = window
        self.is_sliding = window is not None
        self.is_initialized = True  # the pool is allocated up front

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool exists before the first token."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.write_and_gather(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.cache.gather_length, 0

    def get_seq_length(self) -> int:
        """0: a PagedCache holds requests of different lengths, so it has no one length.
        Callers pass ``position_ids`` and a mask, and the families that ask use the answer
        only to derive those when they are missing (the module docstring names them)."""
        return 0

    def get_max_length(self) -> int:
        return self.cache.max_context_len

    get_max_cache_shape = get_max_length  # the abstract method's name in older releases (5.4 has it)

    def reset(self) -> None:
        raise NotImplementedError("a PagedCache is shared by requests; free a request's row and slots instead")


class PagedCache(Cache):
    """transformers ``Cache`` over a paged pool; see the module docstring for the layout.

    ``max_requests`` rows (plus the dummy row 0) of ``max_context_len`` positions;
    ``num_slots`` KV slots, slot 0 included (default: enough for every row to be full,
    plus slot 0; :func:`.budget.pool_size` sizes it from a byte budget instead);
    ``geometry``: each layer's K and V shapes when known (:func:`kv_geometry`), else the
    config's guess until :meth:`probe`.
    """

    def __init__(self, config, *, max_requests: int, max_context_len: int, num_slots: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                 max_bytes: Optional[int] = None, geometry: Optional[Sequence[LayerGeometry]] = None):
        if max_requests < 1 or max_context_len < 1:
            raise ValueError(f"PagedCache needs max_requests >= 1 and max_context_len >= 1, got {max_requests} "
                             f"and {max_context_len}")
        if num_slots is not None and (isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 2):
            raise ValueError(f"PagedCache: num_slots must be an int >= 2 (slot 0 is the padded rows' dummy), got "
                             f"{num_slots!r}")
        self.config = text_config(config)
        self.layer_kinds = attention_layers(self.config)
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.dtype = dtype
        #: KV slots in the pool, slot 0 included.
        self.num_slots = num_slots or max_requests * max_context_len + 1
        self._sized_by = "num_slots" if num_slots else "max_requests x max_context_len"
        self._max_bytes = max_bytes
        #: Each layer's K and V shapes: learnt (:meth:`probe`), given, or the config's guess.
        self.geometry: Optional[KVGeometry] = None
        #: True once the geometry came from a probe of the model (or was given).
        self.geometry_probed = geometry is not None
        self._pool: Optional[GeometryKVPool] = None
        self._set_geometry(tuple(geometry) if geometry is not None else config_geometry(self.config))
        self.req_to_token_pool = ReqToTokenPool(max_requests + 1, max_context_len, self.device)
        #: Positions gathered per row by the next forwards; None: ``max_context_len``.
        self.gather_len: Optional[int] = None
        #: Which gathered positions each query sees (:mod:`.masks`).
        self.masks = AttentionMasks(self.config, self.layer_kinds, max_context_len, self.device)
        self._probed: Optional[Dict[int, LayerGeometry]] = None  # while probing
        self._loc: Optional[torch.Tensor] = None
        self._rows: Optional[torch.Tensor] = None
        self._keys: Optional[torch.Tensor] = None  # a packed step's gathered slots
        super().__init__(layers=[PagedCacheLayer(self, i, t, w) for i, (t, w) in enumerate(self.layer_kinds)])

    # -- sizing ----------------------------------------------------------------------
    def _set_geometry(self, geometry: Optional[KVGeometry]) -> None:
        if geometry is not None and len(geometry) != len(self.layer_kinds):
            raise ValueError(f"PagedCache: a geometry of {len(geometry)} layers for a model of "
                             f"{len(self.layer_kinds)} decoder layers")
        self._check_bytes(geometry)
        self.geometry = geometry

    def _check_bytes(self, geometry: Optional[KVGeometry]) -> None:
        """Refuse, before allocating, a pool over the cap: ``max_bytes``, else
        ``GRAPHSLOT_MAX_KV_BYTES``, else the device's total memory (what can never fit)."""
        itemsize = self.dtype.itemsize
        kv = 0 if geometry is None else self.num_slots * bytes_per_slot(geometry, self.dtype)
        table = table_bytes(self.max_requests, self.max_context_len)
        cap, origin = byte_cap(self._max_bytes, MAX_KV_BYTES_ENV, device_memory(self.device),
                               f"the total memory of {self.device}")
        if cap is None or kv + table <= cap:
            return
        sized = (f"max_requests={self.max_requests} x max_context_len={self.max_context_len} need"
                 if self._sized_by != "num_slots" else
                 f"num_slots={self.num_slots} (max_requests={self.max_requests}, max_context_len="
                 f"{self.max_context_len}) needs")
        pool = ("an unknown KV pool (the geometry is not known yet)" if geometry is None else
                f"a KV pool of {self.num_slots} slots x {describe_slot(geometry, itemsize)} = {format_bytes(kv)}")
        lower = "num_slots, max_requests" if self._sized_by == "num_slots" else "max_requests"
        raise BufferBudgetError(
            f"PagedCache: {sized} {pool}, plus {format_bytes(table)} of request table: over the cap of "
            f"{format_bytes(cap)} ({origin}). Nothing was allocated. Lower {lower} (ContinuousBatcher's max_bs) or "
            f"max_context_len, or raise the cap: PagedCache(max_bytes=N) or the environment variable "
            f"{MAX_KV_BYTES_ENV}=N")

    @property
    def pool(self) -> GeometryKVPool:
        """The K and V buffers, allocated at first use with the geometry known then."""
        if self._pool is None:
            if self.geometry is None:
                raise RuntimeError(f"PagedCache: the KV pool's geometry is unknown ({type(self.config).__name__} "
                                   "names no KV heads); run cache.probe(model) first (HFDecodeAdapter does)")
            self._pool = GeometryKVPool(self.geometry, self.num_slots, self.dtype, self.device)
        return self._pool

    # -- the geometry probe ------------------------------------------------------------
    def probe(self, model: Any) -> KVGeometry:
        """Learn each layer's K and V shapes from one eager forward of one token (nothing is
        written to the pool) and take them as the pool's geometry. Raises, naming the
        layers, when some layer never calls ``past_key_values.update``; a RuntimeError
        when the pool was allocated with another geometry and has requests in it."""
        model = getattr(model, "_orig_mod", model)  # a torch.compile'd model: its module, run eagerly
        seen: Dict[int, LayerGeometry] = {}
        ids = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        self._probed = seen
        try:
            with torch.no_grad(), self.gathering(1):
                model(input_ids=ids, position_ids=ids, **with_cache(model, self), use_cache=True,
                      attention_mask=self.attention_mask(ids, model.dtype))
        finally:
            self._probed = None
        missing = [i for i in range(len(self.layer_kinds)) if i not in seen]
        if missing:
            raise ValueError(f"{type(model).__name__}: decoder layer(s) {missing} of {len(self.layer_kinds)} never "
                             "called past_key_values.update in a forward; PagedCache serves models whose every "
                             "attention layer caches through it")
        geometry = tuple(seen[i] for i in range(len(self.layer_kinds)))
        self.adopt_geometry(geometry)
        return geometry

    def adopt_geometry(self, geometry: Sequence[LayerGeometry]) -> None:
        """Take ``geometry`` for the pool (checked against the byte cap); an allocated pool
        of another geometry is dropped if no request holds a slot, else RuntimeError."""
        geometry = tuple(geometry)
        if geometry != self.geometry and self._pool is not None:
            if self._pool.available != self.num_slots - 1:
                raise RuntimeError("PagedCache: the pool has requests in it; its geometry cannot change now (probe "
                                   "the model before admitting requests)")
            self._pool = None
        self._set_geometry(geometry)
        self.geometry_probed = True

    # -- the step ------------------------------------------------------------------
    @property
    def gather_length(self) -> int:
        """Positions gathered (and masked) per row by the next forward."""
        return self.gather_len or self.max_context_len

    @contextlib.contextmanager
    def gathering(self, length: Optional[int]) -> Iterator[None]:
        """Gather (and mask) the first ``length`` positions of each row in the forwards run
        inside (None: ``max_context_len``). A graph captured inside replays that length
        whatever comes later; the caller makes sure every row's context fits."""
        if length is not None and not 1 <= length <= self.max_context_len:
            raise ValueError(f"PagedCache: a gather length of {length!r}; it must be 1..max_context_len "
                             f"({self.max_context_len})")
        previous = self.gather_len
        self.gather_len = length
        try:
            yield
        finally:
            self.gather_len = previous

    def bind(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """Point the next forward at a step's slots (the same tensors a graph was captured on)."""
        self._loc = out_cache_loc
        self._rows = req_pool_indices
        self._keys = None

    def bind_packed(self, out_cache_loc: torch.Tensor, keys: torch.Tensor) -> None:
        """Point the next (eager) forward at a packed step: one row of ``T`` tokens from
        several sequences, token ``i``'s K and V to slot ``out_cache_loc[i]``, every layer
        attending over the slots ``keys`` (``[K]``: the sequences' contexts, one after
        another); :meth:`packed_mask` says which query sees which key."""
        self._loc = out_cache_loc
        self._rows = None
        self._keys = keys

    def write_and_gather(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if self._probed is not None:
            return self._record(layer_idx, key_states, value_states)
        if self._loc is None:
            raise RuntimeError("PagedCache.update before bind(): bind the step's out_cache_loc and "
                               "req_pool_indices before running the model")
        b, h, t, d = key_states.shape
        hv = value_states.shape[1]
        rows = 1 if self._rows is None else self._rows.shape[0]
        if self._loc.shape[0] != b * t or rows != b:
            raise ValueError(f"PagedCache: the bound step has {rows} {'requests' if self._keys is None else 'row'} "
                             f"and {self._loc.shape[0]} token slots, the model ran {b} x {t} tokens")
        pool = self.pool
        pool.set_kv(layer_idx, self._loc, key_states.transpose(1, 2).reshape(b * t, h, d),
                    value_states.transpose(1, 2).reshape(b * t, hv, value_states.shape[-1]))
        if self._keys is not None:  # packed: one row over the given slots
            slots = self._keys
            length = self._keys.shape[0]
        else:
            length = self.gather_length
            table = self.req_to_token_pool.req_to_token
            if length != self.max_context_len:
                table = table[:, :length]  # a view of the static table: fixed for a given length
            slots = table.index_select(0, self._rows).view(-1)
        keys = _gather(pool.k_buffer[layer_idx], slots).view(b, length, h, d)
        values = _gather(pool.v_buffer[layer_idx], slots).view(b, length, hv, -1)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def _record(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """The probe: note what the layer writes, hand it back as its whole context."""
        seen = LayerGeometry(key_states.shape[1], key_states.shape[-1], value_states.shape[1], value_states.shape[-1])
        if self._probed.setdefault(layer_idx, seen) != seen:
            raise ValueError(f"decoder layer {layer_idx} called past_key_values.update twice in one forward, with "
                             f"{self._probed[layer_idx]} and {seen}; PagedCache keeps one K and V per layer and token")
        return key_states, value_states

    @property
    def mask_route(self) -> str:
        """``"4d"`` (an additive mask the model takes as given) or ``"2d"`` (:mod:`.masks`)."""
        return self.masks.route

    def attention_mask(self, positions: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Mask:
        """The mask for queries at ``positions`` (``[B, T]``) over the gathered positions
        (:meth:`.masks.AttentionMasks.attention_mask`; ``dtype``: the cache's by default).
        A mask of route ``"4d"`` is one tensor when every layer has the same kind, else a
        mapping by layer type (what Qwen2/Qwen3 take)."""
        return self.masks.attention_mask(positions, self.gather_length, dtype or self.dtype)

    def packed_mask(self, query_seqs: torch.Tensor, query_positions: torch.Tensor, key_seqs: torch.Tensor,
                    key_positions: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Mask:
        """The mask of a packed step (:meth:`bind_packed`; :meth:`.masks.AttentionMasks.packed_mask`)."""
        return self.masks.packed_mask(query_seqs, query_positions, key_seqs, key_positions, dtype or self.dtype)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the queries start among the gathered positions (:meth:`.masks.AttentionMasks.query_offset`)."""
        return self.masks.query_offset(self.gather_length)

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
        """Give back a request's row and KV slots, both or neither (:func:`graphslot.kvpool.free_request`)."""
        free_request(self.req_to_token_pool, self.pool, row, slots, "PagedCache.free_request")

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
        yield self.masks.kv_positions


def kv_geometry(model: Any) -> KVGeometry:
    """Each decoder layer's K and V shapes as ``model`` writes them (one eager forward of
    one token through a throwaway :class:`PagedCache`; nothing is allocated for it): what
    :func:`bytes_per_slot` and ``PagedCache(geometry=...)`` take."""
    cache = PagedCache(model.config, max_requests=1, max_context_len=1, dtype=model.dtype, device=model.device)
    return cache.probe(model)
