"""A runner the vLLM plugin does not replace, seen at its first step (made without a worker, or with KV-cache groups it
does not fill), has its steps prepared by vLLM's own ``_prepare_inputs``, with one WARNING naming the feature,
uncounted; no vLLM needed. vLLM's own worker tests build such runners (speculative decoding:
benchmarks/vllm_worker_tests.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from test_vllm_spec import Groups, config, fake_runner

from graphslot.integrations.vllm import patching, runner as runner_fill

TOKEN_TO_KV_SLOT = "token_to_kv_slot"  # fake_runner's slot_mapping_mode


@pytest.fixture
def vllms_own(monkeypatch):
    """vLLM's ``_prepare_inputs`` as the installed plugin keeps it: records its calls."""
    calls = []

    def stock(runner, scheduler_output, num_scheduled_tokens):
        calls.append((runner, scheduler_output, num_scheduled_tokens))
        return "vLLM's result"

    monkeypatch.setitem(patching._ORIGINALS, "prepare_inputs", stock)
    monkeypatch.setitem(patching._TOKEN_TO_KV_SLOT, "mode", TOKEN_TO_KV_SLOT)
    return calls


def spec_decode_runner():
    runner = fake_runner()
    runner.vllm_config = config(speculative_config=SimpleNamespace(method="ngram"))
    return runner


def two_group_runner():
    runner = fake_runner()
    group = runner.input_batch.block_table[0]
    runner.input_batch.block_table = Groups([group, group])
    return runner


@pytest.mark.parametrize("make, named", [
    (spec_decode_runner, "speculative decoding (speculative_config)"),
    (two_group_runner, "2 KV-cache groups (a hybrid or multi-group model; the plugin fills one)"),
])
def test_an_unsupported_runner_is_handed_back_to_vllm_with_one_warning(vllms_own, caplog, make, named):
    runner = make()
    stats_before = dict(runner_fill.STATS)
    with caplog.at_level(logging.WARNING, logger="graphslot"):
        for step in range(3):
            assert patching.graphslot_prepare_inputs(runner, f"output {step}", step) == "vLLM's result"
    assert vllms_own == [(runner, f"output {step}", step) for step in range(3)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"graphslot.integrations.vllm does not support {named} (Runner on cpu): vLLM's own "
                        "_prepare_inputs prepares this runner's steps (not counted in stats())"]
    assert runner_fill.STATS == stats_before  # no step filled, no registry built
    assert runner_fill.registry_of(runner) is None


def test_each_runner_warns_for_itself(vllms_own, caplog):
    with caplog.at_level(logging.WARNING, logger="graphslot"):
        for _ in range(2):
            patching.graphslot_prepare_inputs(spec_decode_runner(), "output", 1)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    assert len(vllms_own) == 2
