"""benchmarks/bench_gpu_fastpath.py runs its whole logic on the CPU (--smoke): every
section fills its figures, CUDA-only ones are n/a, and the capture variants run in
their own processes."""

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_fastpath.py"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("bench_gpu_fastpath", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = tmp_path_factory.mktemp("bench") / "result.json"
    assert bench.main(["--smoke", "--json", str(path)]) == 0
    return bench, json.loads(path.read_text())


def test_fill_section_counts_one_device_op_per_generated_fill(smoke):
    _, result = smoke
    rows = result["fill"]
    assert [r["raw"] for r in rows] == [1, 3, 8] and [r["padded"] for r in rows] == [1, 4, 8]
    for r in rows:
        assert r["generated_device_ops_padded"] == r["generated_device_ops_unpadded"] == 1
        assert r["generated_us"] > 0 and r["speedup"] == pytest.approx(r["interpreted_us"] / r["generated_us"])
        assert r["generated_launches_padded"] is None  # CUDA only
    padded = next(r for r in rows if r["raw"] < r["padded"])
    assert padded["interpreted_device_ops_padded"] > 1


def test_gap_section_times_each_size_and_leaves_gpu_figures_na(smoke):
    _, result = smoke
    assert [r["bs"] for r in result["gap"]] == [1, 4, 8]
    for r in result["gap"]:
        assert r["gap_us"] is None and r["step_gpu_ms"] is None
        assert r["prep_host_us"] == pytest.approx(r["replay_host_us"] - r["graph_replay_host_us"])


def test_capture_variants_run_in_subprocesses_and_report_every_size(smoke):
    bench, result = smoke
    assert [c["variant"] for c in result["capture"]] == list(bench.VARIANTS)
    for c in result["capture"]:
        assert "error" not in c, c
        assert [p["bs"] for p in c["per_size"]] == [8, 4, 2, 1] and c["sizes"] == 4
        assert c["runner_capture_s"] > 0 and c["total"]["reserved"] is None
        # Every size keeps its own [bs, vocab] float32 logits alive (8 + 4 + 2 + 1 rows),
        # unless the graphs share one largest-size buffer.
        rows = 8 if c["variant"] == "shared-outputs" else 15
        assert c["outputs_held"] == rows * bench.CONFIG_SMOKE.vocab_size * 4
        assert c["pool"] == {"reserved": None, "allocated": None}  # the CUDA allocator's


def test_report_names_every_section(smoke):
    bench, result = smoke
    text = bench.report(result)
    for heading in ("a. fill_from + extract", "b. steady decode", "c. capture", "warmup-largest", "graphs' outputs",
                    "shared-outputs vs warmup-all"):
        assert heading in text
