"""A runner the vLLM plugin does not replace (its refusals, seen at its first step) has its steps prepared by vLLM's
own ``_prepare_inputs``, with one WARNING naming the feature, uncounted; no vLLM needed. vLLM's own worker tests
build such runners without a worker (speculative decoding: benchmarks/vllm_worker_tests.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from graphslot.integrations.vllm import patching, runner as runner_fill

TOKEN_TO_KV_SLOT = object()


class FakeRunner:
    """What the plugin reads of a ``GPUModelRunner`` before it builds a registry (weak-referenceable, as vLLM's)."""

    def __init__(self, speculative_config=None):
        self.device = "cpu"
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(uses_mrope=False, enable_prompt_embeds=False),
            scheduler_config=SimpleNamespace(async_scheduling=False),
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            speculative_config=speculative_config, lora_config=None, use_v2_model_runner=False)
        group = SimpleNamespace(slot_mapping_mode=TOKEN_TO_KV_SLOT)
        self.input_batch = SimpleNamespace(block_table=SimpleNamespace(block_tables=[group]),
                                           prev_sampled_token_ids=None, num_reqs=2)


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


def test_an_unsupported_runner_is_handed_back_to_vllm_with_one_warning(vllms_own, caplog):
    runner = FakeRunner(speculative_config=SimpleNamespace(method="ngram"))
    steps_before = dict(runner_fill.STATS)
    with caplog.at_level(logging.WARNING, logger="graphslot"):
        for step in range(3):
            assert patching.graphslot_prepare_inputs(runner, f"output {step}", step) == "vLLM's result"
    assert vllms_own == [(runner, f"output {step}", step) for step in range(3)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "speculative decoding (speculative_config)" in message and "\n" not in message
    assert "vLLM's own _prepare_inputs" in message
    assert runner_fill.STATS == steps_before  # no step filled, no registry built
    assert runner_fill.registry_of(runner) is None


def test_each_runner_warns_for_itself(vllms_own, caplog):
    with caplog.at_level(logging.WARNING, logger="graphslot"):
        for _ in range(2):
            patching.graphslot_prepare_inputs(FakeRunner(speculative_config=SimpleNamespace()), "output", 1)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    assert len(vllms_own) == 2
