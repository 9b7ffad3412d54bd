"""benchmarks/bench_sglang_dropin.py runs (--smoke) and reports every size of every
runner with its ratio, and the construction times; speeds are the benchmark's business."""

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sglang_dropin.py"


def test_smoke_run_reports_each_size_with_its_ratio(tmp_path, capsys):
    import sglang_loader

    try:
        sglang_loader.load()
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"sglang's buffer registry cannot be imported: {exc}")
    spec = importlib.util.spec_from_file_location("bench_sglang_dropin", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = tmp_path / "result.json"
    assert bench.main(["--smoke", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    configs = bench.configs()
    assert [(r["runner"], r["raw_bs"], r["padded_bs"], r["raw_num_tokens"], r["padded_num_tokens"])
            for r in result["rows"]] == [(kind, *counts) for kind, c in configs.items() for counts in c["steps"]]
    for r in result["rows"]:
        assert r["sglang_us"] > 0 and r["dropin_us"] > 0
        assert r["ratio"] == pytest.approx(r["sglang_us"] / r["dropin_us"])
    assert [c["runner"] for c in result["construction"]] == list(configs)
    assert all(c["dropin_with_bind_ms"] > 0 and c["dropin_ms"] > 0 and c["sglang_ms"] > 0
               for c in result["construction"])
    out = capsys.readouterr().out
    assert "ratio" in out and "targets:" in out and out.count("x\n") >= len(result["rows"])
