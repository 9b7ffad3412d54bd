"""benchmarks/bench_runner_step.py runs: the runner as of its ``BEFORE`` commit is measured
in a child process over that commit's whole package (loading the old runner module over
today's package failed: "'DecodeRunnerConfig' object has no attribute 'mode'")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_runner_step", ROOT / "benchmarks" / "bench_runner_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_step_bench_measures_the_runner_before_and_today_in_every_mode(capsys):
    bench = load_bench()
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{bench.BEFORE}^{{commit}}"])
    if known.returncode:
        pytest.skip(f"this clone lacks the commit {bench.BEFORE} the bench compares with")
    bench.main(["--iters", "2", "--rounds", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    from graphslot.runners.capture import CAPTURE_MODES

    assert list(result["runners"]) == ["full (before)", *CAPTURE_MODES]
    for name, row in result["runners"].items():
        assert row["host_us"] > 0 and row["step_us"] > 0, name
    assert result["runners"]["full (before)"]["host_vs_full_before"] == 1.0
