"""Runtime byte budgets: registries, runners and the KV pool refuse sizes they could never
serve before allocating a byte, with an error that names the slot (or the pool), the
bytes, the cap and how to raise it.

Every test that could allocate gigabytes without the check runs with ``torch.zeros``
replaced by a spy that refuses anything, so a missing check fails the test instead of
filling the machine's memory.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

import graphslot as gs
from graphslot.spec.budget import (
    DEFAULT_MAX_BUFFER_BYTES,
    BufferBudgetError,
    format_bytes,
)
from graphslot.runners.adapter import DecodeAdapter
from graphslot.runners.decode import DecodeGraphRunner
from graphslot.runners.dispatch import capture_sizes
from graphslot.api import build

MODES = ["generated", "interpreted"]

SPEC = textwrap.dedent("""
    name: budget
    params:
      wide: {type: int, default: 2}
    slots:
      - {name: ids, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: zero}
      - {name: table, shape: [max_bs, wide], dtype: int32, axis: bs, padding: zero}
""")


def spec():
    return gs.parse_spec(SPEC, path="budget.yaml")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("GRAPHSLOT_MAX_BUFFER_BYTES", raising=False)
    monkeypatch.delenv("GRAPHSLOT_MAX_KV_BYTES", raising=False)


def forbid_allocation(monkeypatch, above: int = -1):
    """``torch.zeros`` of more than ``above`` elements refuses to run (default: any):
    what the test builds must be refused before it."""
    zeros = torch.zeros

    def refuse(*args, **kwargs):
        sizes = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
        if above < 0 or math.prod(int(n) for n in sizes) > above:
            raise AssertionError(f"torch.zeros{args} ran: the byte check did not come first")
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", refuse)


@pytest.fixture
def no_allocation(monkeypatch):
    forbid_allocation(monkeypatch)


# --- registries ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_attackers_registry_is_refused_before_anything_is_allocated(mode, no_allocation):
    with pytest.raises(BufferBudgetError) as info:
        gs.build_registry("decode", max_bs=10**9, max_num_tokens=10**9, impl=mode, device="cpu")
    assert str(info.value) == (
        "spec 'decode': its buffers would take 72000000008 bytes (67.1 GiB) at max_bs=1000000000, "
        "max_num_tokens=1000000000, over the cap of 4294967296 bytes (4.0 GiB) (the default); the largest is "
        "slot 'mrope_positions', 24000000000 bytes (22.4 GiB). Nothing was allocated. Lower the capacities, or "
        "raise the cap: max_bytes=N (the runner configs) or the environment variable "
        "GRAPHSLOT_MAX_BUFFER_BYTES=N")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("mode", MODES)
def test_the_cap_is_inclusive(mode):
    # ids: 8 x 8 bytes; table: 4 x 2 x 4 bytes; 96 in all.
    reg = build(spec(), max_bs=4, max_num_tokens=8, impl=mode, max_bytes=96, device="cpu")
    assert reg.nbytes == 96
    with pytest.raises(BufferBudgetError) as info:
        build(spec(), max_bs=4, max_num_tokens=8, impl=mode, max_bytes=95, device="cpu")
    assert str(info.value).startswith(
        "spec 'budget': its buffers would take 96 bytes at max_bs=4, max_num_tokens=8, over the cap of 95 bytes "
        "(max_bytes); the largest is slot 'ids', 64 bytes. Nothing was allocated.")


@pytest.mark.parametrize("mode", MODES)
def test_disabled_slots_take_no_bytes(mode):
    text = SPEC + ("  - {name: unused, shape: [max_bs, 1000], dtype: int64, axis: bs, padding: zero, "
                   "enabled_if: false}\n")
    reg = build(gs.parse_spec(text, path="budget.yaml"), max_bs=4, max_num_tokens=8, impl=mode, max_bytes=96,
                device="cpu")
    assert not reg.has_slot("unused")


@pytest.mark.parametrize("mode", MODES)
def test_the_environment_variable_sets_the_cap_and_max_bytes_overrides_it(mode, monkeypatch):
    monkeypatch.setenv("GRAPHSLOT_MAX_BUFFER_BYTES", " 95 ")
    with pytest.raises(BufferBudgetError, match=r"over the cap of 95 bytes \(GRAPHSLOT_MAX_BUFFER_BYTES\); "):
        gs.build_registry(spec(), max_bs=4, max_num_tokens=8, impl=mode, device="cpu")
    assert build(spec(), max_bs=4, max_num_tokens=8, impl=mode, max_bytes=96, device="cpu").nbytes == 96
    monkeypatch.setenv("GRAPHSLOT_MAX_BUFFER_BYTES", "")  # empty: unset
    assert gs.build_registry(spec(), max_bs=4, max_num_tokens=8, impl=mode, device="cpu").nbytes == 96


@pytest.mark.parametrize("value", ["4GiB", "-1", "0", "1e9", "0x10", "１２"])
def test_an_invalid_environment_value_is_an_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("GRAPHSLOT_MAX_BUFFER_BYTES", value)
    with pytest.raises(ValueError) as info:
        gs.build_registry(spec(), max_bs=4, max_num_tokens=8, device="cpu")
    assert str(info.value) == (f"GRAPHSLOT_MAX_BUFFER_BYTES={value!r} is not a byte count: set it to a positive "
                               "integer number of bytes (e.g. 8589934592 for 8 GiB), or unset it")


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "4096"])
def test_max_bytes_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=r"^max_bytes must be a positive int \(a number of bytes\), got "):
        build(spec(), max_bs=4, max_num_tokens=8, max_bytes=value, device="cpu")


def test_the_default_cap_is_4_gib_and_refuses_one_byte_more(no_allocation):
    assert DEFAULT_MAX_BUFFER_BYTES == 4 << 30
    one_byte = textwrap.dedent("""
        name: bytes
        slots:
          - {name: raw, shape: [max_bs], dtype: uint8, axis: bs, padding: zero}
    """)
    with pytest.raises(BufferBudgetError, match=r"over the cap of 4294967296 bytes \(4\.0 GiB\) \(the default\)"):
        gs.build_registry(gs.parse_spec(one_byte, path="bytes.yaml"), max_bs=(4 << 30) + 1, max_num_tokens=1,
                          device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_torch_cannot_size_is_refused_naming_its_slot_whatever_the_cap(mode, no_allocation):
    with pytest.raises(BufferBudgetError) as info:
        build(spec(), max_bs=2**40, max_num_tokens=8, impl=mode, params={"wide": 2**40}, max_bytes=2**100, device="cpu")
    assert str(info.value) == (
        f"spec 'budget', slot 'table': its buffer would take {2**80 * 4} bytes at max_bs={2**40}, max_num_tokens=8, "
        "beyond what torch can allocate (under 2**63 bytes); lower the capacities or the params its shape is made of")


@pytest.mark.parametrize("value", [2.5, True, "8", None])
def test_capacities_must_be_ints(value):
    with pytest.raises(ValueError, match=r"^max_bs must be an int, got "):
        gs.build_registry(spec(), max_bs=value, max_num_tokens=8, device="cpu")
    with pytest.raises(ValueError, match=r"^max_num_tokens must be an int, got "):
        gs.build_registry(spec(), max_bs=4, max_num_tokens=value, device="cpu")


def test_an_allocation_that_fails_names_the_slot_in_a_note(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "zeros", out_of_memory)
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        gs.build_registry(spec(), max_bs=4, max_num_tokens=8, impl="interpreted", device="cpu")
    assert info.value.__notes__ == [("graphslot: while allocating the buffer of slot 'ids' (shape [8], "
                                     "torch.int64, on cpu)")]


def test_format_bytes():
    assert format_bytes(0) == "0 bytes"
    assert format_bytes(1023) == "1023 bytes"
    assert format_bytes(1536) == "1536 bytes (1.5 KiB)"
    assert format_bytes(5 << 30) == "5368709120 bytes (5.0 GiB)"
    assert format_bytes(2**70) == f"{2**70} bytes (1024.0 EiB)"


# --- runners ------------------------------------------------------------------------------------


class Unbuilt(DecodeAdapter):
    """An adapter that gets no further than the registry's byte check."""

    device = torch.device("cpu")

    def forward(self, *args):
        raise AssertionError("the byte check comes first")

    forward_eager = make_dummy_batch = init_capture_metadata = init_replay_metadata = forward


def test_a_decode_runner_with_a_huge_max_bs_is_refused_before_allocating(no_allocation):
    assert len(capture_sizes(10**9)) == 1403  # bounded: every 8th size would be 125 million
    with pytest.raises(BufferBudgetError, match=r"^spec 'decode': its buffers would take .* at max_bs=1000000000, "):
        DecodeGraphRunner(Unbuilt(), max_bs=10**9)


def test_a_decode_runners_config_carries_the_cap_to_its_registry(no_allocation):
    with pytest.raises(BufferBudgetError, match=r"at max_bs=64, max_num_tokens=64, over the cap of 100 bytes "
                                                r"\(max_bytes\); "):
        DecodeGraphRunner(Unbuilt(), max_bs=64, max_bytes=100)


# --- the transformers KV pool -------------------------------------------------------------------


def test_a_paged_cache_over_its_cap_is_refused_naming_requests_context_and_bytes(monkeypatch):
    pytest.importorskip("transformers")
    from graphslot.integrations.transformers import PagedCache, tiny_config

    config = tiny_config("llama")  # 2 layers, 2 KV heads, head_dim 16
    forbid_allocation(monkeypatch)
    with pytest.raises(BufferBudgetError) as info:
        PagedCache(config, max_requests=100, max_context_len=64, max_bytes=10**6)
    assert str(info.value) == (
        "PagedCache: max_requests=100 x max_context_len=64 need a KV pool of 6401 slots x 2 layers x 2 KV heads x "
        "head_dim 16 x 2 (K and V) x 4 bytes = 3277312 bytes (3.1 MiB), plus 51712 bytes (50.5 KiB) of request "
        "table: over the cap of 1000000 bytes (976.6 KiB) (max_bytes). Nothing was allocated. Lower "
        "max_requests (ContinuousBatcher's max_bs) or max_context_len, or raise the cap: PagedCache(max_bytes=N) "
        "or the environment variable GRAPHSLOT_MAX_KV_BYTES=N")
    monkeypatch.setenv("GRAPHSLOT_MAX_KV_BYTES", "1000")
    with pytest.raises(BufferBudgetError, match=r"over the cap of 1000 bytes \(GRAPHSLOT_MAX_KV_BYTES\)"):
        PagedCache(config, max_requests=1, max_context_len=8)
    monkeypatch.setenv("GRAPHSLOT_MAX_KV_BYTES", "lots")
    with pytest.raises(ValueError, match=r"^GRAPHSLOT_MAX_KV_BYTES='lots' is not a byte count"):
        PagedCache(config, max_requests=1, max_context_len=8)


def test_a_paged_cache_within_its_cap_is_built():
    pytest.importorskip("transformers")
    from graphslot.integrations.transformers import PagedCache, tiny_config

    # 17 slots x 2 x 2 x 16 x 2 x 4 bytes = 8704, plus 3 x 8 x 8 = 192 of request table: 8896 exactly.
    cache = PagedCache(tiny_config("llama"), max_requests=2, max_context_len=8, max_bytes=8896)
    pool = [t for t in cache.static_tensors() if t is not cache.masks.kv_positions]
    assert sum(t.numel() * t.element_size() for t in pool) == 8896


def test_continuous_batcher_with_a_huge_batch_is_refused_by_its_kv_pool(monkeypatch):
    pytest.importorskip("transformers")
    from graphslot.integrations.transformers import ContinuousBatcher, tiny_model

    model = tiny_model("llama")
    forbid_allocation(monkeypatch, above=4096)  # the geometry probe's one token runs; nothing sized by the batch
    # a request table of 8 * 10**15 bytes: more than any machine's memory, the default KV budget.
    with pytest.raises(BufferBudgetError, match=r"^ContinuousBatcher: a KV budget of \d+ bytes .* holds 0 token "
                                                r"slots of 512 bytes after the request table \(1000001 rows .* "
                                                r"max_context_len=1000000000 x 8 bytes = 8000008000000000 bytes "):
        ContinuousBatcher(model, max_bs=10**6, max_context_len=10**9)
