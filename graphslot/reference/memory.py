"""The reference model's sliding-window KV pool, over :mod:`graphslot.kvpool`.

Slot bookkeeping (free lists) lives on the host so allocation never reads the device;
index 0 of every pool is the dummy a padded row points at (:mod:`graphslot.kvpool`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..kvpool import FreeList, PagedKVCache, Slots, host_slots


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
        self._swa_free = FreeList(swa_size, "SWAKVCache (swa)")
        self.full_to_swa_index_mapping = torch.zeros(size, dtype=torch.int64, device=self.device)
        # Host mirror of the mapping, so freeing never reads the device.
        self._swa_of: dict = {}
        self._out_cache_loc_swa: Optional[torch.Tensor] = None

    def layer_size(self, layer: int) -> int:
        return self.swa_size if layer in self.swa_layers else self.size

    def is_swa_layer(self, layer: int) -> bool:
        return layer in self.swa_layers

    @property
    def swa_available(self) -> int:
        return self._swa_free.available

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._swa_free.available:
            raise RuntimeError(f"SWAKVCache (swa) exhausted: asked for {n}, {self._swa_free.available} free")
        full = self.take_slots(n)
        swa = self._swa_free.take(n)
        self._swa_of.update(zip(full, swa))
        full_t = torch.tensor(full, dtype=torch.int64, device=self.device)
        swa_t = torch.tensor(swa, dtype=torch.int64, device=self.device)
        self.full_to_swa_index_mapping.index_copy_(0, full_t, swa_t)
        return full_t

    def free_swa(self, slots: Slots) -> None:
        """Release the SWA slots of full slots whose tokens left the window; all or nothing
        (a slot named twice is a ValueError, and then the map is unchanged)."""
        full = [s for s in host_slots(slots, "SWAKVCache") if s in self._swa_of]
        if not full:
            return
        self._swa_free.give_back([self._swa_of[s] for s in full])
        for s in full:
            del self._swa_of[s]
        full_t = torch.tensor(full, dtype=torch.int64, device=self.device)
        self.full_to_swa_index_mapping.index_fill_(0, full_t, 0)

    def check_free(self, slots: Slots) -> None:
        """Raise what :meth:`free` would (a slot not in use, in either pool), changing nothing."""
        slots = host_slots(slots, "SWAKVCache")
        super().check_free(slots)
        self._swa_free.check_held([self._swa_of[s] for s in slots if s in self._swa_of])

    def free(self, slots: Slots) -> None:
        """Give back full slots and their SWA slots, all or nothing."""
        slots = host_slots(slots, "SWAKVCache")
        self.check_free(slots)
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
