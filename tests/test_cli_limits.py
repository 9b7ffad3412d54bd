"""Every count a ``graphslot`` command takes has a limit, refused as a usage error naming
the flag (exit 2, one error line) before anything runs: ``graphslot bench --repeats
100000000`` had none and was still timing after 90 s."""

from __future__ import annotations

import argparse
from typing import Any, Iterator, Tuple

import pytest

from graphslot.cli import fill_bench, limits
from graphslot.cli.app import build_parser
from graphslot.cli.common import seed_int

from conftest import cli

#: Integer flags that are not counts, and why no limit keeps them within seconds: what
#: they hold costs the same whatever its value.
NOT_COUNTS = {
    "--seed": "a seed (its own range: what torch.manual_seed takes)",
    "--max-bytes": "a ceiling a spec's declared bytes are compared with; nothing is allocated",
    "--memory": "a budget the planner cuts into at most 1024 units",
    "--graph-bytes": "a graph's bytes in the memory model",
    "--row-bytes": "a row's bytes in the memory model",
}
#: The positional arguments a command needs besides the flag.
POSITIONALS = {"show": ["decode"], "plan-sizes": ["served.json"]}


def subparsers() -> Iterator[Tuple[str, argparse.ArgumentParser]]:
    parser = build_parser()
    for action in parser._subparsers._group_actions:
        yield from action.choices.items()


def int_flags() -> Iterator[Tuple[str, str, Any]]:
    """(command, flag, type) of every argument of every command whose type reads "1" as an int."""
    for name, sub in subparsers():
        for action in sub._actions:
            if not callable(action.type):
                continue
            try:
                value = action.type("1")
            except (argparse.ArgumentTypeError, ValueError):
                continue
            if isinstance(value, int):
                yield name, (action.option_strings or [action.dest])[0], action.type


COUNTS = [(command, flag, kind.limit) for command, flag, kind in int_flags() if hasattr(kind, "limit")]


def test_every_integer_flag_of_every_command_is_a_count_with_a_limit_or_not_a_count():
    flags = list(int_flags())
    assert {"--iters", "--repeats", "--samples", "--graphs", "--max-num-tokens"} <= {flag for _, flag, _ in flags}
    unlimited = [(command, flag) for command, flag, kind in flags if not hasattr(kind, "limit")]
    assert [(command, flag) for command, flag in unlimited if flag not in NOT_COUNTS] == []
    assert seed_int in {kind for _, flag, kind in flags if flag == "--seed"}


@pytest.mark.parametrize("command, flag, limit", COUNTS, ids=[f"{c} {f}" for c, f, _ in COUNTS])
def test_a_count_over_its_limit_is_a_usage_error_naming_the_flag_before_anything_runs(capsys, command, flag, limit):
    status, out, err = cli(capsys, command, flag, str(limit.most + 1), *POSITIONALS.get(command, []))
    assert status == 2 and out == ""
    assert err.splitlines()[-1] == (f"graphslot {command}: error: argument {flag}: {limit.most + 1} is over the "
                                    f"limit of {limit.most} ({limit.why})")


@pytest.mark.parametrize("command, flag, limit", COUNTS, ids=[f"{c} {f}" for c, f, _ in COUNTS])
def test_a_count_at_its_limit_is_taken(command, flag, limit):
    kind = next(kind for c, f, kind in int_flags() if (c, f) == (command, flag))
    assert kind(str(limit.most)) == limit.most


def _must_not_run(*args, **kwargs):
    raise AssertionError("the benchmark ran")


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "100000000"], f"argument --repeats: 100000000 is over the limit of 100 ({limits.MAX_REPEATS.why})"),
    (["--iters", "100000000"], f"argument --iters: 100000000 is over the limit of 100000 ({limits.MAX_ITERS.why})"),
    (["--iters", "100000", "--repeats", "3"], "argument --repeats: --iters 100000 × --repeats 3 = 300000 calls is "
                                              f"over the limit of 200000 ({limits.MAX_CALLS.why})"),
], ids=["repeats", "iters", "iters x repeats"])
def test_bench_refuses_counts_over_their_limits_before_timing_anything(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(fill_bench, "run_bench", _must_not_run)
    status, out, err = cli(capsys, "bench", *argv)
    assert status == 2 and out == ""
    assert err.splitlines()[-1] == f"graphslot bench: error: {message}"
    assert "fill_from + extract" not in err  # not even the header of a run


def test_bench_takes_its_counts_up_to_their_limits(capsys, monkeypatch):
    calls = []

    def fake(iters, repeats, progress=False):
        calls.append((iters, repeats))
        return {"missed": [], "gating_missed": False}

    monkeypatch.setattr(fill_bench, "run_bench", fake)
    assert cli(capsys, "bench", "--json", "--iters", "100000", "--repeats", "2")[0] == 0
    assert cli(capsys, "bench", "--json", "--iters", "2000", "--repeats", "100")[0] == 0
    assert calls == [(100000, 2), (2000, 100)]


def test_plan_sizes_max_bs_over_a_histograms_largest_size_is_a_usage_error(capsys, tmp_path):
    """It was exit 1, ``max_bs must be an integer in [1, 1048576], got 100000000``, naming no flag."""
    histogram = tmp_path / "served.json"
    histogram.write_text('{"3": 5}')
    status, out, err = cli(capsys, "plan-sizes", str(histogram), "--max-bs", "100000000")
    assert status == 2 and out == ""
    assert err.splitlines()[-1] == ("graphslot plan-sizes: error: argument --max-bs: 100000000 is over the limit of "
                                    f"1048576 ({limits.MAX_CAPACITY.why})")
