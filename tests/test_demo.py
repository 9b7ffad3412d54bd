"""The demos: decode and prefill through graphs, with no step or batch differing from eager."""

from __future__ import annotations

import re
import json

import pytest
import torch

from graphslot.cli import demo_decode, demo_prefill
from graphslot.cli import main
from graphslot.cli.demo_common import demo_device
from graphslot.cli.demo_decode import format_demo_table, run_demo
from graphslot.cli.demo_prefill import format_prefill_table, run_prefill_demo
from graphslot.reference.numerics import output_check
from graphslot.runners.prefill import PrefillGraphRunner


def test_short_demo_matches_eager_and_prints_a_table():
    result = run_demo(steps=30, backend="cpu", progress=False)
    assert result["backend"] == "cpu" and result["check"] == output_check("cpu").name
    assert result["mismatching_steps"] == 0
    assert result["decode_steps"] >= 25 and len(result["batch_sizes"]) >= 4
    assert result["captured_sizes"] == sorted(result["captured_sizes"], reverse=True)
    assert result["fill_us_generated"] > 0 and result["fill_us_interpreted"] > 0
    assert result["static_bytes"] > 0
    table = format_demo_table(result)
    header = table.splitlines()[0]
    assert "metric" in header and "value" in header
    for row in ("captured sizes", "mismatching steps", "fill_from generated", "static buffers",
                "replays per size", "padded rows", "eager fallbacks"):
        assert row in table
    metrics = result["runner_metrics"]  # every decode step replayed a captured size
    assert metrics["replays"] == result["decode_steps"] and metrics["eager_fallbacks"] == 0
    assert {int(bs) for bs in metrics["replays_per_size"]} <= set(result["captured_sizes"])
    assert metrics["padded_rows"] > 0


# ------------------------------------------------------------------------ prefill

PREFILL_KEYS = {"backend", "check", "registry_mode", "batches", "requests_per_batch", "request_counts",
                "tokens_per_batch", "mismatching_batches", "fill_us_generated", "fill_us_interpreted", "runners"}
# Keys the JSON of both modes carries, with the same meaning.
COMMON_KEYS = {"mode", "backend", "device", "registry_mode", "check", "torch", "max_bs", "fill_batch",
               "fill_us_generated", "fill_us_interpreted", "seconds"}
PREFILL_CLI = ["demo", "--workload", "prefill", "--backend", "cpu", "--json"]
RUNNER_KEYS = {"runner", "buckets", "capture_seconds", "segments_per_graph", "eager_steps_per_graph",
               "mismatching_batches", "eager_batch_ms", "graph_batch_ms", "static_bytes"}


def test_prefill_demo_matches_eager_and_prints_a_table():
    result = run_prefill_demo(batches=10, backend="cpu", progress=False)
    assert PREFILL_KEYS <= set(result)
    assert result["backend"] == "cpu" and result["check"] == output_check("cpu").name
    assert result["batches"] == 10 and result["mismatching_batches"] == 0
    assert len(result["request_counts"]) >= 3 and result["requests_per_batch"][1] <= 8
    assert result["tokens_per_batch"][1] <= 64 and result["chunked_batches"] > 0
    assert result["fill_us_generated"] > 0 and result["fill_us_interpreted"] > 0
    assert [row["runner"] for row in result["runners"]] == ["breakable", "piecewise"]
    for row in result["runners"]:
        assert RUNNER_KEYS <= set(row)
        assert row["mismatching_batches"] == 0
        assert row["buckets"] == sorted(row["buckets"], reverse=True) and len(row["buckets"]) >= 3
        assert row["static_bytes"] > 0 and row["capture_seconds"] > 0
    for row in result["runners"]:  # two layers: each attention call is an eager step between segments
        assert (row["segments_per_graph"], row["eager_steps_per_graph"]) == (3, 2)
    table = format_prefill_table(result)
    header = table.splitlines()[0]
    assert "metric" in header and "value" in header
    for row in ("requests per batch", "tokens per batch", "mismatching batches", "fill_from generated",
                "fill_from interpreted", "buckets captured", "segments per graph", "graph batch", "static buffers"):
        assert row in table
    assert table.count("runner ") == len(result["runners"])


def test_prefill_demo_rejects_an_unknown_runner():
    with pytest.raises(ValueError, match="unknown prefill runner 'fused'; choose from: breakable, piecewise"):
        run_prefill_demo(batches=3, runners=["fused"], progress=False)


def test_prefill_demo_catches_a_broken_runner(monkeypatch):
    # Attention metadata written at capture and never on replay: silently wrong logits
    # (one bucket, so the stale metadata has the right shape and nothing raises).
    monkeypatch.setattr(PrefillGraphRunner, "prepare_replay", lambda self, n, view, fb: None)
    result = run_prefill_demo(batches=6, backend="cpu", runners=["breakable"], token_buckets=[64],
                              progress=False)
    assert result["mismatching_batches"] > 0
    assert result["runners"][0]["mismatch_batch_ids"]


def test_cli_prefill_demo_json(capsys):
    assert main([*PREFILL_CLI, "--batches", "6", "--runner", "breakable"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert PREFILL_KEYS | COMMON_KEYS <= set(result) and result["mismatching_batches"] == 0
    assert [row["runner"] for row in result["runners"]] == ["breakable"]
    assert RUNNER_KEYS <= set(result["runners"][0])
    assert {k: result[k] for k in ("mode", "max_bs", "torch")} == {"mode": "prefill", "max_bs": 8,
                                                                   "torch": torch.__version__}
    assert err.splitlines() == [  # an early header; no terminal for a bar: a line per runner
        "graphslot demo: 6 prefill batches (max_bs 8, runner breakable), backend cpu, registry generated: "
        "capturing, then checking each against eager",
        "graphslot demo: breakable runner: 6 batches, 0 mismatching"]


def test_cli_decode_demo_json_names_its_mode(capsys):
    assert main(["demo", "--backend", "cpu", "--json", "--steps", "8", "--max-bs", "4"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert COMMON_KEYS <= set(result) and result["mismatching_steps"] == 0
    assert {k: result[k] for k in ("mode", "backend", "device", "registry_mode", "max_bs", "steps")} == {
        "mode": "decode", "backend": "cpu", "device": "cpu", "registry_mode": "generated", "max_bs": 4, "steps": 8}
    assert err == ("graphslot demo: 8 decode steps (max_bs 4), backend cpu, registry generated: capturing, then "
                   "checking each against eager\n")


def _must_not_run(*args, **kwargs):
    raise AssertionError("the demo ran")


@pytest.mark.parametrize("workload", ["decode", "prefill"])
def test_cli_demo_cuda_backend_without_a_gpu_is_one_line(monkeypatch, capsys, workload):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(demo_decode, "run_demo", _must_not_run)  # nothing is built
    monkeypatch.setattr(demo_prefill, "run_prefill_demo", _must_not_run)
    assert main(["demo", "--workload", workload, "--backend", "cuda", "--json"]) == 1
    assert capsys.readouterr() == ("", "graphslot demo: error: --backend cuda needs a CUDA GPU; this torch "
                                       "(2.13.0+cpu) sees none: use --backend cpu or auto\n")


@pytest.mark.parametrize("argv, message", [
    (["--workload", "prefill", "--steps", "5"], "argument --steps: only for --workload decode, not --workload prefill"),
    (["--steps", "5", "--workload", "prefill"], "argument --steps: only for --workload decode, not --workload prefill"),
    (["--batches", "3"], "argument --batches: only for --workload prefill, not --workload decode"),
    (["--workload", "decode", "--runner", "all"], "argument --runner: only for --workload prefill, not --workload "
                                                  "decode"),
    (["--model", "gpt2"], "argument --model: invalid choice: 'gpt2' (choose from reference, hf-<family>)"),
])
def test_cli_demo_rejects_the_other_workloads_flags(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(demo_decode, "run_demo", _must_not_run)
    monkeypatch.setattr(demo_prefill, "run_prefill_demo", _must_not_run)
    assert main(["demo", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: graphslot demo ")
    assert err.splitlines()[-1] == f"graphslot demo: error: {message}"


def test_cli_prefill_demo_exits_1_on_a_mismatch(monkeypatch, capsys):
    monkeypatch.setattr(PrefillGraphRunner, "prepare_replay", lambda self, n, view, fb: None)
    monkeypatch.setattr(demo_prefill, "DEFAULT_BUCKETS", (64,))
    assert main([*PREFILL_CLI, "--batches", "6", "--runner", "breakable"]) == 1
    assert json.loads(capsys.readouterr().out)["mismatching_batches"] > 0


def test_cli_demo_registry_option(capsys):
    assert main([*PREFILL_CLI, "--registry", "interpreted", "--batches", "3",
                 "--runner", "breakable"]) == 0
    assert json.loads(capsys.readouterr().out)["registry_mode"] == "interpreted"
    assert main(["demo", "--mode", "generated"]) == 2  # the registry choice is --registry now
    assert main(["demo", "--workload", "prefill", "--max-bs", "99"]) == 2
    assert "argument --max-bs: 99 is over the limit of 48 for --workload prefill" in capsys.readouterr().err


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_backend_runs_the_demo_on_the_gpu_when_there_is_one(monkeypatch, gpu):
    monkeypatch.setattr("torch.cuda.is_available", lambda: gpu)
    assert demo_device("auto").type == ("cuda" if gpu else "cpu")
    assert demo_device("cpu").type == "cpu" and demo_device("cuda").type == "cuda"


@pytest.mark.parametrize("argv", [["--workload", "prefill"], ["--workload", "decode", "--workload", "prefill"]])
def test_cli_demo_workload_names_what_runs(monkeypatch, capsys, argv):
    """--workload names what runs (the last one given wins)."""
    calls = []

    def fake_prefill(**kwargs):
        calls.append(kwargs)
        return {"mode": "prefill", "mismatching_batches": 0}

    monkeypatch.setattr(demo_decode, "run_demo", _must_not_run)
    monkeypatch.setattr(demo_prefill, "run_prefill_demo", fake_prefill)
    assert main(["demo", *argv, "--backend", "cpu", "--batches", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"mode": "prefill", "mismatching_batches": 0}
    assert [c["batches"] for c in calls] == [2]


def test_the_removed_mode_flag_is_unknown_not_an_abbreviation_of_model(capsys):
    assert main(["demo", "--mode", "decode"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "graphslot: error: unrecognized arguments: --mode decode"


def test_cli_demo_help_names_workload_and_no_mode(capsys):
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--workload {decode,prefill}" in out and not re.search(r"--mode\b", out)


MAX_BS_WHY = "graphs are captured at sizes up to it, and their memory grows with it"
STEPS_WHY = "the demo keeps every step's batch for its report"


@pytest.mark.parametrize("argv, message", [
    (["--max-bs", "1000000"], f"argument --max-bs: 1000000 is over the limit of 256 ({MAX_BS_WHY})"),
    (["--max-bs", "257", "--dp", "2"], f"argument --max-bs: 257 is over the limit of 256 ({MAX_BS_WHY})"),
    (["--model", "hf-llama", "--max-bs", "1000000"],
     f"argument --max-bs: 1000000 is over the limit of 256 ({MAX_BS_WHY})"),
    (["--workload", "prefill", "--max-bs", "49"],
     "argument --max-bs: 49 is over the limit of 48 for --workload prefill (a batch and the 16 requests the demo "
     "keeps cached share its 64 request slots)"),
    (["--steps", "100001"], f"argument --steps: 100001 is over the limit of 100000 ({STEPS_WHY})"),
    (["--model", "hf-llama", "--steps", "9223372036854775807"],
     f"argument --steps: 9223372036854775807 is over the limit of 100000 ({STEPS_WHY})"),
    (["--workload", "prefill", "--batches", "100001"],
     "argument --batches: 100001 is over the limit of 100000 (the demo keeps every batch for its report)"),
    (["--dp", "9"], "argument --dp: 9 is over the limit of 8 (each rank is a process with a model and graphs of "
                    "its own)"),
    (["--dp", "8", "--steps", "2501"], "argument --steps: --dp 8 × --steps 2501 = 20008 rank-steps is over the "
                                       "limit of 20000 (every rank's logits of every step are kept to check)"),
])
def test_cli_demo_refuses_a_count_over_its_limit_before_building_anything(monkeypatch, capsys, argv, message):
    """`--max-bs 1000000` zero-filled a 32 GiB KV pool and captured graphs at 766 sizes,
    until the kernel killed it: every count is a usage error over its limit instead."""
    pytest.importorskip("transformers")  # the hf-llama cases: the model name is checked first
    from graphslot.cli import demo_dp, demo_hf

    for module, name in ((demo_decode, "run_demo"), (demo_prefill, "run_prefill_demo"), (demo_dp, "run_dp_demo"),
                         (demo_hf, "run_hf_demo")):
        monkeypatch.setattr(module, name, _must_not_run)
    assert main(["demo", "--backend", "cpu", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.splitlines()[-1] == f"graphslot demo: error: {message}"


@pytest.mark.parametrize("argv", [["--max-bs", "256", "--steps", "100000"], ["--workload", "prefill", "--max-bs",
                                  "48", "--batches", "100000"], ["--dp", "8", "--steps", "2500", "--max-bs", "256"]])
def test_cli_demo_takes_every_count_up_to_its_limit(monkeypatch, capsys, argv):
    from graphslot.cli import demo_dp

    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        return {"mismatching_steps": 0, "mismatching_batches": 0, "mismatching_forwards": 0, "disagreeing_steps": []}

    for module, name in ((demo_decode, "run_demo"), (demo_prefill, "run_prefill_demo"), (demo_dp, "run_dp_demo")):
        monkeypatch.setattr(module, name, fake)
    assert main(["demo", "--backend", "cpu", "--json", *argv]) == 0
    assert len(calls) == 1 and "error" not in capsys.readouterr().err
