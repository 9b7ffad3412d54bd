"""Capture-size planning: which batch sizes to capture, given the sizes a runner served.

A raw batch of ``s`` rows runs the graph of the smallest captured size ``>= s``; the
rows between are padding, computed and thrown away. Given a histogram
``{raw_size: steps}`` and a budget (a number of graphs, or bytes of graph memory under
a per-graph memory model), :func:`plan_capture_sizes` picks the sizes that minimise the
expected padded work ``sum(steps * cost(padded_size))`` (``cost(s) = s`` by default:
padded rows), always capturing the largest size needed so every served size fits.

It is an optimal 1-D partition of the K distinct sizes into at most N buckets, each
padded to its largest size (an optimal plan only captures served sizes and the cap).
Solved exactly by dynamic programming:

* a graph budget: ``O(N * K log K)``. The bucket cost ``cost(s_j) * steps(i..j)`` is
  Monge for any non-decreasing ``cost``, so the best split point is monotone in ``j``
  and each of the N layers is solved by divide and conquer instead of ``O(K^2)``;
* a memory budget: ``O(K^2 * U)`` over the budget cut in ``U`` units (at most 1024),
  each graph's memory rounded *up* to whole units: the plan never exceeds the budget
  and is optimal for the rounded model (``Plan.memory_unit`` says the rounding).

Pure Python, no torch: ``graphslot plan-sizes`` uses it without the runtime.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .histogram import MAX_BATCH_SIZE, MAX_DISTINCT_SIZES, BatchSizeHistogram

CostFn = Callable[[int], float]
#: A graph's memory in bytes: a callable of its size, or ``(a, b)`` for ``a + b * size``.
MemoryModel = Union[CostFn, Tuple[float, float]]
#: Bounds that keep a plan within seconds: graphs (N), distinct sizes under a memory
#: budget (K), and the work K^2 * U a memory-budget plan may do (U is chosen within it).
MAX_GRAPHS = 512
MAX_MEMORY_PLAN_SIZES = 512
MEMORY_DP_WORK = 1 << 23
MIN_MEMORY_UNITS = 64
MAX_MEMORY_UNITS = 1024


#: The default schedule takes every 8th size up to here (sglang's), then 64 sizes per
#: doubling: the step doubles with the size, so a padded batch stays within 1.6% of its
#: raw size and a ladder has O(log max_bs) sizes (1403 for max_bs = 10**9).
LADDER_FINE_UNTIL = 1024


def default_capture_schedule(max_bs: int) -> List[int]:
    """sglang's schedule: 1, 2, 4, 8, then every 8th size up to ``max_bs`` (above
    ``LADDER_FINE_UNTIL`` the step doubles with each doubling of the size)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs]
    bs = 16
    step = 8
    while bs <= max_bs:
        sizes.append(bs)
        if bs >= LADDER_FINE_UNTIL and bs & (bs - 1) == 0:  # a power of two: the next octave
            step = bs // 64
        bs += step
    return sizes


def default_ladder(max_bs: int) -> List[int]:
    """What a runner captures by default: the schedule, and the cap itself (ascending)."""
    sizes = default_capture_schedule(max_bs)
    return sizes + [max_bs] if max_bs >= 1 and max_bs not in sizes else sizes


def _rows(size: int) -> float:
    return size


@dataclass(frozen=True)
class Plan:
    """Capture sizes and what they cost on a histogram. Iterates over its sizes, so
    ``DecodeRunnerConfig(capture_bs=plan, max_bs=plan.max_bs)`` captures them;
    ``DecodeRunnerConfig(**plan.runner_kwargs())`` says the same."""

    sizes: Tuple[int, ...]  # ascending
    steps: int  # steps in the histogram
    replayed_steps: int  # steps whose size fits the largest graph
    rows: int  # real rows of the replayed steps
    padded_rows: int  # padding rows of the replayed steps
    work: float  # sum(steps * cost(padded size)) over replayed steps
    eager: Dict[int, int] = field(default_factory=dict)  # sizes above max_bs: their steps
    memory: Optional[float] = None  # sum of the graphs' memory, when a model was given
    memory_unit: Optional[float] = None  # memory-budget plans: the rounding unit

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    @property
    def padded_rows_per_step(self) -> float:
        return self.padded_rows / self.replayed_steps if self.replayed_steps else 0.0

    @property
    def padding_fraction(self) -> float:
        """Padding rows over all rows the replayed graphs computed."""
        total = self.rows + self.padded_rows
        return self.padded_rows / total if total else 0.0

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def runner_kwargs(self) -> Dict[str, Any]:
        """``DecodeRunnerConfig`` fields that capture exactly these sizes."""
        return {"max_bs": self.max_bs, "capture_bs": list(self.sizes)}

    def to_json(self) -> Dict[str, Any]:
        return {"sizes": list(self.sizes), "graphs": len(self.sizes), "max_bs": self.max_bs,
                "padded_rows_per_step": self.padded_rows_per_step, "padding_fraction": self.padding_fraction,
                "padded_rows": self.padded_rows, "rows": self.rows, "work": self.work,
                "replayed_steps": self.replayed_steps,
                "eager": {str(bs): n for bs, n in sorted(self.eager.items())},
                "memory": self.memory, "memory_unit": self.memory_unit}


def _counts(histogram: Union[BatchSizeHistogram, Mapping[int, int]]) -> Dict[int, int]:
    counts = histogram.counts if isinstance(histogram, BatchSizeHistogram) else histogram
    for bs, n in counts.items():
        if isinstance(bs, bool) or not isinstance(bs, int) or not 1 <= bs <= MAX_BATCH_SIZE:
            raise ValueError(f"a batch size must be an integer in [1, {MAX_BATCH_SIZE}], got {bs!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"the count of batch size {bs} must be a non-negative integer, got {n!r}")
    if len(counts) > MAX_DISTINCT_SIZES:
        raise ValueError(f"{len(counts)} distinct batch sizes; at most {MAX_DISTINCT_SIZES}")
    return {bs: n for bs, n in sorted(counts.items()) if n}


def _memory_fn(model: Optional[MemoryModel]) -> Optional[CostFn]:
    if model is None or callable(model):
        return model
    a, b = model
    return lambda size: a + b * size


def evaluate(sizes: Sequence[int], histogram: Union[BatchSizeHistogram, Mapping[int, int]],
             cost: Optional[CostFn] = None, memory: Optional[MemoryModel] = None,
             memory_unit: Optional[float] = None) -> Plan:
    """What capturing ``sizes`` costs on ``histogram``; larger raw sizes run eager."""
    cost = cost or _rows
    mem = _memory_fn(memory)
    ascending = sorted(set(sizes))
    if not ascending or ascending[0] < 1:
        raise ValueError(f"capture sizes must be positive integers, got {list(sizes)}")
    steps = rows = padded = replayed = 0
    work: float = 0
    eager: Dict[int, int] = {}
    for bs, n in _counts(histogram).items():
        steps += n
        at = bisect.bisect_left(ascending, bs)
        if at == len(ascending):
            eager[bs] = n
            continue
        replayed = replayed + n
        rows = rows + n * bs
        padded = padded + n * (ascending[at] - bs)
        work += n * cost(ascending[at])
    return Plan(tuple(ascending), steps, replayed, rows, padded, work, eager,
                None if mem is None else sum(mem(s) for s in ascending), memory_unit)


def _check_cost(cost: CostFn, sizes: Sequence[int], what: str) -> List[float]:
    values = [cost(s) for s in sizes]
    for s, v, prev in zip(sizes, values, [0.0] + values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{what}({s}) must be a finite non-negative number, got {v!r}")
        if v < prev:
            raise ValueError(f"{what} must not decrease with the size: {what}({s}) = {v} is below the "
                             f"previous size's {prev}")
    return values


def _graph_dp(cost: List[float], prefix: List[int], graphs: int) -> List[int]:
    """Indices of the bucket tops (ascending) of the best partition into at most
    ``graphs`` buckets, the last top forced; divide and conquer per layer."""
    k = len(cost)
    best = [cost[j] * prefix[j + 1] for j in range(k)]  # one bucket: everything up to j
    choices: List[List[int]] = []
    for _ in range(min(graphs, k) - 1):
        new = best[:]
        choice = [-1] * k  # -1: keep the layer below (fewer graphs)

        def solve(lo: int, hi: int, opt_lo: int, opt_hi: int) -> None:
            if lo > hi:
                return
            j = (lo + hi) // 2
            arg = opt_lo
            value = math.inf
            for i in range(opt_lo, min(j - 1, opt_hi) + 1):
                v = best[i] + cost[j] * (prefix[j + 1] - prefix[i + 1])
                if v < value:
                    arg = i
                    value = v
            if value < new[j]:
                new[j] = value
                choice[j] = arg
            solve(lo, j - 1, opt_lo, arg)
            solve(j + 1, hi, arg, opt_hi)

        solve(1, k - 1, 0, k - 2)
        best = new
        choices.append(choice)
    tops = []
    j = k - 1
    for choice in reversed(choices):  # layer n's choice at j
        if choice[j] >= 0:
            tops.append(j)
            j = choice[j]
    tops.append(j)
    return tops[::-1]


def _memory_dp(cost: List[float], prefix: List[int], units: List[int], budget: int) -> List[int]:
    """Bucket tops of the best partition whose graphs' units sum to at most ``budget``;
    ``best[j][m]``: the least work of sizes up to j, a graph at j, within m units."""
    k = len(cost)
    inf = math.inf
    best: List[List[float]] = []
    for j in range(k):
        u = units[j]
        row = [inf] * (budget + 1)
        for m in range(u, budget + 1):
            row[m] = cost[j] * prefix[j + 1]
        for i in range(j):
            w = cost[j] * (prefix[j + 1] - prefix[i + 1])
            row[u:] = map(min, row[u:], [v + w for v in best[i][:budget + 1 - u]])
        best.append(row)
    if best[-1][budget] == inf:
        raise ValueError("no plan fits the memory budget")
    tops = []
    j = k - 1
    m = budget
    while True:
        tops.append(j)
        target = best[j][m]
        m = m - units[j]
        if target == cost[j] * prefix[j + 1]:
            return tops[::-1]
        j = next(i for i in range(j) if best[i][m] + cost[j] * (prefix[j + 1] - prefix[i + 1]) == target)


def plan_capture_sizes(
    histogram: Union[BatchSizeHistogram, Mapping[int, int]],
    graphs: Optional[int] = None,
    *,
    max_bs: Optional[int] = None,
    cost: Optional[CostFn] = None,
    memory_budget: Optional[float] = None,
    graph_memory: Optional[MemoryModel] = None,
) -> Plan:
    """The capture sizes minimising ``sum(steps * cost(padded size))`` over ``histogram``.

    Budget: at most ``graphs`` graphs, or (``memory_budget`` with ``graph_memory``, a
    graph's bytes as a callable of its size or ``(a, b)`` for ``a + b * size``) graphs
    whose memory sums to at most ``memory_budget``. ``max_bs``: the largest graph, which
    is always captured (so every size up to it replays); sizes above it run eager
    (``Plan.eager``). By default, the largest size served. ``cost`` must not decrease
    with the size; by default padded rows (``cost(s) = s``).
    """
    counts = _counts(histogram)
    if (graphs is None) == (memory_budget is None):
        raise ValueError("give one budget: graphs, or memory_budget with graph_memory")
    if graphs is not None and (isinstance(graphs, bool) or not isinstance(graphs, int)
                               or not 1 <= graphs <= MAX_GRAPHS):
        raise ValueError(f"graphs must be an integer in [1, {MAX_GRAPHS}], got {graphs!r}")
    if memory_budget is not None and graph_memory is None:
        raise ValueError("memory_budget needs graph_memory (a graph's bytes by size)")
    if max_bs is None:
        if not counts:
            raise ValueError("the histogram is empty: give max_bs or record some steps")
        max_bs = max(counts)
    if isinstance(max_bs, bool) or not isinstance(max_bs, int) or not 1 <= max_bs <= MAX_BATCH_SIZE:
        raise ValueError(f"max_bs must be an integer in [1, {MAX_BATCH_SIZE}], got {max_bs!r}")
    cost = cost or _rows
    sizes = [bs for bs in counts if bs < max_bs] + [max_bs]
    steps = [counts.get(bs, 0) for bs in sizes]
    prefix = [0]
    for n in steps:
        prefix.append(prefix[-1] + n)
    costs = _check_cost(cost, sizes, "cost")
    unit = None
    if graphs is not None:
        tops = _graph_dp(costs, prefix, graphs)
    else:
        mem = _check_cost(_memory_fn(graph_memory), sizes, "graph_memory")
        if not (isinstance(memory_budget, (int, float)) and math.isfinite(memory_budget) and memory_budget > 0):
            raise ValueError(f"memory_budget must be a positive number, got {memory_budget!r}")
        if mem[-1] > memory_budget:
            raise ValueError(f"the graph of max_bs {max_bs} alone needs {mem[-1]:g} bytes, over the budget "
                             f"of {memory_budget:g}")
        if len(sizes) > MAX_MEMORY_PLAN_SIZES:
            raise ValueError(f"{len(sizes)} distinct sizes; a memory budget plans at most "
                             f"{MAX_MEMORY_PLAN_SIZES} (a graph budget plans any histogram)")
        # Whole bytes when the budget is that small: exact for integer memory models.
        units = max(1, min(math.floor(memory_budget),
                           max(MIN_MEMORY_UNITS, min(MAX_MEMORY_UNITS, MEMORY_DP_WORK // len(sizes) ** 2))))
        unit = memory_budget / units
        # Rounded up in exact arithmetic: the units of a plan that fits never exceed the budget.
        tops = _memory_dp(costs, prefix, [math.ceil(Fraction(m) * units / Fraction(memory_budget)) for m in mem], units)
    return evaluate([sizes[j] for j in tops], counts, cost, graph_memory, unit)
