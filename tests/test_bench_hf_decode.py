"""benchmarks/bench_hf_decode.py, run small on the CPU: every case runs and agrees with
transformers, so the one GPU run of the real shape is not where the script is debugged."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_bench():
    return load_script("bench_hf_decode")


def test_smoke_run_measures_every_case(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "figures.json"
    assert bench.main(["--smoke", "--trace-steps", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["device"] == "cpu"
    assert result["graphslot_capture"]["sizes"] == [4, 2, 1]
    assert sorted(result["batch"], key=int) == ["1", "2", "4"]
    for row in result["batch"].values():
        assert {"hf_eager_ms", "reduce_overhead_ms", "graphslot_ms", "graphslot_speedup_vs_hf_eager",
                "graphslot_speedup_vs_reduce_overhead", "reduce_overhead_compile_s"} <= set(row)
        # graphslot's rows are transformers' rows: same model, same prompts, another cache
        assert row["graphslot_vs_hf_eager"]["top1_agreement"] == 1.0
        assert row["graphslot_vs_hf_eager"]["max_abs_diff"] < 1e-4
    trace = result["trace"]
    assert trace["steps"] == 4
    for name in ("graphslot", "reduce_overhead_per_size", "reduce_overhead_padded_to_max"):
        assert trace[name]["steady_ms_per_step"] > 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("decode step, cpu, torch ")
    assert "reduce_overhead_padded_to_max" in table and "error" not in table


def test_without_a_gpu_it_says_so(capsys):
    if load_bench().torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert load_bench().main([]) == 1
    assert capsys.readouterr().err == "bench_hf_decode: needs a CUDA GPU (or --smoke)\n"
