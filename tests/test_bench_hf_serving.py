"""benchmarks/bench_hf_serving.py, run tiny: every engine runs, every engine's tokens
equal generate's, and the report and JSON hold the figures and ratios it promises."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from test_bench_hf_decode import load_script  # noqa: E402


def load_bench():
    return load_script("bench_hf_serving")


def test_smoke_run_measures_every_engine_and_checks_their_tokens(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "figures.json"
    assert bench.main(["--smoke", "--json", str(out), "--context-buckets", "32,128"]) == 0
    result = json.loads(out.read_text())
    engines = {(r["max_bs"], r["engine"]) for r in result["runs"]}
    assert engines == {(bs, e) for bs in (2, 4) for e in ("generate", "hf_cb", "graphslot_ctx32", "graphslot_ctx128")}
    for row in result["runs"]:
        assert row["equal_to_generate"] == result["requests"] == 6
        assert row["cpu_s"] > 0 and row["tok_per_cpu_s"] == pytest.approx(result["new_tokens"] / row["cpu_s"])
        assert len(row["cpu_s_all"]) == 1  # one timed repetition after the warm-up
    assert set(result["ratios"]) == {f"bs{bs}_{name}" for bs in (2, 4) for name in (
        "ctx32_vs_generate", "ctx32_vs_hf_cb", "ctx128_vs_generate", "ctx128_vs_hf_cb", "ctx128_over_ctx32")}
    assert result["context_buckets"] == [32, 128]
    report = capsys.readouterr().out
    assert report.startswith("serving, CPU, torch ") and "bs4_ctx128_over_ctx32" in report


def test_bad_buckets_are_refused(capsys):
    with pytest.raises(SystemExit):
        load_bench().main(["--smoke", "--context-buckets", "big"])
    assert "--context-buckets takes 'auto', 'none' or lengths like 128,512,2048, got 'big'" in capsys.readouterr().err
