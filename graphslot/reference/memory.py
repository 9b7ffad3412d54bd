"""Request and KV-cache pools with page size 1.

Slot bookkeeping (free lists) lives on the host so allocation never reads the device.
Index 0 of every pool is reserved and never handed out: a padded row of a CUDA-graph
batch points at request 0 and KV slot 0, so whatever it writes lands in a dummy slot
that no real request ever reads.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Union

import torch

Slots = Union[torch.Tensor, Sequence[int]]


def _host_list(slots: Slots) -> List[int]:
    if isinstance(slots, torch.Tensor):
        return [int(s) for s in slots.tolist()]
    return [int(s) for s in slots]


class _FreeList:
    """Deterministic allocator of the integers 1..size-1 (0 is the dummy)."""

    def __init__(self, size: int, what: str):
        if size < 2:
            raise ValueError(f"{what} needs size >= 2 (index 0 is reserved), got {size}")
        self.size = size
        self.what = what
        self._free: List[int] = list(range(1, size))

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self, n: int) -> List[int]:
        if n > len(self._free):
            raise RuntimeError(f"{self.what} exhausted: asked for {n}, {len(self._free)} free")
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def give_back(self, items: Iterable[int]) -> None:
        for i in items:
            if not 0 < i < self.size:
                raise ValueError(f"{self.what}: cannot free index {i}")
            self._free.append(i)


class ReqToTokenPool:
    """``req_to_token[r, p]`` is the KV slot of token ``p`` of the request in slot ``r``.

    Row 0 stays all zeros, so a padded row (request 0) gathers only the dummy KV slot.
    """

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device] = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=self.device)
        self._free = _FreeList(size, "ReqToTokenPool")

    @property
    def available(self) -> int:
        return self._free.available

    def alloc(self, n: int = 1) -> List[int]:
        return self._free.take(n)

    def free(self, indices: Union[int, Slots]) -> None:
        self._free.give_back([indices] if isinstance(indices, int) else _host_list(indices))

    def write(self, req_pool_idx: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as the KV slots of positions ``start, start+1, ...``."""
        self.req_to_token[req_pool_idx, start : start + slots.shape[0]] = slots

    def write_tokens(self, req_pool_indices: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Batched form of :meth:`write` for one slot per (request, position) pair."""
        self.req_to_token.index_put_((req_pool_indices, positions), slots)


class PagedKVCache:
    """Per-layer K and V buffers of shape ``[size, num_kv_heads, head_dim]``."""

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
        self._free = _FreeList(size, "PagedKVCache")
        sizes = [self._layer_size(layer) for layer in range(num_layers)]
        # zeros, not empty: attention multiplies masked-out values by 0, and 0 * NaN from
        # uninitialised memory would leak into real rows.
        self.k_buffer = [torch.zeros(s, num_kv_heads, head_dim, dtype=dtype, device=self.device) for s in sizes]
        self.v_buffer = [torch.zeros(s, num_kv_heads, head_dim, dtype=dtype, device=self.device) for s in sizes]

    def _layer_size(self, layer: int) -> int:
        return self.size

    @property
    def available(self) -> int:
        return self._free.available

    def is_swa_layer(self, layer: int) -> bool:
        return False

    def alloc(self, n: int) -> torch.Tensor:
        return torch.tensor(self._free.take(n), dtype=torch.int64, device=self.device)

    def free(self, slots: Slots) -> None:
        self._free.give_back(_host_list(slots))

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, kv_heads, head_dim]``) at ``loc`` in the layer's slot space.

        ``index_copy_`` keeps this free of host syncs; duplicate indices only occur for
        the dummy slot 0 (padded rows), where the winner does not matter.
        """
        if loc.dtype != torch.int64:
            loc = loc.long()  # index_copy_ takes int64 only; slot specs may narrow (int32 SWA slots)
        self.k_buffer[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer].index_copy_(0, loc, v.to(self.dtype))


class SWAKVCache(PagedKVCache):
    """A KV cache whose sliding-window layers live in a second, smaller slot space.

    Slots handed out by :meth:`alloc` are full-pool slots; each also gets an SWA slot,
    recorded in ``full_to_swa_index_mapping``. Once a token falls out of every future
    query's window, :meth:`free_swa` returns its SWA slot early and maps it to the dummy
    slot 0 (attention masks those positions anyway).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        size: int,
        swa_size: int,
        swa_layers: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
    ):
        self.swa_layers = frozenset(int(layer) for layer in swa_layers)
        self.swa_size = swa_size
        super().__init__(num_layers, num_kv_heads, head_dim, size, dtype, device)
        self._swa_free = _FreeList(swa_size, "SWAKVCache (swa)")
        self.full_to_swa_index_mapping = torch.zeros(size, dtype=torch.int64, device=self.device)
        # Host mirror of the mapping, so freeing never reads the device.
        self._swa_of: dict = {}
        self._out_cache_loc_swa: Optional[torch.Tensor] = None

    def _layer_size(self, layer: int) -> int:
        return self.swa_size if layer in self.swa_layers else self.size

    def is_swa_layer(self, layer: int) -> bool:
        return layer in self.swa_layers

    @property
    def swa_available(self) -> int:
        return self._swa_free.available

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._swa_free.available:
            raise RuntimeError(f"SWAKVCache (swa) exhausted: asked for {n}, {self._swa_free.available} free")
        full = self._free.take(n)
        swa = self._swa_free.take(n)
        self._swa_of.update(zip(full, swa))
        full_t = torch.tensor(full, dtype=torch.int64, device=self.device)
        swa_t = torch.tensor(swa, dtype=torch.int64, device=self.device)
        self.full_to_swa_index_mapping.index_copy_(0, full_t, swa_t)
        return full_t

    def free_swa(self, slots: Slots) -> None:
        """Release the SWA slots of full slots whose tokens left the window."""
        full = [s for s in _host_list(slots) if s in self._swa_of]
        if not full:
            return
        self._swa_free.give_back(self._swa_of.pop(s) for s in full)
        full_t = torch.tensor(full, dtype=torch.int64, device=self.device)
        self.full_to_swa_index_mapping.index_fill_(0, full_t, 0)

    def free(self, slots: Slots) -> None:
        slots = _host_list(slots)
        self.free_swa(slots)
        super().free(slots)

    def translate_to_swa(self, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """Eager translation of full slots to SWA slots (a fresh tensor)."""
        return self.full_to_swa_index_mapping.index_select(0, out_cache_loc)

    def register_out_cache_loc_swa(self, buffer: Optional[torch.Tensor]) -> None:
        """Make :meth:`swa_loc` write into ``buffer`` (a runner's static buffer).

        Inside a captured graph the translation must land at a fixed address so the
        SWA-layer writes replay against fresh slots; ``None`` unregisters.
        """
        self._out_cache_loc_swa = buffer

    def swa_loc(self, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """SWA slots of ``out_cache_loc``, in the registered buffer when there is one."""
        buffer = self._out_cache_loc_swa
        n = out_cache_loc.shape[0]
        # A batch larger than the buffer (an eager prefill) gets a fresh tensor: an out=
        # view that is too short would be resized, moving the buffer a graph reads.
        if buffer is None or n > buffer.shape[0]:
            return self.translate_to_swa(out_cache_loc)
        out = buffer[:n]
        if out.dtype == self.full_to_swa_index_mapping.dtype:
            torch.index_select(self.full_to_swa_index_mapping, 0, out_cache_loc, out=out)
        else:  # index_select(out=) needs matching dtypes; the decode spec's buffer is int32
            out.copy_(self.full_to_swa_index_mapping.index_select(0, out_cache_loc))
        return out
