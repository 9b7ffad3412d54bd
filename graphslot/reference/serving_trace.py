"""A synthetic serving trace: the decode batch size of every step of a simple engine.

Requests arrive as a Poisson process whose rate swings slowly (a day of load compressed
into ``period`` steps), each wants a lognormal number of output tokens, and a
continuous batcher admits waiting requests whenever fewer than ``max_bs`` run; every
step decodes one token for each running request, which leaves when it has all its
tokens. The raw decode batch size per step is what a capture-size planner plans for.
Pure Python and deterministic for a seed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import List

from ..planning.histogram import BatchSizeHistogram


@dataclass(frozen=True)
class TraceConfig:
    steps: int = 20000
    max_bs: int = 256
    #: Mean arrivals per step; the rate swings between (1 - swing) and (1 + swing) times it.
    arrival_rate: float = 0.8
    swing: float = 0.9
    period: int = 10000
    #: Output tokens: lognormal with this median and shape.
    median_tokens: float = 150.0
    sigma: float = 0.8
    seed: int = 0


def _poisson(rng: random.Random, lam: float) -> int:
    """Knuth's method: fine for the small per-step rates here."""
    limit = math.exp(-lam)
    n = 0
    p = rng.random()
    while p > limit:
        n = n + 1
        p = p * rng.random()
    return n


def serving_trace(config: TraceConfig = TraceConfig()) -> List[int]:
    """The decode batch size of every step that had a request running."""
    rng = random.Random(config.seed)
    waiting: deque = deque()
    finishing: List[int] = []  # heap of the steps at which running requests finish
    sizes = []
    for step in range(config.steps):
        rate = config.arrival_rate * (1 + config.swing * math.sin(2 * math.pi * step / config.period))
        for _ in range(_poisson(rng, max(rate, 0.0))):
            waiting.append(max(1, round(rng.lognormvariate(math.log(config.median_tokens), config.sigma))))
        while waiting and len(finishing) < config.max_bs:
            heapq.heappush(finishing, step + waiting.popleft())
        if finishing:
            sizes.append(len(finishing))
        while finishing and finishing[0] <= step + 1:
            heapq.heappop(finishing)
    return sizes


def serving_histogram(config: TraceConfig = TraceConfig()) -> BatchSizeHistogram:
    """The trace as the histogram a decode runner would have recorded serving it."""
    histogram = BatchSizeHistogram()
    for bs in serving_trace(config):
        histogram.record(bs)
    return histogram
