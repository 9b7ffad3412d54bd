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


class CBConfig5_17:
    """transformers 5.17's ContinuousBatchingConfig signature (the GPU machine's): ``block_size``."""

    def __init__(self, block_size: int = 256, num_blocks=None, max_batch_tokens=None, max_requests_per_batch=None,
                 allow_block_sharing: bool = True, seed=None):
        pass


class CBConfig5_24:
    """5.24's: ``page_size`` (``block_size`` kept as a deprecated alias), ``auto_switch_to_flash``."""

    def __init__(self, page_size: int = 256, num_blocks=None, max_batch_tokens=None, max_requests_per_batch=None,
                 allow_block_sharing: bool = True, seed=None, auto_switch_to_flash: bool = True, block_size=None):
        pass


def test_hf_cb_config_takes_the_names_of_the_installed_transformers():
    """5.17 refused page_size= and auto_switch_to_flash= (a TypeError: no hf_cb figures on the GPU machine)."""
    bench = load_bench()
    reqs = [([1] * 300, 10), ([2] * 20, 5)]
    common = dict(num_blocks=2 + 1 + 4, max_batch_tokens=2048, max_requests_per_batch=8, allow_block_sharing=False,
                  seed=0)
    old = bench.cb_config_kwargs(CBConfig5_17, reqs, 8, 256)
    assert old == dict(block_size=256, **common)
    CBConfig5_17(**old)
    new = bench.cb_config_kwargs(CBConfig5_24, reqs, 8, 256)
    assert new == dict(page_size=256, auto_switch_to_flash=False, **common)
