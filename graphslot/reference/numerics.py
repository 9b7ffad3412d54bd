"""How a graph's output is compared with eager: bit for bit where that is a fair ask.

A graph captured at a padded size computes the raw rows inside a batch of the padded
size, while eager computes the raw batch alone. On the CPU tape both run the very same
kernels, so the rows agree bit for bit -- provided the kernels are *batch-invariant*:
a row's result does not depend on how many rows share the call. Two things break that
on a CPU, and both have been seen:

* the matmul: BLAS picks kernels by the row count. The reference model's
  :class:`~graphslot.reference.model.RowLinear` computes one matrix-vector product per
  row for that reason; the probe below checks that this holds on this build.
* intra-op threads: work is split by size, so with several threads even elementwise
  kernels (RoPE on a 16-core AVX-512 host) round a row differently at another size.

So the check is ``torch.equal`` on a CPU running one intra-op thread (as
``graphslot demo`` and the test suite do) whose ``RowLinear`` is batch-invariant, and
a tight ``allclose`` elsewhere -- GPUs included, whose kernels pick tiles by shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .model import RowLinear

ATOL = RTOL = 1e-4


@functools.lru_cache(maxsize=None)
def matmul_is_batch_invariant(device_type: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether :class:`RowLinear` gives each row the same bits whatever the row count."""
    if device_type != "cpu":
        return False
    gen = torch.Generator().manual_seed(0)  # not the global RNG: a probe changes no one's seed
    linear = torch.nn.utils.skip_init(RowLinear, 64, 96, bias=False, dtype=dtype)
    x = torch.randn(32, 64, generator=gen, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen, dtype=dtype))
        full = linear(x)
        return all(torch.equal(linear(x[:m]), full[:m]) for m in (1, 2, 3, 5, 8, 17))


@dataclass(frozen=True)
class OutputCheck:
    #: ``"torch.equal"`` or ``"allclose"``, as reports print it.
    name: str
    same: Callable[[torch.Tensor, torch.Tensor], bool]

    def __call__(self, graph: torch.Tensor, eager: torch.Tensor) -> bool:
        return graph.shape == eager.shape and bool(self.same(graph, eager))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def output_check(device: torch.device | str) -> OutputCheck:
    """The comparison of graph and eager outputs on ``device`` (see the module doc)."""
    if torch.get_num_threads() == 1 and matmul_is_batch_invariant(torch.device(device).type):
        return OutputCheck("torch.equal", torch.equal)
    return OutputCheck("allclose", _close)
