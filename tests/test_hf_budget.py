"""ContinuousBatcher's KV pool comes from a byte budget, and ``max_context_len`` from the
pool: ``min(max_position_embeddings, num_slots - 1)``, not the model's position count.
Requests are admitted while the pool can hold all their tokens, so a long-context model
with a small pool serves its requests one after another instead of failing mid-way."""

from __future__ import annotations

import re

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.integrations.transformers import (  # noqa: E402
    ContinuousBatcher,
    PagedCache,
    budget,
    kv_geometry,
    tiny_model,
)
from graphslot.integrations.transformers.geometry import bytes_per_slot  # noqa: E402
from graphslot.spec.budget import BufferBudgetError  # noqa: E402

#: tiny Llama: 2 layers x 2 KV heads x head_dim 16 x (K, V) x 4 bytes
PER_TOKEN = 2 * 2 * 16 * 2 * 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("family, per_slot", [
    ("llama", PER_TOKEN),
    ("falcon-mqa", 2 * (1 * 16 + 1 * 16) * 4),  # one KV head, whatever the config's 4 heads suggest
    ("deepseek_v3", 2 * (1 * 16 + 1 * 8) * 4),  # MLA: the latent (16) and the rope part (8)
])
def test_a_slot_costs_what_the_pool_allocates_for_what_the_model_writes(family, per_slot):
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(family, dtype=dtype)
        geometry = kv_geometry(model)
        cache = PagedCache(model.config, max_requests=1, max_context_len=4, num_slots=10, dtype=dtype,
                           geometry=geometry)
        pool = sum(t.numel() * t.element_size() for t in cache.pool.k_buffer + cache.pool.v_buffer)
        assert bytes_per_slot(geometry, dtype) * 10 == pool == per_slot * dtype.itemsize // 4 * 10


def test_the_budget_is_spent_on_the_probed_geometry_not_the_configs_guess():
    model = tiny_model("falcon-mqa")  # the config names 4 heads; every layer writes 1
    per_slot, table = 2 * (16 + 16) * 4, 3 * 8
    engine = ContinuousBatcher(model, max_bs=2, kv_cache_bytes=41 * per_slot + 40 * table, backend="cpu")
    assert engine.geometry == kv_geometry(model) and engine.cache.geometry == engine.geometry
    assert (engine.kv_budget.num_slots, engine.kv_budget.max_context_len) == (41, 40)
    assert [tuple(k.shape) for k in engine.cache.pool.k_buffer] == [(41, 1, 16)] * 2


def test_the_context_is_what_the_budget_holds(model):
    table = (2 + 1) * 8  # request-table bytes per position, 2 rows and the dummy
    engine = ContinuousBatcher(model, max_bs=2, kv_cache_bytes=21 * PER_TOKEN + 20 * table, backend="cpu")
    assert engine.kv_budget == (21, 20, 21 * PER_TOKEN + 20 * table, "kv_cache_bytes")
    assert (engine.cache.max_context_len, engine.cache.pool.size) == (20, 21)
    roomy = ContinuousBatcher(model, max_bs=2, kv_cache_bytes=10**6, backend="cpu")
    # capped by the model's 64 positions, and by every row full
    assert (roomy.cache.max_context_len, roomy.cache.pool.size) == (64, 2 * 64 + 1)


def test_a_128k_position_model_gets_the_context_its_budget_holds():
    model = tiny_model("llama", max_position_embeddings=131072)
    engine = ContinuousBatcher(model, max_bs=4, kv_cache_bytes=2**20, backend="cpu", capture_bs=[4])
    context, slots = engine.cache.max_context_len, engine.cache.pool.size
    assert context == (2**20 - PER_TOKEN) // (PER_TOKEN + 5 * 8) == 1898 and slots == context + 1
    pool = sum(t.numel() * t.element_size() for t in engine.cache.pool.k_buffer + engine.cache.pool.v_buffer)
    table = engine.cache.req_to_token_pool.req_to_token
    assert pool + table.numel() * table.element_size() <= 2**20  # not 4 rows x 131072 positions
    req = engine.add_request(list(range(1, 100)), 3)
    while not engine.done:
        engine.step()
    assert len(req.output) == 3


def test_the_default_budget_is_a_share_of_free_memory_under_the_env_cap(model, monkeypatch):
    monkeypatch.delenv(budget.MAX_KV_BYTES_ENV, raising=False)
    monkeypatch.setattr(budget, "free_memory", lambda device: 40 * 2**20)
    assert budget.kv_budget(torch.device("cpu"), None) == (
        10 * 2**20, "0.25 of the 41943040 bytes (40.0 MiB) free on cpu")
    assert budget.KV_MEMORY_FRACTION == {"cuda": 0.6, "cpu": 0.25}
    monkeypatch.setenv(budget.MAX_KV_BYTES_ENV, str(17 * PER_TOKEN + 16 * 24))
    engine = ContinuousBatcher(model, max_bs=2, backend="cpu")
    assert engine.kv_budget == (17, 16, 17 * PER_TOKEN + 16 * 24, budget.MAX_KV_BYTES_ENV)
    assert budget.kv_budget(torch.device("cpu"), 5000) == (5000, "kv_cache_bytes")
    monkeypatch.setattr(budget, "free_memory", lambda device: None)
    monkeypatch.delenv(budget.MAX_KV_BYTES_ENV)
    with pytest.raises(ValueError) as info:
        ContinuousBatcher(model, max_bs=2, backend="cpu")
    assert str(info.value) == ("ContinuousBatcher: the free memory of cpu is unknown, so there is no default KV "
                               "budget: pass kv_cache_bytes=N or max_context_len, or set GRAPHSLOT_MAX_KV_BYTES=N")
    # what the message offers: a max_context_len alone sizes the pool with every row full
    engine = ContinuousBatcher(model, max_bs=2, max_context_len=16, backend="cpu")
    assert engine.kv_budget[:2] == (2 * 16 + 1, 16) and engine.cache.pool.size == 33
    assert engine.kv_budget.origin == "every row full (no budget: the free memory is unknown)"


def test_free_memory_is_known_on_the_cpu():
    free = budget.free_memory(torch.device("cpu"))
    assert isinstance(free, int) and free > 0
    assert budget.free_memory(torch.device("meta")) is None


def test_requests_wait_until_the_pool_holds_all_their_tokens(model):
    small = ContinuousBatcher(model, max_bs=2, kv_cache_bytes=21 * PER_TOKEN + 20 * 24, backend="cpu",
                              eos_token_id=())
    roomy = ContinuousBatcher(model, max_bs=2, max_context_len=20, backend="cpu", eos_token_id=())
    runs = []
    for engine in (small, roomy):
        a = engine.add_request([5, 17, 3, 99, 42], 10)  # holds 14 slots at most
        b = engine.add_request([7, 7, 1, 2], 8)  # 11: both do not fit 20 slots
        waited = 0
        while not engine.done:
            engine.step()
            waited += bool(engine.waiting)
            assert engine.cache.available_slots >= sum(r.need - r.cached for r in engine.running)
        runs.append(([a.output, b.output], waited))
    (small_out, small_waited), (roomy_out, roomy_waited) = runs
    assert small_out == roomy_out and [len(o) for o in small_out] == [10, 8]
    assert small_waited == 9 and roomy_waited == 0  # b waited for a's 9 steps


def test_a_context_the_budget_cannot_hold_is_refused_before_allocating(model):
    with pytest.raises(BufferBudgetError) as info:
        ContinuousBatcher(model, max_bs=2, max_context_len=30, kv_cache_bytes=21 * PER_TOKEN + 20 * 24,
                          backend="cpu")
    assert str(info.value) == (
        "ContinuousBatcher: a KV budget of 11232 bytes (11.0 KiB) (kv_cache_bytes) holds 20 token slots of 512 bytes "
        "after the request table (3 rows (max_requests=2 and a dummy) x max_context_len=30 x 8 bytes = 720 bytes), "
        "fewer than "
        "max_context_len + 1 = 31, so a request of max_context_len could never be admitted. Nothing was allocated. "
        "Raise the budget (kv_cache_bytes=N, or GRAPHSLOT_MAX_KV_BYTES=N) or lower max_context_len or max_bs")
    with pytest.raises(ValueError, match=r"^ContinuousBatcher: kv_cache_bytes must be an int >= 1, got 0$"):
        ContinuousBatcher(model, max_bs=2, kv_cache_bytes=0)


GRAPHS_PROBE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # the batcher reached 5 GB before it was checked
from graphslot.integrations.transformers import ContinuousBatcher, budget, tiny_model
budget.free_memory = lambda device: 2 << 30  # the same on any machine
try:
    ContinuousBatcher(tiny_model("llama"), max_bs=10**6, backend="cpu")
except budget.BufferBudgetError as exc:
    print(exc)
"""


def test_a_max_bs_whose_graphs_cannot_fit_is_refused_naming_it_before_allocating(tmp_path):
    """max_bs=10**6 with a 64 MiB KV budget fits the pool (a context of 8), but the decode
    graphs of up to a million rows cannot fit the free memory: refused, naming max_bs, the
    graphs, the sizes and the budget, in a process that may not take 4 GiB."""
    import os
    import subprocess
    import sys

    env = {**os.environ, budget.MAX_KV_BYTES_ENV: str(64 << 20)}
    done = subprocess.run([sys.executable, "-c", GRAPHS_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    message = done.stdout.strip()
    assert re.fullmatch(
        r"ContinuousBatcher: max_bs=1000000 needs about \d+ bytes \(\d+\.\d [GT]iB\) for the decode graphs: \d+ graphs "
        r"of up to 1000000 rows and contexts up to 8 positions, at \d+ bytes per row \(the tensors one token's "
        r"forward makes\) and 512 bytes per row and position \(its K and V\), each graph keeping its own \(the cpu "
        r"tape\); the free memory is 2147483648 bytes \(2\.0 GiB\) on cpu, 2080374784 bytes \(1\.9 GiB\) of it "
        r"left after the KV budget of 67108864 bytes \(64\.0 MiB\) \(GRAPHSLOT_MAX_KV_BYTES\)\. Nothing was "
        r"allocated\. Lower max_bs \(or max_requests, or the captured sizes: capture_bs, context_buckets\)",
        message), message


def test_graphs_sharing_a_pool_need_at_least_the_largest_one(monkeypatch):
    monkeypatch.setattr(budget, "free_memory", lambda device: 10_000)
    kv = budget.PoolSize(9, 8, 2_000, "kv_cache_bytes")
    shared = {"max_bs": 8, "sizes": [8, 4], "contexts": [8], "per_row": 1_000, "per_position": 100}
    budget.check_graph_memory(torch.device("cpu"), kv, kept=False, **shared)  # 8 rows x 1000 bytes: fits 8000
    with pytest.raises(BufferBudgetError) as info:
        budget.check_graph_memory(torch.device("cpu"), kv, kept=True, **shared)  # 12 rows x (1000 + 7 x 100)
    assert str(info.value) == (
        "ContinuousBatcher: max_bs=8 needs about 20400 bytes (19.9 KiB) for the decode graphs: 2 graphs of up to 8 "
        "rows and contexts up to 8 positions, at 1000 bytes per row (the tensors one token's forward makes) and 100 "
        "bytes per row and position (its K and V), each graph keeping its own (the cpu tape); the free memory is "
        "10000 bytes (9.8 KiB) on cpu, 8000 bytes (7.8 KiB) of it left after the KV budget of 2000 bytes (2.0 KiB) "
        "(kv_cache_bytes). Nothing was allocated. Lower max_bs (or max_requests, or the captured sizes: capture_bs, "
        "context_buckets)")
    with pytest.raises(BufferBudgetError, match="sharing one pool"):
        budget.check_graph_memory(torch.device("cpu"), kv, kept=False, **{**shared, "max_bs": 9, "sizes": [9]})


def test_allocations_counts_new_storages_only():
    x = torch.zeros(10)
    with budget.Allocations() as made:
        y = x + 1  # new: 40 bytes
        y.view(2, 5)  # a view: nothing new
        y.add_(1)  # in place: nothing new
        torch.ones(3, dtype=torch.float64)  # new: 24 bytes
    assert made.bytes == 64
