"""The paged KV pool and the request-to-token table (``graphslot.kvpool``): what the
transformers integration and the reference model share, outside the demo package."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from graphslot.kvpool import FreeList, PagedKVCache, ReqToTokenPool, host_slots
from graphslot.reference.memory import SWAKVCache


def test_a_free_list_never_hands_out_the_dummy_index_0():
    free = FreeList(4, "pool")
    assert free.take(2) == [1, 2] and free.available == 1
    free.give_back([1])
    assert free.take(2) == [3, 1]
    with pytest.raises(RuntimeError, match=r"^pool exhausted: asked for 1, 0 free$"):
        free.take(1)
    with pytest.raises(ValueError, match=r"^pool: cannot free index 0$"):
        free.give_back([0])
    with pytest.raises(ValueError, match=r"^pool needs size >= 2 \(index 0 is reserved\), got 1$"):
        FreeList(1, "pool")


def test_host_slots_reads_a_tensor_or_a_sequence():
    assert host_slots(torch.tensor([3, 1])) == [3, 1] and host_slots((2, 5)) == [2, 5]


def test_the_req_to_token_table_keeps_row_0_for_padded_rows():
    pool = ReqToTokenPool(3, 4)
    rows = pool.alloc(2)
    assert rows == [1, 2] and pool.available == 0
    pool.write(1, 1, torch.tensor([7, 8]))
    pool.write_tokens(torch.tensor([2]), torch.tensor([3]), torch.tensor([9]))
    assert pool.req_to_token.tolist() == [[0, 0, 0, 0], [0, 7, 8, 0], [0, 0, 0, 9]]
    pool.free(1)
    pool.free(torch.tensor([2]))
    assert pool.available == 2


def test_the_kv_pool_allocates_on_the_host_and_writes_without_syncs():
    kv = PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, size=4)
    assert [b.shape for b in kv.k_buffer] == [torch.Size([4, 1, 2])] * 2 and kv.layer_size(1) == 4
    loc = kv.alloc(2)
    assert loc.tolist() == [1, 2] and loc.dtype == torch.int64 and kv.available == 1
    kv.set_kv(1, loc.int(), torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0))
    assert kv.k_buffer[1][1:3].eq(1).all() and kv.v_buffer[1][1:3].eq(2).all() and kv.k_buffer[0].eq(0).all()
    kv.free(loc)
    assert kv.take_slots(3) == [3, 1, 2]
    with pytest.raises(RuntimeError, match=r"^PagedKVCache exhausted: asked for 1, 0 free$"):
        kv.alloc(1)


def test_the_sliding_window_pool_builds_on_the_shared_one():
    kv = SWAKVCache(num_layers=2, num_kv_heads=1, head_dim=2, size=6, swa_size=3, swa_layers=[0])
    assert [b.shape[0] for b in kv.k_buffer] == [3, 6]
    full = kv.alloc(2)
    assert full.tolist() == [1, 2] and kv.translate_to_swa(full).tolist() == [1, 2]
    with pytest.raises(RuntimeError, match=r"^SWAKVCache \(swa\) exhausted: asked for 1, 0 free$"):
        kv.alloc(1)
    kv.free(full)
    assert kv.available == 5 and kv.swa_available == 2


def test_the_hf_integration_uses_the_shared_pool():
    hf = pytest.importorskip("graphslot.integrations.transformers")  # the `hf` extra
    cache = hf.PagedCache(hf.tiny_config("llama"), max_requests=1, max_context_len=4)
    assert isinstance(cache.pool, PagedKVCache) and type(cache.req_to_token_pool) is ReqToTokenPool


def test_taking_a_slot_costs_the_same_from_a_pool_64_times_larger():
    """A pool sized by memory holds millions of slots and the engine takes one per request
    every decode step: a take must not copy the free list (it did, O(pool size))."""
    import time

    def seconds(size):
        free = FreeList(size, "pool")
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                free.give_back(free.take(1))
            best = min(best, time.perf_counter() - start)
        return best

    small, large = seconds(1 << 14), seconds(1 << 20)
    assert large < 8 * small, (small, large)


def test_a_free_list_holds_no_python_object_per_never_used_slot():
    """A pool sized by memory (or a CLI's --max-bs) has millions of slots: the free list
    of slots never handed out is a range, not a deque of them (64 M ints took 2.3 GB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        free = FreeList(1 << 20, "pool")
        took = free.take(3)
        used = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took == [1, 2, 3] and free.available == (1 << 20) - 4
    assert used < 64 << 10, used  # a deque of 2**20 ints: about 37 MB
    assert FreeList(1 << 62, "pool").available == (1 << 62) - 1


@settings(max_examples=200)
@given(size=st.integers(2, 12), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_a_free_list_hands_out_what_a_first_in_first_out_queue_of_every_index_would(size, ops):
    """Differential: the fresh range, then what came back, in the order it came back."""
    from collections import deque

    free, model, held = FreeList(size, "pool"), deque(range(1, size)), []
    for take, n in ops:
        if take and n <= len(model):
            got = free.take(n)
            assert got == [model.popleft() for _ in range(n)]
            held += got
        elif take:
            with pytest.raises(RuntimeError, match=f"^pool exhausted: asked for {n}, {len(model)} free$"):
                free.take(n)
        else:
            back, held = held[:n], held[n:]
            free.give_back(back)
            model.extend(back)
        assert free.available == len(model)


def test_a_free_list_refuses_an_index_freed_twice_or_never_handed_out():
    """A second free put the index in the queue twice: ``available`` grew past the pool and
    the same index was handed out to two owners."""
    free = FreeList(5, "pool")
    took = free.take(2)
    free.give_back(took)
    with pytest.raises(ValueError, match=r"^pool: cannot free index 1: it is not in use \(freed already, or never "
                                         r"handed out\)"):
        free.give_back(took)
    with pytest.raises(ValueError, match=r"^pool: cannot free index 4: it is not in use"):
        free.give_back([4])
    held = free.take(2)
    with pytest.raises(ValueError, match=r"^pool: cannot free index 3: it is not in use"):
        free.give_back([held[0], 3])  # all or nothing: held[0] stays handed out
    with pytest.raises(ValueError, match=f"^pool: cannot free index {held[0]}: it is not in use"):
        free.give_back([held[0], held[0]])
    assert free.available == 2
    assert sorted(free.take(2)) == [1, 2] and free.available == 0


def test_the_paged_cache_refuses_a_request_freed_twice_and_frees_nothing_then():
    hf = pytest.importorskip("graphslot.integrations.transformers")  # the `hf` extra
    cache = hf.PagedCache(hf.tiny_config("llama"), max_requests=2, max_context_len=4)
    row = cache.alloc_request()
    slots = cache.alloc_tokens(row, 0, 2)
    slots_free, rows_free = cache.available_slots, cache.available_requests
    cache.free_request(row, slots)
    with pytest.raises(ValueError, match=rf"^PagedCache.free_request\(row={row}\): ReqToTokenPool: cannot free "
                                         rf"index {row}: it is not in use .*; nothing was freed$"):
        cache.free_request(row, slots)
    assert (cache.available_slots, cache.available_requests) == (slots_free + 2, rows_free + 1)
    other = cache.alloc_request()
    with pytest.raises(ValueError, match=r"PagedKVCache: cannot free index 7: it is not in use"):
        cache.free_request(other, [7])  # a slot never handed out: the row stays in use
    assert cache.available_requests == rows_free
    assert {cache.alloc_request()} | {other} == {1, 2}


def test_the_swa_cache_frees_all_or_nothing():
    """``SWAKVCache.free`` gave the SWA slots back (and dropped them from its map) before the
    full pool could refuse a slot: a refused free left SWA slots freed under slots still in
    use, and a slot named twice popped the map once, then failed with a bare KeyError."""
    kv = SWAKVCache(num_layers=2, num_kv_heads=1, head_dim=2, size=6, swa_size=4, swa_layers=[0])
    full = kv.alloc(2).tolist()
    mapping = kv.full_to_swa_index_mapping.clone()
    free_before = (kv.available, kv.swa_available)
    with pytest.raises(ValueError, match=r"^PagedKVCache: cannot free index 5: it is not in use"):
        kv.free([full[0], 5])  # 5 was never handed out
    with pytest.raises(ValueError, match=rf"^PagedKVCache: cannot free index {full[0]}: it is not in use"):
        kv.free([full[0], full[0]])
    with pytest.raises(ValueError, match=rf"^SWAKVCache \(swa\): cannot free index {mapping[full[1]]}: it is not in"):
        kv.free_swa([full[1], full[1]])
    assert (kv.available, kv.swa_available) == free_before
    assert torch.equal(kv.full_to_swa_index_mapping, mapping)
    kv.free_swa([full[0]])  # its window passed: the full slot stays in use
    assert (kv.available, kv.swa_available) == (free_before[0], free_before[1] + 1)
    kv.free(full)
    assert (kv.available, kv.swa_available) == (5, 3)
    assert not kv.full_to_swa_index_mapping.any()


def test_an_index_that_is_no_int_is_refused_naming_it_and_a_numpy_or_0d_row_is_an_index():
    """``int()`` cleaned what was given: a slot ``2.9`` freed slot 2, ``True`` freed row 1, a
    float tensor of slots was truncated; a numpy or 0-d tensor row failed with "'numpy.int64'
    object is not iterable"."""
    rows = ReqToTokenPool(4, 8)
    kv = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, size=6)
    slots = kv.alloc(3)
    held = (rows.alloc(2), rows.available, kv.available)
    for bad, shown in [([2.9], "2.9 (float)"), ([True], "True (bool)"), (torch.tensor([1.0]), "torch.float32")]:
        with pytest.raises(TypeError, match=rf"^PagedKVCache: cannot free {re.escape(shown)}: an index is an int"):
            kv.free(bad)
    with pytest.raises(TypeError, match=r"^ReqToTokenPool: cannot free True \(bool\): an index is an int"):
        rows.free(True)
    assert (rows.available, kv.available) == held[1:]
    rows.free(np.int64(held[0][0]))
    rows.free(torch.tensor(held[0][1]))
    kv.free(np.array(slots.tolist()))
    assert (rows.available, kv.available) == (3, 5)
