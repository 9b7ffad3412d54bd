"""DP-attention decode across real processes: two ranks over gloo, each with its own
batches, agree on one graph (or on eager) every step and compute what one process does.

The scripted session (tests/dp_cases.py) runs once for the module: spawning ranks is
slow. Every launch has a hard timeout, so a hang in a collective fails the test.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections import Counter

import pytest
import torch

import dp_cases
from dp_cases import EXTEND, HOOK_STEP, MISCOUNTED_STEP, STEPS, WRONG_SHAPE_STEP
from graphslot import SlotError
from graphslot.cli import demo_dp, main
from graphslot.reference import build_reference_model, make_decode_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.dp_launch import RankFailure, RankReport, Watched, launch, verdict
from graphslot.reference.model import TinyConfig
from graphslot.api import build

TIMEOUT = 120.0  # seconds for a whole launch; a healthy one takes well under 30
WORLD = 2
MUST_AGREE = ("every rank must build its runner alike (captured sizes, settings, slot spec and buffer params), or "
              "their captures and steps run different collectives, which hang or abort; nothing was captured")


@pytest.fixture(scope="module")
def session():
    ranks = launch(dp_cases.run_rank, WORLD, timeout=TIMEOUT)
    return [records[:-1] for records in ranks], [records[-1] for records in ranks]


def steps_where(predicate):
    return [s for s, actions in enumerate(STEPS) if predicate(actions)]


def tokens(action, step):
    if action == EXTEND:
        return len(dp_cases.NEW_PROMPT)
    return action


# --------------------------------------------------------------------------- agreement


def test_ranks_exchange_fresh_counts_and_agree_on_the_padded_size(session):
    steps, summary = session
    sizes = summary[0]["captured_sizes"]
    assert summary[1]["captured_sizes"] == sizes == [8, 4, 2, 1]
    different = 0
    for s, actions in enumerate(STEPS):
        counts = [tokens(a, s) for a in actions]
        assert [r[s]["raw_tokens"] for r in steps] == counts
        different += counts[0] != counts[1]
        for rank in range(WORLD):  # the exchange, not the stale [999, 999] the batch carried
            assert steps[rank][s]["counts"] == counts
        assert steps[0][s]["padded_bs"] == steps[1][s]["padded_bs"]
        if all(a != EXTEND for a in actions) and 0 < max(counts) <= sizes[0]:
            assert steps[0][s]["padded_bs"] == min(bs for bs in sizes if bs >= max(counts))
    assert different >= 6


def test_ranks_that_would_capture_different_sizes_are_refused_before_capture(session):
    _, summary = session
    for totals in summary:
        assert totals["refused"] == (
            "DP ranks disagree on the captured sizes (rank 0: [8, 4, 2, 1], rank 1: [7, 4, 2, 1]): " + MUST_AGREE)


def test_gathered_buffers_and_global_num_tokens_slots_follow_the_spec(session):
    steps, _ = session
    hidden = TinyConfig().hidden_size
    for s in range(len(STEPS)):
        first = steps[0][s]
        if first["idle"]:
            assert "gathered" not in first
            continue
        padded = first["padded_bs"]
        rows = padded if padded is not None else max(first["counts"])  # eager: padded to the busiest rank
        if padded is not None:  # the decode spec: every rank runs the padded count
            for rank in range(WORLD):
                assert steps[rank][s]["slots"] == {"global_num_tokens_gpu": [padded] * WORLD,
                                                   "global_num_tokens_for_logprob_gpu": [padded] * WORLD}
        assert first["gathered"].shape == (WORLD * rows, hidden)
        assert torch.equal(first["gathered"], steps[1][s]["gathered"])  # one all-gather, the same on both
        assert first["own_rows_in_place"] and steps[1][s]["own_rows_in_place"]


def test_every_rank_computes_what_one_process_computes_without_dp(session):
    steps, _ = session
    torch.set_num_threads(1)
    reference = dp_cases.single_process_logits(WORLD)
    for s in range(len(STEPS)):
        for rank in range(WORLD):
            mine, ref = steps[rank][s]["logits"], reference[s][rank]
            if ref is None:
                assert mine is None, f"step {s}: idle rank {rank} returned rows"
            else:
                assert torch.equal(mine, ref), f"step {s}, rank {rank} differs from one process"


def test_a_rank_that_cannot_run_a_graph_makes_every_rank_run_eager(session):
    steps, summary = session
    beyond = steps_where(lambda a: EXTEND not in a and max(a) > 8)
    prefill = steps_where(lambda a: EXTEND in a)
    assert beyond and prefill
    for s in beyond + prefill:
        assert [r[s]["padded_bs"] for r in steps] == [None, None]
        assert steps[0][s]["flags"] == [True, s not in prefill]
    for rank, totals in enumerate(summary):
        assert (totals["graph_steps"], totals["eager_steps"], totals["skipped_steps"]) == (
            len(STEPS) - len(beyond) - len(prefill) - 1, len(beyond) + len(prefill), 1)
        # The rank's runner metrics count its own rows the same way, with a reason for each fallback.
        busy = [rec for rec in steps[rank] if rec["raw_tokens"] > 0]
        metrics = totals["metrics"]
        assert metrics["replays"] == sum(rec["padded_bs"] is not None for rec in busy)
        assert metrics["eager_fallbacks"] == sum(rec["padded_bs"] is None for rec in busy) > 0
        assert sum(metrics["eager_reasons"].values()) == metrics["eager_fallbacks"]
        # The histogram plans graphs, so it counts the busiest rank's size of each decode step
        # the rank served (graph or eager), never a step with a prefill anywhere.
        planned = Counter(max(rec["counts"]) for rec in busy if all(rec["flags"]))
        assert totals["histogram"] == dict(planned) and max(planned) > 8


def test_idle_ranks_join_the_step_and_a_step_without_work_is_skipped(session):
    steps, _ = session
    idle_graph = steps_where(lambda a: a == (0, 3))[0]
    assert steps[0][idle_graph]["padded_bs"] == 4 and steps[0][idle_graph]["logits"] is None
    idle_eager = steps_where(lambda a: a == (0, 10))[0]
    assert steps[0][idle_eager]["gathered"].shape[0] == WORLD * 10
    nothing = steps_where(lambda a: a == (0, 0))[0]
    assert all(r[nothing]["idle"] and r[nothing]["logits"] is None for r in steps)


def test_lazy_capture_happens_on_every_rank_at_the_step_that_first_needs_it():
    ranks = launch(dp_cases.run_rank, WORLD, "cpu", True, timeout=TIMEOUT)
    reference = dp_cases.single_process_logits(WORLD)
    for rank, records in enumerate(ranks):
        *steps, summary = records
        needed = {rec["padded_bs"] for rec in steps if rec["padded_bs"] is not None and not rec["idle"]}
        assert summary["graphs"] == sorted(needed) == [2, 4, 8]  # never 1: no step padded to it
        for s, rec in enumerate(steps):
            want = reference[s][rank]
            assert (rec["logits"] is None) if want is None else torch.equal(rec["logits"], want), (s, rank)


def test_ranks_agree_on_the_context_bucket_of_the_longest_context_of_any_rank():
    ranks = launch(dp_cases.run_rank, WORLD, "cpu", False, [4, 8, 16], timeout=TIMEOUT)
    reference = dp_cases.single_process_logits(WORLD)
    steps = [records[:-1] for records in ranks]
    differing = 0
    for s in range(len(STEPS)):
        first, second = steps[0][s], steps[1][s]
        own = [rec["longest"] for rec in (first, second)]
        if first["padded_bs"] is None or first["idle"]:
            assert first["context"] is None and second["context"] is None
            continue
        # each rank sent its own longest context (0 when idle); both took the bucket of the larger
        assert first["contexts"] == second["contexts"] == own
        assert first["context"] == second["context"] == min(n for n in (4, 8, 16) if n >= max(own))
        differing += min(n for n in (4, 8, 16) if n >= min(own)) != first["context"]
    assert differing >= 2  # steps where a rank alone would have picked a smaller bucket
    for rank, records in enumerate(ranks):
        summary = records[-1]
        assert summary["graphs"] == sorted((bs, n) for bs in (8, 4, 2, 1) for n in (4, 8, 16))
        assert sum(summary["metrics"]["replays_per_context"].values()) == summary["metrics"]["replays"] > 0
        for s, rec in enumerate(steps[rank]):
            want = reference[s][rank]
            assert (rec["logits"] is None) if want is None else torch.equal(rec["logits"], want), (s, rank)


# ---------------------------------------------------------------- fail fast, never hang


@pytest.fixture(scope="module")
def mismatches():
    return launch(dp_cases.refuse_mismatches, WORLD, timeout=TIMEOUT)


@pytest.mark.parametrize("setting, values", [
    ("lazy", "rank 0: False, rank 1: True"),
    ("num_tokens_per_bs", "rank 0: 1, rank 1: 2"),
    ("disable_padding", "rank 0: False, rank 1: True"),
    ("spec param cache_loc_dtype", "rank 0: int64, rank 1: int32"),
    ("the context buckets", "rank 0: [16, 8], rank 1: [16]"),
    ("the replay guard", "rank 0: False, rank 1: True"),
])
def test_ranks_that_differ_in_a_setting_are_refused_on_every_rank_before_capture(mismatches, setting, values):
    for rank in range(WORLD):
        case = mismatches[rank][setting]
        assert case["error"] == {"type": "SlotError", "message": f"DP ranks disagree on {setting} ({values}): "
                                                                 + MUST_AGREE}
        assert not case["forward_ran"]  # neither capture nor its warm-up ran the model's collectives


def test_a_rank_that_cannot_build_its_runner_fails_every_rank_before_capture(mismatches):
    for rank in range(WORLD):
        case = mismatches[rank]["a rank that cannot build"]
        assert case["error"]["type"] == "DPStepError"  # a SlotError
        assert case["error"]["message"].startswith(
            "DP rank 1 failed building its runner: SlotError: spec 'decode': the ForwardBatch from "
            "ReferenceDPDecodeAdapter.make_dummy_batch has no 'encoder_lens' (None or missing)")
        assert case["error"]["message"].endswith("; every rank raised this error, before any capture")
        assert not case["forward_ran"]


AFTER_A_STEP_ERROR = ", and no rank ran this step: all may go on with their next step, or all stop"
BAD_FILL = "SlotError: spec 'decode', slot 'out_cache_loc': expected shape [1], got [0] (copy_ would broadcast or fail)"


def test_a_rank_with_a_malformed_batch_fails_every_rank_and_all_can_go_on():
    ranks = launch(dp_cases.run_with_a_bad_batch, WORLD, "retry", timeout=TIMEOUT)
    for run in ranks:
        bad_fill, not_a_batch = run["errors"]
        # Rank 1's batch would fail the fill: refused before the exchange; rank 0, whose batch was fine, raised too.
        assert bad_fill == {
            "step": dp_cases.BAD_STEP, "type": "DPStepError", "failed_ranks": [1], "graph_steps": 2, "eager_steps": 0,
            "message": f"DP rank 1 failed at DP step 3, before the exchange: {BAD_FILL}; every rank raised this "
                       f"error{AFTER_A_STEP_ERROR}"}
        # Rank 0 could not even count its tokens: both raised at the exchange (the retry was DP step 4).
        assert not_a_batch == {
            "step": dp_cases.NOT_A_BATCH_STEP, "type": "DPStepError", "failed_ranks": [0], "graph_steps": 4,
            "eager_steps": 0,
            "message": "DP rank 0 failed at DP step 6, before the exchange: AttributeError: 'object' object has no "
                       f"attribute 'input_ids'; every rank raised this error{AFTER_A_STEP_ERROR}"}
    # Every rank caught its error and ran the step again: the session is what one process computes.
    reference = dp_cases.single_process_logits(WORLD)
    for s in range(len(STEPS)):
        for rank in range(WORLD):
            mine, ref = ranks[rank]["logits"][s], reference[s][rank]
            assert (mine is None) if ref is None else torch.equal(mine, ref), (s, rank)


def test_the_launch_names_the_rank_with_the_malformed_batch_not_the_survivor():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(dp_cases.run_with_a_bad_batch, WORLD, "raise", timeout=TIMEOUT)
    assert time.monotonic() - start < 60
    assert info.value.summary == f"DP rank 1 of 2 failed: {BAD_FILL}; rank 0 stopped because rank 1 failed"
    assert info.value.culprits == [1]
    # Rank 1's own traceback: the fill's error, then the DPStepError it caused.
    assert "RankFailure" not in info.value.details and "slot 'out_cache_loc'" in info.value.details
    assert "DPStepError: DP rank 1 failed at DP step 3" in info.value.details


def test_a_failing_rank_that_carries_on_alone_is_still_the_one_named():
    with pytest.raises(RankFailure) as info:  # rank 0 stops on the error; rank 1 catches it and goes on alone
        launch(dp_cases.run_with_a_bad_batch, WORLD, "failing rank retries", timeout=TIMEOUT)
    assert info.value.summary == f"DP rank 1 of 2 failed: {BAD_FILL}; rank 0 stopped because rank 1 failed"


# ------------------------------------------------------------ one collective a step


@pytest.fixture(scope="module")
def counted():
    return launch(dp_cases.count_collectives, WORLD, timeout=TIMEOUT)


def test_a_steady_step_runs_one_collective_graph_eager_or_skipped(counted):
    for run in counted:
        steps = run["steps"]
        assert [rec["mode"] for rec in steps] == ["graph"] * 4 + ["eager"] * 3 + ["idle", "graph"]
        assert [rec["error"] for rec in steps] == [None] * len(STEPS)
        # every step, the retries after a refused batch included: the exchange alone
        assert [len(rec["collectives"]) for rec in steps] == [1] * len(STEPS), [rec["collectives"] for rec in steps]


def test_released_graphs_make_every_rank_run_eager_until_recaptured(counted):
    for run in counted:  # a released runner captures nothing on its own: the ranks agree on eager
        released, recaptured = run["lifecycle"]
        assert (released["mode"], released["error"], len(released["collectives"])) == ("eager", None, 1)
        assert released["eager_reasons"].get("graphs released") == 1
        assert (recaptured["mode"], recaptured["error"], len(recaptured["collectives"])) == ("graph", None, 1)
        assert recaptured["eager_reasons"] == released["eager_reasons"]


@pytest.mark.parametrize("step, dp_step, error", [
    (WRONG_SHAPE_STEP, 3, "SlotError: spec 'decode', slot 'positions': expected shape [1], got [1, 1] (copy_ would "
                          "broadcast or fail)"),
    (MISCOUNTED_STEP, 5, "SlotError: ReferenceDPDecodeAdapter.batch_size says the ForwardBatch holds 4 request(s) of "
                         "1 token(s) each, but num_tokens says 3 token(s); the ranks pick the graph from the tokens "
                         "and the fill copies the requests: make the two agree (batch_size, num_tokens, or the batch)"),
])
def test_an_invalid_batch_fails_every_rank_at_the_exchange_naming_its_rank(counted, step, dp_step, error):
    for run in counted:  # rank 0's batch was fine (at MISCOUNTED_STEP rank 0 is idle): it raised the same error
        refused = run["steps"][step]["invalid"]
        assert refused["error"] == {"failed_ranks": [1], "message": (
            f"DP rank 1 failed at DP step {dp_step}, before the exchange: {error}; every rank raised this error"
            f"{AFTER_A_STEP_ERROR}")}
        assert len(refused["collectives"]) == 2 and refused["collectives"][1] == "all_gather_object"  # the messages


def test_with_the_replay_guard_on_a_step_pays_a_second_collective_and_a_hook_error_fails_every_rank(counted):
    for run in counted:
        assert run["confirm"] == [False, True]
        steps = run["guard_steps"]
        assert [len(rec["collectives"]) for rec in steps] == [2] * len(steps)
        assert [rec["error"] for rec in steps] == [None] * len(steps)
        refused = steps[HOOK_STEP]["invalid"]
        assert refused["error"] == {"failed_ranks": [1], "message": (
            f"DP rank 1 failed at DP step {HOOK_STEP + 1}, preparing its batch: RuntimeError: init_replay_metadata "
            f"failed on purpose; every rank raised this error{AFTER_A_STEP_ERROR}")}
        assert len(refused["collectives"]) == 3


def test_without_the_guard_a_hook_that_raises_after_the_exchange_fails_as_the_forward_would():
    with pytest.raises(RankFailure) as info:  # rank 0 is in the forward's gather by then: no DPStepError
        launch(dp_cases.hook_fails_after_the_exchange, WORLD, timeout=TIMEOUT)
    assert info.value.summary == ("DP rank 1 of 2 failed: RuntimeError: init_replay_metadata failed on purpose; rank 0 "
                                  "stopped because rank 1 failed")
    assert info.value.culprits == [1] and "DPStepError" not in info.value.details


AFTER_A_LIFECYCLE_ERROR = (", and no rank ran its call: release() and recapture() on a DP runner are collective, "
                           "every rank calls them between the same two steps; all may go on, or all stop")


@pytest.mark.parametrize("call, lazy", [("release", True), ("recapture", True), ("recapture", False)])
def test_a_rank_that_releases_or_recaptures_alone_fails_every_rank_naming_it_and_all_can_go_on(call, lazy):
    ranks = launch(dp_cases.lifecycle_alone, WORLD, call, lazy, "retry", timeout=TIMEOUT)
    for rank, run in enumerate(ranks):
        assert run["direct"] == (f"{call}() on this decode runner: its DPDecodeRunner owns it, whose ranks release "
                                 f"and recapture together: call release() or recapture() on the DPDecodeRunner, on "
                                 f"every rank between the same two steps")
        alone, behind_its_back = run["errors"]
        # No rank released, captured or ran the step: the same error on both, naming rank 1.
        assert alone["failed_ranks"] == [1] and alone["generation"] == 0, (rank, alone)
        assert alone["message"] == (f"DP rank 1 failed agreeing on what to call: RuntimeError: it called {call}() "
                                    f"while rank(s) 0 called a step; every rank raised this error"
                                    f"{AFTER_A_LIFECYCLE_ERROR}")
        assert behind_its_back["failed_ranks"] == [1]
        assert behind_its_back["message"] == (
            "DP rank 1 failed agreeing on what to call: RuntimeError: it had its graphs released or recaptured 2 "
            "time(s) while rank(s) 0 had its graphs released or recaptured 1 time(s); every rank raised this error"
            f"{AFTER_A_LIFECYCLE_ERROR}")
    assert [run["generation"] for run in ranks] == [1, 2]
    reference = dp_cases.single_process_logits(WORLD)  # every step, the one after the refused call included
    for s in range(len(STEPS)):
        for rank in range(WORLD):
            mine, ref = ranks[rank]["logits"][s], reference[s][rank]
            assert (mine is None) if ref is None else torch.equal(mine, ref), (s, rank)


def test_the_launch_names_the_rank_that_released_alone():
    with pytest.raises(RankFailure) as info:
        launch(dp_cases.lifecycle_alone, WORLD, "release", True, "raise", timeout=TIMEOUT)
    assert info.value.summary == ("DP rank 1 of 2 failed: RuntimeError: it called release() while rank(s) 0 called a "
                                  "step; rank 0 stopped because rank 1 failed")
    assert info.value.culprits == [1]


def test_a_rank_hung_after_the_exchange_is_told_from_the_rank_waiting_for_it():
    with pytest.raises(RankFailure) as info:  # rank 0 waits in the forward's gather until the deadline
        launch(dp_cases.hangs_after_the_exchange, WORLD, timeout=45.0)
    assert re.fullmatch(r"DP rank 1 of 2 did not finish: still running after \d+ s outside any collective; killed; "
                        r"rank 0 stopped waiting for rank 1", info.value.summary), info.value.summary
    assert info.value.culprits == [1]
    assert info.value.details.startswith("rank 1's stack:\n") and "in <lambda>" in info.value.details


@pytest.fixture(scope="module", params=["generated", "interpreted", "strict"])
def decode_registry(request):
    rt = build_reference_model(max_num_reqs=16)
    registry = build("decode", max_bs=8, max_num_tokens=8, params=ReferenceDecodeAdapter(rt).spec_params(),
                              impl="interpreted" if request.param == "interpreted" else "generated",
                              strict=request.param == "strict", device="cpu")
    return registry, make_decode_batch(rt, rt.req_to_token_pool.alloc(3), [4, 5, 6], [1, 2, 3])


def edited(fb, **fields):
    bad = copy.copy(fb)
    for name, value in fields.items():
        if value is delattr:
            delattr(bad, name)
        else:
            setattr(bad, name, value)
    return bad


def test_check_step_raises_what_the_fill_would_at_any_padded_size_and_writes_nothing(decode_registry):
    registry, fb = decode_registry
    before = {s.name: s.buffer.clone() for s in registry.active}
    registry.check_step(fb, raw_bs=3, raw_num_tokens=3)
    assert all(torch.equal(s.buffer, before[s.name]) for s in registry.active)
    for bad in (edited(fb, positions=fb.positions.unsqueeze(1)), edited(fb, seq_lens=fb.seq_lens[:2]),
                edited(fb, input_ids=None), edited(fb, out_cache_loc=delattr), edited(fb, req_pool_indices=[0, 1, 2]),
                edited(fb, seq_lens_cpu=fb.seq_lens_cpu.int()) if registry.strict else edited(fb, input_ids=7)):
        with pytest.raises(SlotError) as checked:
            registry.check_step(bad, raw_bs=3, raw_num_tokens=3)
        assert all(torch.equal(s.buffer, before[s.name]) for s in registry.active)
        for padded in (3, 4, 8):
            with pytest.raises(SlotError) as filled:
                registry.fill_from(bad, raw_bs=3, padded_bs=padded, raw_num_tokens=3, padded_num_tokens=padded)
            assert str(checked.value) == str(filled.value)
    for padded in (3, 4, 8):
        registry.fill_from(fb, raw_bs=3, padded_bs=padded, raw_num_tokens=3, padded_num_tokens=padded)


@pytest.mark.parametrize("raw_bs, message", [
    (9, "spec 'decode': bs counts must satisfy 0 <= raw <= capacity, got raw=9, capacity=8"),
    (-1, "spec 'decode': bs counts must satisfy 0 <= raw <= capacity, got raw=-1, capacity=8"),
    (2.5, "spec 'decode': raw bs count must be an int, got float 2.5"),
])
def test_check_step_refuses_raw_counts_no_fill_can_take(decode_registry, raw_bs, message):
    registry, fb = decode_registry
    with pytest.raises(SlotError) as info:
        registry.check_step(fb, raw_bs=raw_bs, raw_num_tokens=3)
    assert str(info.value) == message


# ------------------------------------------------------------------------------ launch


def test_a_hung_rank_fails_the_launch_naming_it_not_the_rank_waiting_for_it():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"^DP rank 1 of 2 did not finish: still running after \d+ s outside any "
                                          r"collective; killed; rank 0 stopped waiting for rank 1\n") as info:
        launch(dp_cases.barrier_without_rank_one, WORLD, timeout=90.0)
    assert info.value.culprits == [1]
    assert time.monotonic() - start < 60  # rank 0's collective timed out: the launch did not wait for the deadline


def test_ranks_still_running_at_the_deadline_are_killed():
    start = time.monotonic()
    # Outside any collective when their stacks came in time; else (still importing torch, say) unknown.
    with pytest.raises(RankFailure, match=r"^DP ranks 0, 1 of 2 (did not finish: still running after 1\d s outside "
                                          r"any collective|still running after 1\d s \(a hang in a collective\?\)); "
                                          r"killed"):
        launch(dp_cases.sleep_forever, WORLD, timeout=10.0)
    assert time.monotonic() - start < 20


def test_a_failing_rank_fails_the_launch_at_once_with_its_error():
    start = time.monotonic()
    summary = "DP rank 0 of 2 failed: ValueError: rank 0 gives up; rank 1 stopped because rank 0 failed"
    with pytest.raises(RankFailure, match=f"^{re.escape(summary)}\n") as info:
        launch(dp_cases.rank_zero_fails, WORLD, timeout=TIMEOUT)
    assert time.monotonic() - start < 30  # not the timeout: rank 1 waits for rank 0 in vain
    assert info.value.summary == summary
    assert info.value.details.startswith("Traceback") and info.value.details in str(info.value)


def test_a_rank_that_dies_without_a_word_is_named_not_the_survivor():
    with pytest.raises(RankFailure) as info:
        launch(dp_cases.rank_one_aborts, WORLD, timeout=TIMEOUT)
    assert info.value.summary == ("DP rank 1 of 2 died without reporting an error (killed by SIGABRT); rank 0 stopped "
                                  "because rank 1 failed")


def test_a_rank_that_returns_early_is_named_not_the_survivor_whose_collective_lost_it():
    with pytest.raises(RankFailure) as info:
        launch(dp_cases.rank_one_returns_early, WORLD, timeout=TIMEOUT)
    assert info.value.culprits == [1]
    assert info.value.summary == ("DP rank 1 of 2 returned while rank 0 still waited for it in a collective; rank 0 "
                                  "stopped because rank 1 returned early")
    assert "by peer" in info.value.details  # what rank 0 saw: gloo's connection closed, or reset, by peer


def test_a_rank_is_done_once_its_result_is_written_whatever_the_interpreter_teardown_does():
    assert launch(dp_cases.done_then_aborts_at_exit, WORLD, timeout=TIMEOUT) == [0, 1]


def report(rank, at, error, consequence=False, blamed=None):
    return RankReport(rank, at, error, f"Traceback of rank {rank}", consequence, blamed or {})


def test_the_verdict_blames_the_first_own_error_even_when_a_consequence_was_reported_first():
    lost = ("RuntimeError", "[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    failure = verdict(Watched({0: report(0, 10.0, lost, consequence=True), 1: report(1, 10.5, ("KeyError", "'x'"))},
                              {0: (11.0, 1), 1: (11.0, 1)}, [], 12.0), WORLD)
    assert (failure.summary, failure.details, failure.culprits) == (
        "DP rank 1 of 2 failed: KeyError: 'x'; rank 0 stopped because rank 1 failed", "Traceback of rank 1", [1])


def test_the_verdict_blames_the_ranks_that_returned_when_the_others_only_lost_their_peers():
    lost = ("RuntimeError", "[pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")
    failure = verdict(Watched({2: report(2, 5.0, lost, consequence=True)}, {0: (4.0, 0), 1: (4.5, 0), 2: (6.0, 1)},
                              [], 6.0), 3)
    assert (failure.summary, failure.details, failure.culprits) == (
        "DP ranks 0, 1 of 3 returned while rank 2 still waited for them in a collective; rank 2 stopped because "
        "ranks 0, 1 returned early", "Traceback of rank 2", [0, 1])


def test_the_verdict_names_every_rank_that_raised_the_same_error_and_no_one_when_all_finished():
    same = ("SlotError", "DP ranks disagree on lazy (rank 0: False, rank 1: True): ...")
    failure = verdict(Watched({0: report(0, 1.0, same), 1: report(1, 0.9, same)}, {0: (2.0, 1), 1: (2.0, 1)}, [], 3.0),
                      WORLD)
    assert failure.summary == f"DP ranks 0, 1 of 2 failed: {same[0]}: {same[1]}"
    assert verdict(Watched({}, {0: (1.0, 0), 1: (1.0, 0)}, [], 1.0), WORLD) is None


def stack(*frames):
    lines = [f'  File "{path}", line {line} in {function}' for path, line, function in frames]
    return "\n".join(["Current thread 0x1 (most recent call first):", *lines,
                      '  File "/x/graphslot/reference/dp_launch.py", line 99 in _rank_main'])


def test_the_verdict_tells_a_rank_stuck_outside_any_collective_from_the_ranks_waiting_in_one():
    from graphslot.reference.dp_launch import in_collective

    c10d = stack(("/x/torch/distributed/distributed_c10d.py", 10, "all_gather_into_tensor"), ("/x/dp.py", 5, "step"))
    tape = stack(("/x/torch/_ops.py", 1279, "__call__"), ("/x/graphslot/graphs/tape/replay.py", 42, "_run_collective"))
    stuck = stack(("/nowhere/hook.py", 3, "init_replay_metadata"), ("/x/graphslot/runners/decode.py", 350, "_prepare"))
    assert (in_collective(c10d), in_collective(tape), in_collective(stuck), in_collective("")) == (True, True, False,
                                                                                                   None)
    failure = verdict(Watched({}, {}, [0, 1, 2], 30.4, {0: c10d, 1: stuck, 2: tape}), 3)
    assert (failure.summary, failure.culprits) == (
        "DP rank 1 of 3 did not finish: still running after 30 s outside any collective; killed; ranks 0, 2 stopped "
        "waiting for rank 1", [1])
    assert failure.details == f"rank 1's stack:\n{stuck}"
    unknown = verdict(Watched({}, {}, [0, 1], 30.0, {0: c10d}), WORLD)  # no stack says who: both named alike
    assert unknown.summary == "DP ranks 0, 1 of 2 still running after 30 s (a hang in a collective?); killed"


# -------------------------------------------------------------------------------- demo


def test_cli_dp_demo_matches_one_process(monkeypatch, capfd):
    monkeypatch.setattr(demo_dp, "DEFAULT_TIMEOUT", TIMEOUT)
    assert main(["demo", "--dp", "2", "--steps", "40", "--max-bs", "4", "--backend", "cpu", "--json"]) == 0
    out, err = capfd.readouterr()  # the ranks' stderr too: not a terminal, so no bar frames from any process
    assert "\r" not in err and "Decoding (rank 0)" not in err and "Capturing" not in err
    result = json.loads(out)
    assert result["mode"] == "dp-decode" and result["dp"] == 2 and result["dist_backend"] == "gloo"
    assert result["check"] == "torch.equal" and result["mismatching_forwards"] == 0
    assert result["disagreeing_steps"] == [] and result["checked_forwards"] > 40
    assert result["graph_steps"] > 0 and result["graph_steps"] + result["eager_steps"] + result["skipped_steps"] == 40
    assert result["steps_with_different_sizes"] > 10
    assert err.startswith("graphslot demo: 2 DP ranks, 40 decode steps each (max_bs 4), backend cpu")
    table = demo_dp.format_dp_table(result)
    for row in ("agreed graph steps", "agreed eager steps", "mismatching forwards", "disagreeing steps"):
        assert row in table


@pytest.mark.parametrize("argv, message", [
    (["--workload", "prefill", "--dp", "2"], "argument --dp: only for --workload decode, not --workload prefill"),
    (["--dp", "2", "--batches", "3"], "argument --batches: only for --workload prefill, not --workload decode"),
    (["--dp", "2", "--runner", "all"], "argument --runner: only for --workload prefill, not --workload decode"),
    (["--dp", "0"], "argument --dp: "),
])
def test_cli_dp_rejects_flags_it_does_not_take(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(demo_dp, "run_dp_demo", lambda **kw: pytest.fail("the demo ran"))
    assert main(["demo", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith(f"graphslot demo: error: {message}")


def test_cli_dp_on_cuda_needs_a_gpu_per_rank(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    monkeypatch.setattr(demo_dp, "run_dp_demo", lambda **kw: pytest.fail("the demo ran"))
    assert main(["demo", "--dp", "2", "--backend", "cuda"]) == 1
    assert capsys.readouterr() == ("", "graphslot demo: error: --dp 2 --backend cuda needs 2 CUDA GPUs (one a "
                                       "rank); this torch (2.13.0+cu130) sees 1: use --backend cpu or auto\n")


def test_cli_dp_reports_a_failed_rank_in_one_line(monkeypatch, capsys):
    def fail(**kwargs):
        raise RankFailure("DP rank 1 of 2 failed: RuntimeError: boom", "Traceback ...\nRuntimeError: boom")

    monkeypatch.setattr(demo_dp, "run_dp_demo", fail)
    assert main(["demo", "--dp", "2", "--backend", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == "graphslot demo: error: DP rank 1 of 2 failed: RuntimeError: boom"
    assert "Traceback" not in err


# -------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_ranks_capture_the_gather_in_cuda_graphs_and_match_one_process():
    ranks = launch(dp_cases.run_rank, WORLD, "cuda", timeout=TIMEOUT, backend="nccl")
    reference = dp_cases.single_process_logits(WORLD)
    for s in range(len(STEPS)):
        assert ranks[0][s]["padded_bs"] == ranks[1][s]["padded_bs"]
        for rank in range(WORLD):
            mine, ref = ranks[rank][s]["logits"], reference[s][rank]
            assert (mine is None) == (ref is None)
            if ref is not None:
                assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), f"step {s}, rank {rank}"
    assert ranks[0][-1]["graph_steps"] > 0


class CountingOddly:
    """A DP adapter whose ``num_tokens`` returns ``value`` (engine code returning what no exchange can send)."""

    @staticmethod
    def make(value):
        from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter

        class Odd(ReferenceDPDecodeAdapter):
            def num_tokens(self, fb):
                return value

        return Odd(build_reference_model(max_num_reqs=4), DPAttention())


@pytest.mark.parametrize("value, error", [(None, "TypeError"), (2.5, "TypeError"), (-1, "ValueError"),
                                          (2**70, "ValueError")])
def test_a_num_tokens_no_exchange_can_send_fails_every_rank_before_it(value, error):
    """It was sent as it was: 2**70 raised in this rank alone, outside the exchange its peers wait in (a hang), 2.5
    was sent as 2, None and -1 failed on what they broke further on. Now each is the rank's own failure, checked
    before the exchange, naming the hook."""
    import torch.distributed as dist

    from graphslot.runners import DPDecodeRunner, DPExchange, DPStepError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        adapter = CountingOddly.make(value)
        dp = DPDecodeRunner(adapter, DPExchange(), max_bs=2, capture_bs=[2], progress=False)
        fb = make_decode_batch(adapter.runtime, adapter.runtime.req_to_token_pool.alloc(1), [1], [3])
        with pytest.raises(DPStepError, match=re.escape(
                f"DP rank 0 failed at DP step 1, before the exchange: {error}: Odd.num_tokens returned {value}; it "
                "must be an int >= 0 (the batch's tokens, what the ranks exchange); every rank raised this error")):
            dp(fb)
    finally:
        dist.destroy_process_group()


def test_a_bucketed_step_reads_the_batch_s_longest_context_once():
    """The check read it before the exchange, then runner.stage() read it again to check the agreed bucket against
    it; now the stage is given the one the check read."""
    import torch.distributed as dist

    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange

    class Counting(ReferenceDPDecodeAdapter):
        def context_len(self, fb):
            reads.append(fb)
            return super().context_len(fb)

    reads = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        adapter = Counting(build_reference_model(max_num_reqs=4), DPAttention())
        dp = DPDecodeRunner(adapter, DPExchange(), max_bs=2, capture_bs=[2], context_buckets=[8, 16], progress=False)
        fb = make_decode_batch(adapter.runtime, adapter.runtime.req_to_token_pool.alloc(1), [5], [3])
        reads.clear()
        dp(fb)
        assert (dp.graph_steps, dp.last.contexts, dp.last.context) == (1, [6], 8)
        assert [read is fb for read in reads] == [True]
    finally:
        dist.destroy_process_group()
