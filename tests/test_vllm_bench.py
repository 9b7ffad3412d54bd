"""benchmarks/bench_vllm_inputs.py --smoke inside vLLM 0.32 (skipped without vllm; .ci/vllm runs it in .venv-vllm):
every step is prepared by both implementations, which leave the same inputs, and each is timed."""

from __future__ import annotations

import json
import os

import pytest

from test_bench_hf_decode import load_script

pytest.importorskip("vllm", reason="vllm not installed; CI runs it in .venv-vllm")


def test_smoke_run_times_both_on_every_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    monkeypatch.delenv("GRAPHSLOT_VLLM", raising=False)
    out = tmp_path / "figures.json"
    assert load_script("bench_vllm_inputs").main(["--smoke", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    steps = figures["per_step"]
    assert len(steps) > 10 and figures["total_ms"]["steps"] == len(steps) - 1
    assert {step["decode_only"] for step in steps} == {True, False}
    for step in steps:
        for name in ("stock", "stock_slot_mapping", "graphslot"):
            assert step[name] > 0, (name, step)
        assert step["stock_slot_mapping"] < step["stock"]
    assert abs(figures["ratio"] - figures["total_ms"]["graphslot"] / figures["total_ms"]["stock"]) < 2e-3
    table = capsys.readouterr().out
    assert "\n_prepare_inputs per step, vLLM 0.32.0" in table and "ratio graphslot / stock = " in table
