"""The capture-size planner: exact (brute force agrees), bounded, and never worse than
the default ladder at the same number of graphs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from graphslot.reference.serving_trace import TraceConfig, serving_histogram, serving_trace
from graphslot.planning.histogram import MAX_DISTINCT_SIZES, MAX_FILE_BYTES, BatchSizeHistogram, HistogramError
from graphslot.planning.planner import LADDER_FINE_UNTIL, MAX_GRAPHS, default_ladder, evaluate, plan_capture_sizes


def brute_force(counts, graphs, max_bs=None, cost=None, fits=lambda sizes: True):
    """The least work over every set of at most ``graphs`` sizes among the served ones
    (below max_bs) plus max_bs, by enumeration."""
    top = max_bs or max(bs for bs, n in counts.items() if n)
    below = [bs for bs in sorted(counts) if counts[bs] and bs < top]
    best = math.inf
    for r in range(min(graphs, len(below) + 1)):
        for chosen in itertools.combinations(below, r):
            sizes = list(chosen) + [top]
            if fits(sizes):
                best = min(best, evaluate(sizes, counts, cost).work)
    return best


histograms = st.dictionaries(st.integers(1, 40), st.integers(0, 20), min_size=1, max_size=7).filter(
    lambda h: any(h.values()))
COSTS = {
    "rows": None,
    "affine": lambda s: 5 + 2 * s,
    "tiles of 8": lambda s: -(-s // 8) * 8,  # flat stretches: ties between plans
    "convex": lambda s: s * s,
}


@settings(max_examples=150, deadline=None)
@given(histograms, st.integers(1, 6), st.sampled_from(sorted(COSTS)), st.sampled_from([None, 30, 45]))
def test_a_graph_budget_plan_is_as_good_as_every_subset(counts, graphs, cost_name, max_bs):
    cost = COSTS[cost_name]
    plan = plan_capture_sizes(counts, graphs, max_bs=max_bs, cost=cost)
    assert len(plan) <= graphs and plan.max_bs == (max_bs or max(c for c, n in counts.items() if n))
    assert plan.work == brute_force(counts, graphs, plan.max_bs, cost)
    assert plan.work == evaluate(plan.sizes, counts, cost).work  # the figures are the sizes' own


@settings(max_examples=100, deadline=None)
@given(histograms, st.integers(0, 200), st.integers(0, 3))
def test_a_memory_budget_plan_is_as_good_as_every_subset_that_fits(counts, slack, per_row):
    memory = (10, per_row)
    top = max(bs for bs, n in counts.items() if n)
    budget = 10 + per_row * top + slack
    plan = plan_capture_sizes(counts, memory_budget=budget, graph_memory=memory)
    fits = lambda sizes: sum(10 + per_row * s for s in sizes) <= budget  # noqa: E731
    assert plan.memory <= budget and plan.memory == sum(10 + per_row * s for s in plan.sizes)
    assert plan.work == brute_force(counts, len(counts), None, None, fits)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(1, 300), st.integers(1, 50), min_size=1, max_size=60), st.integers(1, 40))
def test_more_graphs_never_pad_more_and_the_ladder_never_beats_the_plan_at_its_own_count(counts, graphs):
    fewer, more = plan_capture_sizes(counts, graphs), plan_capture_sizes(counts, graphs + 1)
    assert more.padded_rows <= fewer.padded_rows
    cap = max(counts)
    ladder = evaluate(default_ladder(cap), counts)
    assert plan_capture_sizes(counts, len(ladder)).padded_rows <= ladder.padded_rows
    assert not fewer.eager and all(bs <= fewer.max_bs for bs in counts)


def test_one_served_size_is_one_graph_without_padding():
    plan = plan_capture_sizes({7: 100}, 4)
    assert plan.sizes == (7,) and plan.padded_rows == 0 and plan.padding_fraction == 0.0


def test_a_budget_covering_every_size_captures_each_and_pads_nothing():
    counts = {1: 3, 5: 1, 6: 9, 20: 2}
    plan = plan_capture_sizes(counts, 10)
    assert plan.sizes == (1, 5, 6, 20) and plan.padded_rows == 0 and plan.rows == 3 + 5 + 54 + 40


def test_one_graph_is_the_largest_size_and_every_step_pads_up_to_it():
    plan = plan_capture_sizes({1: 3, 5: 1, 20: 2}, 1)
    assert plan.sizes == (20,) and plan.padded_rows == 3 * 19 + 15
    assert plan.padded_rows_per_step == pytest.approx(72 / 6)
    assert plan.padding_fraction == pytest.approx(72 / (72 + 3 + 5 + 40))


def test_max_bs_is_always_captured_and_larger_sizes_are_reported_as_eager():
    counts = {2: 10, 3: 10, 40: 5, 50: 1}
    plan = plan_capture_sizes(counts, 2, max_bs=32)
    assert plan.sizes == (3, 32) and plan.eager == {40: 5, 50: 1}
    assert plan.steps == 26 and plan.replayed_steps == 20 and plan.padded_rows == 10
    assert plan_capture_sizes(counts, 3, max_bs=64).sizes == (3, 40, 64)  # a cap above every size: still captured


def test_a_plan_is_its_sizes_for_the_runner():
    plan = plan_capture_sizes({3: 1, 9: 2}, 2)
    assert list(plan) == [3, 9] and len(plan) == 2
    assert plan.runner_kwargs() == {"max_bs": 9, "capture_bs": [3, 9]}
    assert json.loads(json.dumps(plan.to_json()))["sizes"] == [3, 9]


def test_a_memory_budget_rounds_up_so_the_plan_never_exceeds_it():
    counts = {bs: 1 + bs % 7 for bs in range(1, 200)}
    budget = 2**30
    plan = plan_capture_sizes(counts, memory_budget=budget, graph_memory=lambda s: 2**24 + 2**20 * s)
    units = budget / plan.memory_unit  # the budget in whole units, each graph rounded up to them
    assert plan.memory <= budget and units == pytest.approx(round(units)) and 64 <= units <= 1024
    assert plan.max_bs == 199 and 1 < len(plan) < 199


@pytest.mark.parametrize("kwargs, message", [
    ({"graphs": 0}, "graphs must be an integer in [1, 512], got 0"),
    ({"graphs": MAX_GRAPHS + 1}, "graphs must be an integer in [1, 512], got 513"),
    ({"graphs": True}, "graphs must be an integer"),
    ({}, "give one budget: graphs, or memory_budget with graph_memory"),
    ({"graphs": 2, "memory_budget": 10}, "give one budget"),
    ({"memory_budget": 100}, "memory_budget needs graph_memory"),
    ({"memory_budget": 100, "graph_memory": (50, 10)}, "the graph of max_bs 9 alone needs 140 bytes, over the "
                                                       "budget of 100"),
    ({"memory_budget": math.nan, "graph_memory": (1, 0)}, "memory_budget must be a positive number, got nan"),
    ({"graphs": 2, "cost": lambda s: 10 - s}, "cost must not decrease with the size: cost(9) = 1 is below the "
                                               "previous size's 7"),
    ({"graphs": 2, "cost": lambda s: math.inf}, "cost(3) must be a finite non-negative number, got inf"),
    ({"graphs": 2, "max_bs": 0}, "max_bs must be an integer in [1, 1048576], got 0"),
])
def test_bad_budgets_and_models_are_one_clear_error(kwargs, message):
    with pytest.raises(ValueError) as info:
        plan_capture_sizes({3: 1, 9: 2}, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("counts, message", [
    ({0: 1}, "a batch size must be an integer in [1, 1048576], got 0"),
    ({"4": 1}, "a batch size must be an integer"),
    ({4: -1}, "the count of batch size 4 must be a non-negative integer, got -1"),
    ({4: 0.5}, "the count of batch size 4 must be a non-negative integer, got 0.5"),
])
def test_bad_histograms_through_the_api_are_one_clear_error(counts, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        plan_capture_sizes(counts, 2)


# ----------------------------------------------------------------------- the default ladder


def sglang_ladder(max_bs):
    """The ladder as first written: 1, 2, 4, 8, every 8th size up to max_bs, and max_bs."""
    sizes = [bs for bs in [1, 2, 4, 8] + list(range(16, max_bs + 1, 8)) if bs <= max_bs]
    return sizes + [max_bs] if max_bs not in sizes else sizes


def test_the_default_ladder_is_sglangs_for_every_max_bs_up_to_1024():
    for max_bs in range(1, LADDER_FINE_UNTIL + 9):
        assert default_ladder(max_bs) == sglang_ladder(max_bs), max_bs
    assert len(default_ladder(256)) == 35


@pytest.mark.parametrize("max_bs", [1100, 4096, 10**6, 10**9, 2**62 + 3, 10**18])
def test_above_1024_the_ladder_has_64_sizes_per_doubling_and_pads_at_most_one_in_64(max_bs):
    ladder = default_ladder(max_bs)
    assert ladder[-1] == max_bs and ladder == sorted(set(ladder))
    octaves = math.ceil(math.log2(max_bs / LADDER_FINE_UNTIL))
    assert len(ladder) <= len(default_ladder(LADDER_FINE_UNTIL)) + 64 * octaves + 1  # and the cap
    above = [bs for bs in ladder if bs > LADDER_FINE_UNTIL]
    for smaller, larger in zip([LADDER_FINE_UNTIL] + above, above):
        assert larger - smaller <= smaller // 64  # a raw size pads by at most 1/64 of itself
    assert all(bs % 8 == 0 for bs in ladder[3:-1])


def test_a_ladder_for_a_huge_max_bs_is_built_without_materialising_every_size():
    assert len(default_ladder(10**9)) == 1403  # every 8th size would be 125 million
    assert len(default_ladder(10**18)) < 4000


# --------------------------------------------------------------------- histogram files


def test_a_histogram_saves_and_loads_as_it_was(tmp_path):
    histogram = BatchSizeHistogram(num_tokens_per_bs=2)
    for bs in (3, 1, 3, 0, 8):  # an empty step (size 0) is not a batch
        histogram.record(bs)
    path = tmp_path / "h.json"
    histogram.save(path)
    data = json.loads(path.read_text())
    assert data == {"format": "graphslot.batch_size_histogram", "version": 1, "num_tokens_per_bs": 2, "steps": 4,
                    "counts": {"1": 1, "3": 2, "8": 1}}
    loaded = BatchSizeHistogram.load(path)
    assert loaded.counts == {1: 1, 3: 2, 8: 1} and loaded.num_tokens_per_bs == 2 and loaded.steps == 4


@pytest.mark.parametrize("text, message", [
    ("{", "not a JSON histogram: Expecting property name"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"x": 1}', "a batch size must be a positive integer, got 'x'"),
    ('{"-1": 1}', "a batch size must be a positive integer, got '-1'"),
    ('{"0": 1}', "a batch size must be an integer in [1, 1048576], got 0"),
    ('{"99999999": 1}', "a batch size must be a positive integer, got '99999999'"),
    ('{"4": -1}', "the count of batch size 4 must be an integer in [0, 9007199254740992], got -1"),
    ('{"4": 1.5}', "the count of batch size 4 must be an integer"),
    ('{"4": true}', "the count of batch size 4 must be an integer"),
    ('{"4": 1e999}', "the count of batch size 4 must be an integer"),
    ('{"4": ' + "9" * 5000 + "}", "not a JSON histogram: Exceeds the limit"),
    ('{"4": 0}', "no batch size was served (every count is 0)"),
    ('{"1": 1, "01": 2}', "batch size 1 is given twice"),
    ('{"counts": [1]}', "counts must be an object of size: count, got list"),
    ('{"format": "other", "counts": {"1": 1}}', "format must be 'graphslot.batch_size_histogram', got 'other'"),
    ('{"counts": {"1": 1}, "num_tokens_per_bs": 0}', "num_tokens_per_bs must be an integer in [1, 65536], got 0"),
    ("[" * 100000 + "]" * 100000, "not a JSON histogram"),
    ("\xff", "not a JSON histogram"),
])
def test_a_bad_histogram_file_is_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "h.json"
    path.write_bytes(text.encode("latin-1") if text == "\xff" else text.encode())
    with pytest.raises(HistogramError) as info:
        BatchSizeHistogram.load(path)
    assert str(info.value).startswith(f"{path}: {message}") and "\n" not in str(info.value)


def test_histogram_files_are_bounded(tmp_path):
    too_many = tmp_path / "many.json"
    too_many.write_text(json.dumps({str(bs): 1 for bs in range(1, MAX_DISTINCT_SIZES + 2)}))
    with pytest.raises(HistogramError, match=f"{MAX_DISTINCT_SIZES + 1} distinct batch sizes; at most "
                                             f"{MAX_DISTINCT_SIZES}"):
        BatchSizeHistogram.load(too_many)
    huge = tmp_path / "huge.json"
    huge.write_text(" " * MAX_FILE_BYTES + "{}")
    with pytest.raises(HistogramError, match=f"larger than {MAX_FILE_BYTES} bytes"):
        BatchSizeHistogram.load(huge)


# ------------------------------------------------------------------ the synthetic trace


def test_the_serving_trace_is_deterministic_and_spans_small_to_full_batches():
    config = TraceConfig(steps=4000, period=4000, arrival_rate=1.0)
    sizes = serving_trace(config)
    assert sizes == serving_trace(config) and sizes != serving_trace(TraceConfig(steps=4000, seed=1))
    assert max(sizes) == config.max_bs and min(sizes) < 16
    assert serving_histogram(config).counts == {bs: sizes.count(bs) for bs in set(sizes)}


def test_on_the_busy_trace_the_plan_pads_less_than_the_ladder_with_as_many_graphs():
    histogram = serving_histogram(TraceConfig(steps=5000, period=5000, arrival_rate=0.6))
    ladder = evaluate(default_ladder(256), histogram)
    plan = plan_capture_sizes(histogram, len(ladder), max_bs=256)
    assert plan.padded_rows < 0.85 * ladder.padded_rows


# ------------------------------------------------------------------------ the docs page


def test_the_capture_sizes_page_runs_as_written(tmp_path, monkeypatch):
    from test_docs import python_blocks

    page = Path(__file__).resolve().parent.parent / "docs" / "capture_sizes.md"
    blocks = python_blocks(page)
    assert len(blocks) == 3 and all("assert " in code for _, code in blocks)
    monkeypatch.chdir(tmp_path)  # the page writes served.json
    namespace: dict = {}
    for line, code in blocks:
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
    assert (tmp_path / "served.json").is_file()
