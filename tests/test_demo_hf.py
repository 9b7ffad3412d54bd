"""``run_hf_demo``: every tested family decodes like transformers per request, with
requests joining and leaving; the figures are JSON and the table shows them."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")

from graphslot.cli.demo_hf import format_hf_demo_table, hf_demo_models, run_hf_demo  # noqa: E402
from graphslot.integrations.transformers import FAMILIES, TESTED_FAMILIES  # noqa: E402

HF_DEMO_MODELS = hf_demo_models()


def test_every_tested_family_has_a_demo_model():
    assert HF_DEMO_MODELS == tuple(f"hf-{family}" for family in FAMILIES)  # the tiny-model recipes
    assert {f"hf-{family}" for family in TESTED_FAMILIES} <= set(HF_DEMO_MODELS)


@pytest.mark.parametrize("model", HF_DEMO_MODELS)
def test_demo_matches_transformers_on_every_step(model):
    result = run_hf_demo(model, steps=40, backend="cpu", max_bs=8, progress=False)
    assert json.loads(json.dumps(result)) == result
    assert result["model"] == model and result["backend"] == "cpu" and result["device"] == "cpu"
    assert result["mismatching_steps"] == 0 and result["mismatch_step_ids"] == []
    # allclose (atol + rtol x |logit|) is the check; the largest logits may differ by a little over atol
    assert result["rows_checked"] > 100 and 0 < result["max_abs_diff"] < 5e-4
    assert result["captured_sizes"] == [8, 4, 2, 1]
    assert result["graph_steps"] == result["decode_steps"] >= 35
    assert len(result["batch_sizes"]) >= 4 and result["batch_size_changes"] >= 10
    assert result["requests_admitted"] > result["requests_finished"] > 5
    table = format_hf_demo_table(result)
    assert table.splitlines()[0].split() == ["metric", "value"]
    assert re.search(r"^mismatching steps +0 \(allclose", table, re.M) and f"{model}: " in table
    assert "cpu (tape), registry generated" in table


def test_demo_interpreted_registry():
    result = run_hf_demo("hf-qwen2", steps=10, backend="cpu", mode="interpreted", max_bs=4, progress=False)
    assert result["registry_mode"] == "interpreted" and result["mismatching_steps"] == 0
    assert result["layer_kinds"] == ["full_attention", "sliding_attention"]


def test_cli_hf_demo_json(capsys):
    from graphslot.cli import main

    assert main(["demo", "--model", "hf-llama", "--backend", "cpu", "--steps", "6", "--max-bs", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert {k: result[k] for k in ("mode", "model", "backend", "registry_mode", "max_bs", "steps")} == {
        "mode": "hf-decode", "model": "hf-llama", "backend": "cpu", "registry_mode": "generated", "max_bs": 2,
        "steps": 6}
    assert result["mismatching_steps"] == 0
    assert err == ("graphslot demo: hf-llama, 6 decode steps (max_bs 2), backend cpu, registry generated: "
                   "capturing, then checking each step against transformers per request\n")


@pytest.mark.parametrize("argv, message", [
    (["--model", "hf-qwen3", "--workload", "prefill"], "argument --model: hf-qwen3 runs decode only, not --workload "
                                                       "prefill"),
    (["--model", "hf-llama", "--batches", "3"], "argument --batches: only for --workload prefill, "
                                                "not --workload decode"),
    (["--model", "hf-gpt_neo"], "argument --model: invalid choice: 'hf-gpt_neo' (choose from reference, "
                             + ", ".join(f"hf-{family}" for family in FAMILIES) + ")"),
    (["--model", "hf-llama", "--dp", "2"], "argument --dp: runs the reference model only, not --model hf-llama"),
])
def test_cli_hf_demo_rejects_what_it_cannot_run(monkeypatch, capsys, argv, message):
    from graphslot.cli import demo_hf, main

    monkeypatch.setattr(demo_hf, "run_hf_demo", lambda *a, **k: pytest.fail("the demo ran"))
    assert main(["demo", *argv]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"graphslot demo: error: {message}"


def test_cli_hf_demo_exits_1_on_a_mismatch(monkeypatch, capsys):
    from graphslot.cli import main
    from graphslot.integrations.transformers import models

    monkeypatch.setattr(models, "close", lambda got, want: False)
    assert main(["demo", "--model", "hf-mistral", "--backend", "cpu", "--steps", "3", "--max-bs", "2"]) == 1
    assert re.search(r"^mismatching steps +[1-3] ", capsys.readouterr().out, re.M)


CLI_IN_4_GIB = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # the demo reached 3 GiB before it was checked
from graphslot.cli import main
from graphslot.integrations.transformers import budget
budget.free_memory = lambda device: 2 << 30  # the same on any machine
sys.exit(main(sys.argv[1:]))
"""


def test_cli_hf_demo_refuses_a_max_bs_over_its_limit_naming_the_flag():
    """--max-bs 100000 with the KV budget capped at 64 MiB: exit 2, one line naming
    --max-bs and its limit, no traceback, in a process that may not take 4 GiB (the
    engine's own memory check, below the limit, is tests/test_hf_budget.py's)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "GRAPHSLOT_MAX_KV_BYTES": str(64 << 20)}
    done = subprocess.run([sys.executable, "-c", CLI_IN_4_GIB, "demo", "--model", "hf-llama", "--backend", "cpu",
                           "--max-bs", "100000"], env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("graphslot demo: error: argument --max-bs: 100000 is over the limit of 256"), lines
    assert done.stdout == ""
