"""A scripted two-rank DP decode session (tests/test_dp.py), and its single-process replay.

Each rank decodes its own requests; STEPS says, per step and rank, how many of them
decode (0: the rank is idle) or that the rank prefills a new request instead (not
graph-runnable). Tokens are scripted, not sampled, so one process can replay every
rank's batches through the plain reference model and compare logits.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Union

import torch

from graphslot import SlotError
from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch

MAX_BS = 8  # captured: 8, 4, 2, 1
EXTEND = "extend"
Action = Union[int, str]
STEPS: List[tuple] = [
    (3, 6),        # different raw sizes: both pad to 8
    (1, 2),        # both pad to 2
    (3, 1),        # the other rank is busier this time: both pad to 4
    (0, 3),        # rank 0 idle: replays an all-padding graph of 4
    (2, 10),       # rank 1 beyond the largest graph: both eager
    (0, 10),       # the same with rank 0 idle
    (5, EXTEND),   # rank 1 prefills (not graph-runnable): both eager
    (0, 0),        # nobody has work: skipped everywhere
    (8, 8),        # back to graphs
]
PROMPTS = [[(11 * r + 5 * i + j) % 97 + 1 for j in range(2 + (i + r) % 5)] for r in range(2) for i in range(12)]
NEW_PROMPT = [3, 1, 4, 1, 5]


def token(rank: int, i: int, step: int) -> int:
    return (7 * i + 3 * step + 13 * rank) % 100 + 1


class RankRequests:
    """One rank's requests on a runtime: prefilled at start, then decoded step by step."""

    def __init__(self, rt: Any, rank: int):
        self.rt, self.rank = rt, rank
        prompts = PROMPTS[12 * rank:12 * rank + 11]
        self.rpi = rt.req_to_token_pool.alloc(len(prompts))
        rt.forward(make_extend_batch(rt, self.rpi, [0] * len(prompts), prompts))
        self.lens = [len(p) for p in prompts]

    def batch(self, action: Action, step: int) -> Any:
        if action == EXTEND:
            return make_extend_batch(self.rt, self.rt.req_to_token_pool.alloc(1), [0], [NEW_PROMPT])
        if not action:
            return None
        fb = make_decode_batch(self.rt, self.rpi[:action], self.lens[:action],
                               [token(self.rank, i, step) for i in range(action)])
        self.lens[:action] = [n + 1 for n in self.lens[:action]]
        return fb


def run_rank(rank: int, world_size: int, device: str = "cpu", lazy: bool = False,
             context_buckets: Any = None) -> List[Dict[str, Any]]:
    """The session on one rank: what it saw and computed, step by step (``lazy``: each
    graph captured at the step that first needs it, by every rank at once;
    ``context_buckets``: the runners' context buckets)."""
    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange

    torch.set_num_threads(1)
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    rt = build_reference_model(device=dev, max_num_reqs=16)
    adapter, exchange = ReferenceDPDecodeAdapter(rt, DPAttention()), DPExchange(device=dev)
    try:  # rank 1 would capture a size more: refused on every rank, before any capture
        DPDecodeRunner(adapter, exchange, max_bs=MAX_BS - rank, capture_bs=[MAX_BS - rank, 4, 2, 1], progress=False)
        refused = None
    except SlotError as exc:
        refused = str(exc)
    dp = DPDecodeRunner(adapter, exchange, max_bs=MAX_BS, progress=False, lazy=lazy, context_buckets=context_buckets)
    runner = dp.runner
    requests = RankRequests(rt, rank)
    records = []
    for step, actions in enumerate(STEPS):
        fb = requests.batch(actions[rank], step)
        if fb is not None:
            fb.global_num_tokens_cpu = [999] * world_size  # stale: the runner must not use it
        out = dp(fb)
        agreed = dp.last
        rec: Dict[str, Any] = {"raw_tokens": 0 if fb is None else fb.num_tokens, "counts": agreed.global_num_tokens,
                               "flags": agreed.can_run, "padded_bs": agreed.padded_bs, "idle": agreed.idle,
                               "logits": None if out is None else out.detach().cpu().clone(),
                               "longest": 0 if fb is None else max(fb.seq_lens_cpu.tolist()),
                               "contexts": agreed.contexts, "context": agreed.context}
        if agreed.padded_bs is not None and not agreed.idle:
            reg = runner.registry
            rec["slots"] = {name: reg.slot(name).buffer.tolist()
                            for name in ("global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu")}
            local, gathered = adapter.graph_gathers[agreed.padded_bs * world_size]
        else:
            local, gathered = adapter.dp.last_gather if not agreed.idle else (None, None)
        if gathered is not None:
            rows = local.shape[0]
            rec["gathered"] = gathered.detach().cpu().clone()
            rec["own_rows_in_place"] = torch.equal(gathered[rank * rows:(rank + 1) * rows], local)
        records.append(rec)
    records.append({"graph_steps": dp.graph_steps, "eager_steps": dp.eager_steps, "skipped_steps": dp.skipped_steps,
                    "captured_sizes": runner.captured_sizes, "graphs": sorted(runner.graphs),
                    "metrics": runner.metrics(), "histogram": dict(runner.histogram.counts),
                    "refused": refused})
    return records


def single_process_logits(world_size: int = 2) -> List[List[Any]]:
    """Every rank's batches, step by step, through one plain (non-DP) model in one process."""
    rt = build_reference_model(max_num_reqs=16 * world_size)
    ranks = [RankRequests(rt, rank) for rank in range(world_size)]
    out = []
    for step, actions in enumerate(STEPS):
        row = []
        for r in range(world_size):
            fb = ranks[r].batch(actions[r], step)
            row.append(None if fb is None else rt.forward(fb).clone())
        out.append(row)
    return out


# ------------------------------------------------------------------ fail fast, never hang

#: Per-rank runner settings that must agree (rank 0's, rank 1's), by the setting an error names.
MISMATCHES = {
    "lazy": ({}, {"lazy": True}),
    "num_tokens_per_bs": ({}, {"num_tokens_per_bs": 2}),
    "disable_padding": ({}, {"disable_padding": True}),
    "spec param cache_loc_dtype": ({}, {"params": {"cache_loc_dtype": "int32"}}),
    "the context buckets": ({"context_buckets": [8, 16]}, {"context_buckets": [16]}),
    "the replay guard": ({"guard": False}, {"guard": True}),  # a second collective a step on one rank only
    # Not a disagreement: rank 1 cannot build its runner at all (its dummy batch lacks encoder_lens).
    "a rank that cannot build": ({}, {"params": {"is_encoder_decoder": True}}),
}


def refuse_mismatches(rank: int, world_size: int) -> Dict[str, Dict[str, Any]]:
    """Each MISMATCHES case built on both ranks: the error each rank raised, and whether
    the model ran at all (a capture, or its warm-up, runs the forward)."""
    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange

    torch.set_num_threads(1)
    out = {}
    for case, per_rank in MISMATCHES.items():
        adapter = ReferenceDPDecodeAdapter(build_reference_model(max_num_reqs=16), DPAttention())
        try:
            DPDecodeRunner(adapter, DPExchange(), max_bs=MAX_BS, progress=False, **per_rank[rank])
            error = None
        except SlotError as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
        out[case] = {"error": error, "forward_ran": bool(adapter.graph_gathers) or adapter.dp.last_gather is not None}
    return out


BAD_STEP = 2  # (3, 1): a graph step (both pad to 4), where rank 1's batch is malformed
NOT_A_BATCH_STEP = 4  # (2, 10): an eager step, where rank 0 first passes something that is not a batch


def malformed(fb: Any) -> Any:
    """``fb`` with one KV slot too few: the fill refuses it (a SlotError naming the slot)."""
    bad = copy.copy(fb)
    bad.out_cache_loc = fb.out_cache_loc[:-1]
    return bad


def run_with_a_bad_batch(rank: int, world_size: int, on_error: str) -> Dict[str, Any]:
    """The scripted session where rank 1's batch is malformed at BAD_STEP (and, with
    ``on_error="retry"``, rank 0 passes a non-batch at NOT_A_BATCH_STEP). ``on_error``:
    "retry": every rank catches the error and runs the step again with its good batch;
    "raise": no rank catches it; "failing rank retries": rank 1 catches it and goes on,
    rank 0 does not catch it."""
    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange

    torch.set_num_threads(1)
    rt = build_reference_model(max_num_reqs=16)
    dp = DPDecodeRunner(ReferenceDPDecodeAdapter(rt, DPAttention()), DPExchange(), max_bs=MAX_BS, progress=False)
    requests = RankRequests(rt, rank)
    logits: List[Any] = []
    errors: List[Dict[str, Any]] = []
    trials = {BAD_STEP: {1: malformed}, NOT_A_BATCH_STEP: {0: lambda fb: object()}}
    if on_error != "retry":
        del trials[NOT_A_BATCH_STEP]
    for step, actions in enumerate(STEPS):
        fb = requests.batch(actions[rank], step)
        if step in trials:  # every rank calls the runner; one with a bad batch
            bad = trials[step].get(rank)
            try:
                out = dp(fb if bad is None else bad(fb))
                errors.append({"step": step, "type": None})
            except SlotError as exc:
                errors.append({"step": step, "type": type(exc).__name__, "message": str(exc),
                               "failed_ranks": exc.failed_ranks, "graph_steps": dp.graph_steps,
                               "eager_steps": dp.eager_steps})
                if on_error == "raise" or (on_error == "failing rank retries" and rank == 0):
                    raise
                out = dp(fb)  # the step again, with the good batch
        else:
            out = dp(fb)
        logits.append(None if out is None else out.detach().cpu().clone())
    return {"errors": errors, "logits": logits}


#: The torch.distributed calls a rank's host makes (the model's gather is a functional op, not one of these).
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_reduce",
               "broadcast", "broadcast_object_list", "barrier", "gather", "gather_object", "scatter", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "monitored_barrier")


class CollectiveCounter:
    """Counts the calls of every torch.distributed collective (COLLECTIVES) while installed."""

    def __init__(self):
        import torch.distributed as dist

        self.calls: List[str] = []
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, fn in self.originals.items():
            setattr(dist, name, self._counting(name, fn))

    def _counting(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return fn(*args, **kwargs)

        return counted

    def take(self) -> List[str]:
        """The calls since the last take."""
        calls, self.calls = self.calls, []
        return calls


WRONG_SHAPE_STEP = 2  # (3, 1): a graph step, where rank 1's positions have a trailing dim
MISCOUNTED_STEP = 3  # (0, 3): a graph step, rank 0 idle; rank 1's batch_size says one request more than its tokens
HOOK_STEP = 2  # with the replay guard on: rank 1's replay metadata hook raises


def wrong_shape(fb: Any) -> Any:
    bad = copy.copy(fb)
    bad.positions = fb.positions.unsqueeze(1)
    return bad


def miscounted(fb: Any) -> Any:
    bad = copy.copy(fb)
    bad.batch_size = fb.batch_size + 1
    return bad


class MetadataFails:
    """Makes an adapter's ``init_replay_metadata`` raise once."""

    def __init__(self, adapter: Any):
        self.adapter = adapter

    def __call__(self, *args: Any) -> None:
        del self.adapter.init_replay_metadata  # back to the class's
        raise RuntimeError("init_replay_metadata failed on purpose")


def count_collectives(rank: int, world_size: int) -> Dict[str, Any]:
    """The scripted session with every torch.distributed call counted step by step. Rank
    1's batch is invalid at WRONG_SHAPE_STEP and MISCOUNTED_STEP (the checks before the
    exchange refuse it); every rank catches the DPStepError and runs the step again with
    its good batch. Then, with the replay guard on, two graph steps and one where rank 1's
    replay metadata hook raises after the exchange, caught the same way."""
    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange, DPStepError

    torch.set_num_threads(1)
    rt = build_reference_model(max_num_reqs=16)
    dp = DPDecodeRunner(ReferenceDPDecodeAdapter(rt, DPAttention()), DPExchange(), max_bs=MAX_BS, progress=False,
                        guard=False)
    requests = RankRequests(rt, rank)
    counter = CollectiveCounter()
    steps: List[Dict[str, Any]] = []
    trials = {WRONG_SHAPE_STEP: wrong_shape, MISCOUNTED_STEP: miscounted}

    def call(runner: Any, batch: Any) -> Dict[str, Any]:
        try:
            runner(batch)
            error = None
        except DPStepError as exc:
            error = {"message": str(exc), "failed_ranks": exc.failed_ranks}
        return {"error": error, "collectives": counter.take()}

    for step, actions in enumerate(STEPS):
        fb = requests.batch(actions[rank], step)
        record = {}
        if step in trials:  # every rank calls the runner; rank 1 with an invalid batch, then all again
            record["invalid"] = call(dp, trials[step](fb) if rank == 1 else fb)
        record.update(call(dp, fb))
        record["mode"] = "idle" if dp.last.idle else "eager" if dp.last.padded_bs is None else "graph"
        steps.append(record)

    lifecycle: List[Dict[str, Any]] = []  # the first step's sizes after release(), then after recapture()
    for change in (dp.release, dp.recapture):  # collective calls: every rank makes them
        change()
        counter.take()  # recapture's own collectives are not the step's
        record = call(dp, requests.batch(STEPS[0][rank], len(STEPS) + len(lifecycle)))
        record["mode"] = "eager" if dp.last.padded_bs is None else "graph"
        record["eager_reasons"] = dp.runner.metrics()["eager_reasons"]
        lifecycle.append(record)

    rt = build_reference_model(max_num_reqs=16)
    adapter = ReferenceDPDecodeAdapter(rt, DPAttention())
    guarded = DPDecodeRunner(adapter, DPExchange(), max_bs=MAX_BS, progress=False, guard=True)
    requests = RankRequests(rt, rank)
    counter.take()
    guard_steps: List[Dict[str, Any]] = []
    for step, actions in enumerate(STEPS[:HOOK_STEP + 1]):
        fb = requests.batch(actions[rank], step)
        record = {}
        if step == HOOK_STEP:
            if rank == 1:
                adapter.init_replay_metadata = MetadataFails(adapter)
            record["invalid"] = call(guarded, fb)
        record.update(call(guarded, fb))
        guard_steps.append(record)
    return {"steps": steps, "lifecycle": lifecycle, "guard_steps": guard_steps,
            "confirm": [dp.confirm, guarded.confirm]}


def hook_fails_after_the_exchange(rank: int, world_size: int) -> None:
    """Rank 1's replay metadata hook raises at a graph step, after the exchange (the
    replay guard off): rank 1 raises its own error, rank 0 is in the forward by then."""
    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange

    torch.set_num_threads(1)
    rt = build_reference_model(max_num_reqs=16)
    adapter = ReferenceDPDecodeAdapter(rt, DPAttention())
    dp = DPDecodeRunner(adapter, DPExchange(), max_bs=MAX_BS, progress=False, guard=False)
    requests = RankRequests(rt, rank)
    for step, actions in enumerate(STEPS[:HOOK_STEP + 1]):
        if step == HOOK_STEP and rank == 1:
            adapter.init_replay_metadata = MetadataFails(adapter)
        dp(requests.batch(actions[rank], step))


LIFECYCLE_STEP = 2  # (3, 1): a graph step, where rank 1 calls release() or recapture() alone


def lifecycle_alone(rank: int, world_size: int, call: str, lazy: bool, on_error: str) -> Dict[str, Any]:
    """The scripted session where, at LIFECYCLE_STEP, rank 1 calls ``dp.<call>()`` while rank
    0 runs the step. ``on_error``: "retry": both catch the DPStepError, call ``<call>()``
    together, run the step, and go on; then rank 1 alone releases its runner's graphs
    behind the DP runner's back and both run a step; "raise": no rank catches it. Also what
    the rank's own runner says to ``<call>()``."""
    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange, DPStepError

    torch.set_num_threads(1)
    rt = build_reference_model(max_num_reqs=16)
    dp = DPDecodeRunner(ReferenceDPDecodeAdapter(rt, DPAttention()), DPExchange(), max_bs=MAX_BS, progress=False,
                        lazy=lazy)
    try:
        getattr(dp.runner, call)()
        direct = None
    except RuntimeError as exc:
        direct = str(exc)
    requests = RankRequests(rt, rank)
    logits: List[Any] = []
    errors: List[Dict[str, Any]] = []

    def attempt(run: Any) -> None:
        try:
            run()
        except DPStepError as exc:
            if on_error == "raise":
                raise
            errors.append({"message": str(exc), "failed_ranks": exc.failed_ranks, "generation": dp.runner.generation,
                           "graphs": sorted(dp.runner.graphs)})

    for step, actions in enumerate(STEPS):
        fb = requests.batch(actions[rank], step)
        if step == LIFECYCLE_STEP:
            attempt(getattr(dp, call) if rank == 1 else lambda: dp(fb))
            getattr(dp, call)()  # together this time
        out = dp(fb)
        logits.append(None if out is None else out.detach().cpu().clone())
    if rank == 1:
        dp.runner.release_graphs()  # not through the DP runner: the next exchange sees the generations differ
    attempt(lambda: dp(requests.batch(STEPS[0][rank], len(STEPS))))
    return {"direct": direct, "errors": errors, "logits": logits, "generation": dp.runner.generation}


def hangs_after_the_exchange(rank: int, world_size: int) -> None:
    """Rank 1's replay metadata hook never returns, after the exchange of a graph step:
    rank 0 waits for it in the forward's gather."""
    import time

    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange

    torch.set_num_threads(1)
    rt = build_reference_model(max_num_reqs=16)
    adapter = ReferenceDPDecodeAdapter(rt, DPAttention())
    dp = DPDecodeRunner(adapter, DPExchange(), max_bs=MAX_BS, progress=False, guard=False, capture_bs=[4])
    requests = RankRequests(rt, rank)
    for step, actions in enumerate(STEPS[:HOOK_STEP + 1]):
        if step == HOOK_STEP and rank == 1:
            adapter.init_replay_metadata = lambda *args: time.sleep(600)
        dp(requests.batch(actions[rank], step))


def barrier_without_rank_one(rank: int, world_size: int) -> None:
    """Rank 1 never joins; rank 0 waits for it in a collective that times out after 2 s."""
    import datetime
    import time

    import torch.distributed as dist

    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(60)  # never joins
    dist.barrier(group=group)


def rank_zero_fails(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("rank 0 gives up")
    dist.barrier()  # waits for rank 0 in vain


def rank_one_aborts(rank: int, world_size: int) -> None:
    """Rank 1 dies without a word (as gloo's aborts did); rank 0 waits for it in vain."""
    import os

    import torch.distributed as dist

    if rank == 1:
        os.abort()
    dist.barrier()


def done_then_aborts_at_exit(rank: int, world_size: int) -> int:
    """Both ranks finish; then the interpreter's teardown would abort rank 1 (as gloo did
    when a process group outlived ``destroy_process_group`` in an uncollected cycle)."""
    import atexit
    import os

    if rank == 1:
        atexit.register(os.abort)
    return rank


def sleep_forever(rank: int, world_size: int) -> None:
    import time

    time.sleep(600)


def rank_one_returns_early(rank: int, world_size: int) -> int:
    """Rank 1's function returns without the collective rank 0 waits for it in."""
    import torch.distributed as dist

    if rank == 0:
        dist.barrier()
    return rank
