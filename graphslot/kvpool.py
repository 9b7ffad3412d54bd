"""The paged KV pool and the request-to-token table, page size 1 (torch).

:class:`PagedKVCache` holds K and V per layer as ``[size, num_kv_heads, head_dim]``;
:class:`ReqToTokenPool`'s ``req_to_token[r, p]`` is the KV slot of token ``p`` of the
request in row ``r``. The transformers integration serves its models from them, and the
reference model builds on them (:mod:`graphslot.reference.memory` adds a sliding-window
pool).

Slot bookkeeping (free lists) lives on the host so allocation never reads the device.
Index 0 of every pool is reserved and never handed out: a padded row of a CUDA-graph
batch points at request 0 and KV slot 0, so whatever it writes lands in a dummy slot
that no real request ever reads.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Deque, Iterable, List, Sequence, Set, Tuple, Union

import torch

Slots = Union[torch.Tensor, Sequence[int]]


def host_slots(slots: Slots, what: str = "a pool") -> List[int]:
    """``slots`` as a host list of ints (a tensor is read once, with ``tolist``); a TypeError naming ``what``
    for a tensor of another dtype than an integer one, or an item no int (a float, a bool)."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise TypeError(f"{what}: cannot free {slots.dtype}: an index is an int (pass an integer tensor)")
        return slots.tolist()
    return [index(s, what) for s in slots]


def index(value: object, what: str) -> int:
    """``value`` as an int (a numpy integer or a one-element integer tensor too); a TypeError naming ``what``
    for a bool, a float or anything else (``int()`` would truncate it to another index)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what}: cannot free {value!r} ({type(value).__name__}): an index is an int")
    return operator.index(value)


class FreeList:
    """Deterministic allocator of the integers 1..size-1 (0 is the dummy): first in, first
    out. Taking ``n`` costs O(n) whatever the size (a pool sized by memory can hold
    millions of slots, and the engine takes one per request every decode step).

    The indices never handed out are a range (``_fresh`` up to ``size``), handed out
    before any that came back (``_returned``, in the order they came back): the queue
    of every index, without a Python object per slot no one has used yet.

    The indices handed out and not yet given back are ``_held`` (one entry per index in
    use, none for the rest): giving back one that is not held (given back twice, or
    never handed out) is refused before anything changes, since the list would then
    hand it out twice."""

    def __init__(self, size: int, what: str):
        if size < 2:
            raise ValueError(f"{what} needs size >= 2 (index 0 is reserved), got {size}")
        self.size = size
        self.what = what
        self._fresh = 1
        self._returned: Deque[int] = deque()
        self._held: Set[int] = set()

    @property
    def available(self) -> int:
        return self.size - self._fresh + len(self._returned)

    def take(self, n: int) -> List[int]:
        if n > self.available:
            raise RuntimeError(f"{self.what} exhausted: asked for {n}, {self.available} free")
        fresh = range(self._fresh, min(self.size, self._fresh + n))
        self._fresh += len(fresh)
        pop = self._returned.popleft
        out = [*fresh, *(pop() for _ in range(n - len(fresh)))]
        self._held.update(out)
        return out

    def give_back(self, items: Iterable[int]) -> None:
        """Return ``items`` to the list; all or nothing: an index out of range, not held
        (freed already, or never handed out) or repeated is a ValueError naming it, and
        then nothing is given back."""
        items = self.check_held(items)
        self._held.difference_update(items)
        self._returned.extend(items)

    def check_held(self, items: Iterable[int]) -> List[int]:
        """``items`` as a list when every one may be given back (in range, handed out and
        not given back since, named once), else the ValueError :meth:`give_back` raises."""
        items = [index(i, self.what) for i in items]
        seen: Set[int] = set()
        for i in items:
            if not 0 < i < self.size:
                raise ValueError(f"{self.what}: cannot free index {i}")
            if i not in self._held or i in seen:
                raise ValueError(f"{self.what}: cannot free index {i}: it is not in use (freed already, or never "
                                 "handed out); freeing it again would hand it out twice")
            seen.add(i)
        return items


class ReqToTokenPool:
    """``req_to_token[r, p]`` is the KV slot of token ``p`` of the request in slot ``r``.

    Row 0 stays all zeros, so a padded row (request 0) gathers only the dummy KV slot.
    """

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device] = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=self.device)
        self._free = FreeList(size, "ReqToTokenPool")

    @property
    def available(self) -> int:
        return self._free.available

    def alloc(self, n: int = 1) -> List[int]:
        return self._free.take(n)

    def free(self, indices: Union[int, Slots]) -> None:
        self._free.give_back(self._rows(indices))

    def check_free(self, indices: Union[int, Slots]) -> None:
        """Raise what :meth:`free` would (a row not in use), changing nothing."""
        self._free.check_held(self._rows(indices))

    @staticmethod
    def _rows(indices: Union[int, Slots]) -> List[int]:
        if isinstance(indices, torch.Tensor) and indices.dim() == 0 or not hasattr(type(indices), "__iter__"):
            return [index(indices, "ReqToTokenPool")]
        return host_slots(indices, "ReqToTokenPool")

    def write(self, req_pool_idx: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as the KV slots of positions ``start, start+1, ...``."""
        self.req_to_token[req_pool_idx, start : start + slots.shape[0]] = slots

    def write_tokens(self, req_pool_indices: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Batched form of :meth:`write` for one slot per (request, position) pair."""
        self.req_to_token.index_put_((req_pool_indices, positions), slots)


class PagedKVCache:
    """Per-layer K and V buffers of shape ``[size, num_kv_heads, head_dim]``.

    A subclass may give a layer another slot space (:meth:`layer_size`) or other K and V
    row shapes (:meth:`layer_shapes`), and hand out slots through :meth:`take_slots`
    (host ints) to keep its own bookkeeping.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        size: int,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
    ):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.size = size
        self.dtype = dtype
        self.device = torch.device(device)
        self._free = FreeList(size, "PagedKVCache")
        sizes = [self.layer_size(layer) for layer in range(num_layers)]
        shapes = [self.layer_shapes(layer) for layer in range(num_layers)]
        # zeros, not empty: attention multiplies masked-out values by 0, and 0 * NaN from
        # uninitialised memory would leak into real rows.
        self.k_buffer = [torch.zeros(s, *k, dtype=dtype, device=self.device) for s, (k, _) in zip(sizes, shapes)]
        self.v_buffer = [torch.zeros(s, *v, dtype=dtype, device=self.device) for s, (_, v) in zip(sizes, shapes)]

    def layer_size(self, layer: int) -> int:
        """Slots in ``layer``'s K and V buffers (all ``size`` here)."""
        return self.size

    def layer_shapes(self, layer: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """The shape of one slot's K and of its V in ``layer`` (``(num_kv_heads, head_dim)``
        for both here)."""
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    @property
    def available(self) -> int:
        return self._free.available

    def is_swa_layer(self, layer: int) -> bool:
        return False

    def take_slots(self, n: int) -> List[int]:
        """``n`` free slots, as host ints (RuntimeError when fewer are free)."""
        return self._free.take(n)

    def alloc(self, n: int) -> torch.Tensor:
        return torch.tensor(self.take_slots(n), dtype=torch.int64, device=self.device)

    def free(self, slots: Slots) -> None:
        self._free.give_back(host_slots(slots, "PagedKVCache"))

    def check_free(self, slots: Slots) -> None:
        """Raise what :meth:`free` would (a slot not in use), changing nothing."""
        self._free.check_held(host_slots(slots, "PagedKVCache"))

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, *layer_shapes(layer)]``) at ``loc`` in the layer's slot space.

        ``index_copy_`` keeps this free of host syncs; duplicate indices only occur for
        the dummy slot 0 (padded rows), where the winner does not matter.
        """
        if loc.dtype != torch.int64:
            loc = loc.long()  # index_copy_ takes int64 only; slot specs may narrow (int32 SWA slots)
        self.k_buffer[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer].index_copy_(0, loc, v.to(self.dtype))


def free_request(rows: ReqToTokenPool, kv: PagedKVCache, row: int, slots: Slots, where: str = "free_request") -> None:
    """Give back a request's ``row`` of ``rows`` and its KV ``slots`` of ``kv``, both or
    neither: a row or slot not in use (freed already, or never allocated) is a ValueError
    naming ``where`` and the row, and nothing is freed."""
    slots = host_slots(slots, type(kv).__name__)
    try:
        rows.check_free(row)
        kv.check_free(slots)
    except ValueError as exc:
        raise ValueError(f"{where}(row={row}): {exc}; nothing was freed") from None
    kv.free(slots)
    rows.free(row)
