"""``graphslot plan-sizes``: the plan next to the default ladder, one-line errors, no torch."""

from __future__ import annotations

import json

import pytest

from graphslot.cli.app import main
from test_torch_free import run_commands

# 10 steps, 33 rows. Default ladder up to 8: 1 2 4 8 (3 -> 4, 5 -> 8: 2 + 9 = 11 padding
# rows). Two graphs: 8 and one of 1, 3, 5 pads 19, 17 or 20 rows: 3 wins.
COUNTS = {"1": 4, "3": 2, "5": 3, "8": 1}


@pytest.fixture
def histogram(tmp_path):
    path = tmp_path / "served.json"
    path.write_text(json.dumps(COUNTS))
    return str(path)


def run(capsys, *argv):
    status = main(["plan-sizes", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def test_the_plan_is_printed_next_to_the_default_ladder(capsys, histogram):
    status, out, err = run(capsys, histogram, "--graphs", "2")
    assert status == 0 and err == ""
    assert out == f"""\
{histogram}: 10 steps, 4 distinct batch sizes in 1..8, 3.30 rows/step on average
plan: at most 2 graphs, max_bs 8

                graphs  padded rows/step  padding
plan                 2             1.700   34.00%
default ladder       4             1.100   25.00%

saving vs the default ladder: -0.600 padded rows/step (-54.5%), +2 graphs
sizes: 3 8
runner: DecodeRunnerConfig(max_bs=8, capture_bs=[3, 8])
"""


def test_by_default_the_plan_has_as_many_graphs_as_the_ladder(capsys, histogram):
    status, out, _ = run(capsys, histogram)
    assert status == 0
    assert "plan: at most 4 graphs, max_bs 8" in out
    assert "saving vs the default ladder: +1.100 padded rows/step (+100.0%), +0 graphs" in out
    assert "sizes: 1 3 5 8" in out


def test_a_capped_max_bs_names_the_sizes_that_run_eager(capsys, histogram):
    status, out, _ = run(capsys, histogram, "--max-bs", "4", "--graphs", "2")
    assert status == 0
    assert "sizes: 1 4" in out.splitlines()  # 3 -> 4 pads 2 rows; 3 and 4 would pad 12
    assert "eager (above max_bs 4): 2 sizes in 5..8, 4 of 10 steps (40.0%)" in out.splitlines()


def test_a_memory_budget_plans_within_it(capsys, histogram):
    status, out, _ = run(capsys, histogram, "--memory", "2.5KiB", "--graph-bytes", "1KiB", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["budget"] == {"memory": 2560, "graph_bytes": 1024, "row_bytes": 0}
    assert report["plan"]["sizes"] == [3, 8] and report["plan"]["memory"] == 2048
    assert report["default_ladder"]["memory"] == 4096


def test_json_holds_the_table(capsys, histogram):
    status, out, _ = run(capsys, histogram, "--graphs", "2", "--json")
    report = json.loads(out)
    assert status == 0 and report["command"] == "plan-sizes" and report["max_bs"] == 8
    assert report["histogram"] == {"path": histogram, "steps": 10, "distinct_sizes": 4, "min": 1, "max": 8,
                                   "mean_rows": 3.3}
    assert report["plan"]["padded_rows"] == 17 and report["default_ladder"]["padded_rows"] == 11
    assert report["saving"]["graphs"] == 2 and report["saving"]["padded_rows_per_step"] == pytest.approx(-0.6)


def test_a_runner_dump_is_read_as_it_was_written(capsys, tmp_path):
    from graphslot.planning.histogram import BatchSizeHistogram

    path = tmp_path / "dump.json"
    BatchSizeHistogram({int(bs): n for bs, n in COUNTS.items()}).save(path)
    status, out, _ = run(capsys, str(path), "--graphs", "2")
    assert status == 0 and "sizes: 3 8" in out


@pytest.mark.parametrize("argv, message", [
    (["--graphs", "0"], "argument --graphs: expected a positive integer, got '0'"),
    (["--graphs", "513"], "argument --graphs: 513 is over the limit of 512 (the plan is exact dynamic programming "
                          "over graphs and sizes)"),
    (["--graphs", "2", "--memory", "1GiB"], "give one budget: --graphs or --memory"),
    (["--memory", "1GiB"], "--memory needs a memory model: --graph-bytes and/or --row-bytes"),
    (["--row-bytes", "1MiB"], "--graph-bytes and --row-bytes need --memory"),
    (["--memory", "lots"], "argument --memory: expected bytes such as 1073741824, 512MiB or 2GiB, got 'lots'"),
])
def test_usage_errors_exit_2(capsys, histogram, argv, message):
    status, _, err = run(capsys, histogram, *argv)
    assert status == 2 and err.splitlines()[-1] == f"graphslot plan-sizes: error: {message}"


def test_bad_input_is_one_line_and_exit_1(capsys, tmp_path, histogram):
    bad = tmp_path / "bad.json"
    bad.write_text('{"1": "many"}')
    cases = [
        ([str(bad)], f"{bad}: the count of batch size 1 must be an integer in [0, 9007199254740992], got 'many'"),
        ([str(tmp_path / "none.json")], f"{tmp_path / 'none.json'}: No such file or directory"),
        ([histogram, "--memory", "1KiB", "--row-bytes", "1KiB"],
         "the graph of max_bs 8 alone needs 8192 bytes, over the budget of 1024"),
    ]
    for argv, message in cases:
        status, out, err = run(capsys, *argv)
        assert (status, out, err) == (1, "", f"graphslot plan-sizes: error: {message}\n")


def test_plan_sizes_runs_without_torch(histogram):
    commands = [["plan-sizes", histogram, "--graphs", "2"], ["plan-sizes", histogram, "--json"],
                ["plan-sizes", "--help"]]
    blocked = run_commands(commands, block_torch=True)
    assert blocked["attempts"] == [] and blocked["loaded"] == []
    assert [code for _, code, _, _ in blocked["runs"]] == [0, 0, 0]
    assert blocked["runs"] == run_commands(commands, block_torch=False)["runs"]


@pytest.mark.parametrize("text, key", [
    ('{"4": 10, "8": 5, "4": 1}', "'4'"),
    ('{"format": "graphslot.batch_size_histogram", "counts": {"2": 1}, "counts": {"3": 1}}', "'counts'"),
    ('{"counts": {"1": 1}, "num_tokens_per_bs": 1, "num_tokens_per_bs": 2}', "'num_tokens_per_bs'"),
])
def test_a_key_given_twice_is_refused_naming_it(capsys, tmp_path, text, key):
    # json keeps the last value of a duplicated key without a word.
    path = tmp_path / "dup.json"
    path.write_text(text)
    status, out, err = run(capsys, str(path))
    assert (status, out) == (1, "")
    assert err == (f"graphslot plan-sizes: error: {path}: key {key} appears twice in one JSON object; JSON readers "
                   "keep only one of the values: remove the other\n")
