"""``graphslot verify`` targets for the tests (``verify_targets:fn``): models with the
bugs verify exists to catch, and the transformers integration."""

from __future__ import annotations

import dataclasses

import torch

from graphslot.spec.loading import spec_path
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.reference.verify_target import reference_prefill_target, reference_target
from graphslot.runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from graphslot.runners.prefill import PrefillGraphRunner
from graphslot.tools.verify import VerifyTarget

OUT_CACHE_LOC_ZERO = """  - name: out_cache_loc
    shape: [max_num_tokens]
    dtype: cache_loc_dtype
    axis: tokens
    padding: zero
    index: true
"""


def keep_pad_out_cache_loc_spec(name: str = "decode") -> str:
    """The shipped spec ``name`` (decode, prefill) with the KV-slot tail left stale
    (keep_pad, not an index): padded rows then write K/V into slots real requests read."""
    text = spec_path(name).read_text()
    assert OUT_CACHE_LOC_ZERO in text
    return text.replace(OUT_CACHE_LOC_ZERO, OUT_CACHE_LOC_ZERO.replace("padding: zero\n    index: true\n",
                                                                        "padding: keep_pad\n"))


class ReadsLogitBias(ReferenceDecodeAdapter):
    """Adds ``fb.logit_bias``, a batch tensor the spec does not stage: the graph keeps
    reading the dummy batch's bias."""

    def make_dummy_batch(self, bs, num_tokens):
        fb = super().make_dummy_batch(bs, num_tokens)
        fb.logit_bias = torch.zeros(self.runtime.config.vocab_size, device=self.device)
        return fb

    def forward(self, fb):
        return super().forward(fb) + fb.logit_bias


def stale_logit_bias(max_bs: int = 4) -> VerifyTarget:
    target = reference_target("cpu", max_bs=max_bs)
    rt = target.runner.adapter.runtime
    target.runner = DecodeGraphRunner(ReadsLogitBias(rt), DecodeRunnerConfig(max_bs=max_bs, progress=False))
    make = target.make_batch

    def make_batch(raw_bs):
        fb = make(raw_bs)
        fb.logit_bias = torch.zeros(rt.config.vocab_size)
        return fb

    return VerifyTarget(target.runner, make_batch, target.release, "reads fb.logit_bias")


class ReadsHiddenBias(ReferencePrefillAdapter):
    """Adds ``fb.hidden_bias``, a batch tensor the prefill spec does not stage, to the
    layer stack's input: the graph keeps reading the dummy batch's bias."""

    def make_dummy_batch(self, num_tokens):
        fb = super().make_dummy_batch(num_tokens)
        fb.hidden_bias = torch.zeros(self.hidden_size, dtype=self.hidden_dtype, device=self.device)
        return fb

    def run_layer_stack(self, stack, hidden, view):
        return super().run_layer_stack(stack, hidden + view.hidden_bias, view)


def stale_prefill_bias(capture: str = "breakable") -> VerifyTarget:
    """A prefill target whose layer stack reads ``fb.hidden_bias`` (not a slot)."""
    target = reference_prefill_target("cpu", capture=capture)
    adapter = ReadsHiddenBias(target.runner.adapter.runtime)
    target.runner = PrefillGraphRunner(adapter, target.runner.config)
    make = target.make_batch

    def make_batch(num_tokens):
        fb = make(num_tokens)
        fb.hidden_bias = torch.zeros(adapter.hidden_size, dtype=adapter.hidden_dtype)
        return fb

    return VerifyTarget(target.runner, make_batch, target.release, "prefill reads fb.hidden_bias")


def reference_tuple():
    """The (runner, make_batch, release) form of a target."""
    t = reference_target("cpu", max_bs=4)
    return t.runner, t.make_batch, t.release


def not_a_target():
    return 42


def ignores_n():
    """A target whose make_batch(n) always makes a batch of max_bs (4) requests."""
    target = reference_target("cpu", max_bs=4)
    make = target.make_batch
    target.make_batch = lambda n: make(4)
    return target


def raises_when_called():
    raise RuntimeError("no model checkpoint configured")


def hf_target(family: str = "llama", max_bs: int = 4) -> VerifyTarget:
    """A tiny transformers model behind the HF decode adapter, ``max_bs`` requests
    prefilled; ``make_batch(n)`` is the first ``n`` rows of one decode step."""
    from graphslot.integrations.transformers import ContinuousBatcher, tiny_model
    from graphslot.integrations.transformers.batches import decode_step

    engine = ContinuousBatcher(tiny_model(family, seed=0), max_bs=max_bs, max_context_len=24, backend="cpu")
    for i in range(max_bs):
        engine.add_request([(7 * i + j) % 100 + 1 for j in range(3 + i)], max_new_tokens=8)
    engine.step()  # prefill all, decode once
    batch = list(engine.running)
    locs = [engine.cache.alloc_tokens(r.row, r.cached, 1)[0] for r in batch]
    step = decode_step(engine.cache.device, [r.output[-1] for r in batch], [r.cached for r in batch],
                       [r.row for r in batch], locs)

    def make_batch(n):
        fields = {f.name: getattr(step, f.name)[:n] for f in dataclasses.fields(step) if f.name != "batch_size"}
        return type(step)(**fields, batch_size=n)

    return VerifyTarget(engine.runner, make_batch, label=f"transformers {family}")
