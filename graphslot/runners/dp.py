"""Data-parallel decode: every rank agrees on one padded size and one graph, or on eager.

With DP attention the captured graph holds a collective (the gather of every rank's
tokens), so a step only completes when every rank runs the same collective on the same
sizes. The classic failures are ranks picking different padded sizes or graphs, one
rank falling back to eager while the others replay, and per-rank counts that go stale
-- each a hang or silent garbage. :class:`DPDecodeRunner` rules them out by deciding
only from what every rank holds alike:

1. before each step, one small all-gather exchanges each rank's token count (the
   engine's ``global_num_tokens_cpu``, written onto the batch fresh every step) and a
   "can run a graph" flag (false for a batch that is not graph-runnable, a prefill say);
2. every rank then computes the same answer: the smallest captured size that fits the
   busiest rank, or eager on every rank when any flag is false or the busiest rank is
   beyond the largest graph;
3. eager runs the same collectives (each rank padded to the busiest, sglang's
   ``MAX_LEN`` mode), so ranks stay matched either way. A rank with no requests runs
   an empty batch, joining the collectives; a step where no rank has any is skipped.

Every rank must capture the same sizes (checked before capture, which runs the
collectives too), since the choice is made from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from .adapter import DecodeAdapter
from .decode import DecodeGraphRunner, DecodeRunnerConfig, capture_sizes


def _all_gather_into(out: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name, else the old
    gather(out, mine, group=group)


class DPExchange:
    """The per-step exchange of token counts and can-run flags over a process group."""

    def __init__(self, group: Optional[Any] = None, device: torch.device | str = "cpu"):
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.device = torch.device(device)

    def __call__(self, num_tokens: int, can_run: bool) -> Tuple[List[int], List[bool]]:
        mine = torch.tensor([num_tokens, int(can_run)], dtype=torch.int64, device=self.device)
        everyone = torch.empty(2 * self.size, dtype=torch.int64, device=self.device)
        _all_gather_into(everyone, mine, self.group)
        rows = everyone.view(self.size, 2).tolist()
        return [count for count, _ in rows], [bool(flag) for _, flag in rows]

    def check_same(self, what: str, value: List[int]) -> None:
        """Raise on every rank when ``value`` is not the same on all of them."""
        values: List[Any] = [None] * self.size
        dist.all_gather_object(values, list(value), group=self.group)
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"DP ranks disagree on {what} ({per_rank}); every rank must capture the same sizes "
                             "(same max_bs, capture_bs and request pool), or they hang in the capture's "
                             "collectives and cannot agree on a graph")


@dataclass(frozen=True)
class DPStep:
    """What the ranks agreed on for one step (the same on every rank)."""

    global_num_tokens: List[int]
    can_run: List[bool]
    #: The graph every rank replays, or None: every rank runs eager.
    padded_bs: Optional[int]

    @property
    def idle(self) -> bool:
        """No rank has a token: the step is skipped everywhere."""
        return max(self.global_num_tokens) == 0


class DPDecodeRunner:
    """Builds the rank's :class:`DecodeGraphRunner` (every rank in step: capture runs the
    collectives); then call it once per step on every rank, with the rank's batch or
    None when the rank has no requests."""

    def __init__(self, adapter: DecodeAdapter, exchange: DPExchange, config: Optional[DecodeRunnerConfig] = None,
                 **overrides: Any):
        config = dataclasses.replace(config or DecodeRunnerConfig(), **overrides)
        params = {**adapter.spec_params(), **config.params}
        dp = {name: params.get(name) for name in ("require_gathered_buffer", "require_mlp_tp_gather", "dp_size")}
        if dp != {"require_gathered_buffer": True, "require_mlp_tp_gather": True, "dp_size": exchange.size}:
            raise ValueError(f"DP decode needs the decode spec params require_gathered_buffer=True, "
                             f"require_mlp_tp_gather=True and dp_size={exchange.size} (the group's size) from the "
                             f"adapter's spec_params or the runner config; they are {dp}")
        # Before capture: a rank capturing other sizes would hang the others in the capture's gathers.
        sizes = capture_sizes(config.max_bs, config.capture_bs, config.capture_bs_multiple, adapter.max_requests)
        exchange.check_same("the batch sizes to capture", sizes)
        self.runner, self.exchange = DecodeGraphRunner(adapter, config), exchange
        self.adapter, self.k = adapter, self.runner.k
        self.last: Optional[DPStep] = None
        self.graph_steps = self.eager_steps = self.skipped_steps = 0

    def locally_runnable(self, fb: Any) -> bool:
        """This rank's say: a graph can run its batch, given a size that fits."""
        return fb is None or self.adapter.tokens_per_bs(fb) == self.k

    def agree(self, counts: List[int], flags: List[bool]) -> Optional[int]:
        """The padded size every rank picks from the same counts and flags; None: eager (or,
        with no tokens anywhere, nothing)."""
        needed = -(-max(counts) // self.k)
        if not all(flags) or needed < 1 or self.runner.size_problem(needed):
            return None
        return self.runner.pad(needed)

    def __call__(self, fb: Any) -> Optional[Any]:
        """This rank's outputs (its rows only), or None when idle or when every rank is."""
        num_tokens = 0 if fb is None else self.adapter.num_tokens(fb)
        counts, flags = self.exchange(num_tokens, self.locally_runnable(fb))
        step = self.last = DPStep(counts, flags, self.agree(counts, flags))
        if step.idle:
            self.skipped_steps += 1
            return None
        batch = self.adapter.make_dummy_batch(1, self.k) if fb is None else fb
        batch.global_num_tokens_cpu = counts  # fresh every step: never a stale count
        if step.padded_bs is not None:
            self.graph_steps += 1
            padded = self.runner.padded_bs(batch)
            if padded != step.padded_bs:  # the runner reads the same counts; never differs
                raise RuntimeError(f"DP rank {self.exchange.rank}: the runner pads to {padded}, "
                                   f"the ranks agreed on {step.padded_bs}")
            out = self.runner.replay(batch, count=fb is not None)
        else:
            self.eager_steps += 1
            if fb is not None:  # in the runner's metrics and histogram, as a fallback of its own would be
                reason = self.runner.eager_reason(batch) or "another DP rank cannot run a graph"
                self.runner.stats.fell_back(reason, -(-max(counts) // self.k) if all(flags) else None)
            rows = max(counts)
            self.adapter.set_dp_buffer_len([rows] * len(counts), rows * len(counts))
            out = self.adapter.forward_eager(batch)
        return None if fb is None else out
