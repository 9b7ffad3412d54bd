"""Graph-vs-eager output checks: bit-exact only where the matmul is batch-invariant."""

from __future__ import annotations

import pytest
import torch

from graphslot.reference import numerics
from graphslot.reference.model import RowLinear
from graphslot.reference.numerics import matmul_is_batch_invariant, output_check


@pytest.fixture
def fresh_probe():
    matmul_is_batch_invariant.cache_clear()
    yield
    matmul_is_batch_invariant.cache_clear()


def test_gpu_outputs_are_compared_with_a_tolerance():
    check = output_check("cuda")
    assert check.name == "allclose"
    x = torch.ones(2, 3)
    assert check(x, x + 1e-6) and not check(x, x + 1e-2)
    assert not check(x, torch.ones(3, 2)), "a shape mismatch is a mismatch"


def test_a_row_count_dependent_linear_downgrades_the_cpu_check(monkeypatch, fresh_probe):
    plain = RowLinear.forward
    # Like a BLAS that takes a gemv path for one row: the last bits depend on the count.
    monkeypatch.setattr(RowLinear, "forward", lambda self, x: plain(self, x) * (1 + 1e-7 * (x.shape[0] == 1)))
    assert not matmul_is_batch_invariant("cpu")
    assert output_check("cpu").name == "allclose"


def test_the_cpu_check_is_bit_exact_on_one_thread_where_the_linear_is_row_invariant(monkeypatch):
    monkeypatch.setattr(numerics, "matmul_is_batch_invariant", lambda device_type: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    check = output_check("cpu")
    assert check.name == "torch.equal"
    x = torch.ones(2, 3)
    assert check(x, x.clone()) and not check(x, x + 1e-6)
    # Several intra-op threads split work by size: rows may round differently.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert output_check("cpu").name == "allclose"


def test_the_probe_is_cached_and_leaves_the_global_rng_alone(fresh_probe):
    state = torch.get_rng_state()
    first = matmul_is_batch_invariant("cpu")
    assert torch.equal(torch.get_rng_state(), state)
    assert matmul_is_batch_invariant("cpu") is first
    assert matmul_is_batch_invariant.cache_info().hits == 1
