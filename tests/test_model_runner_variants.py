"""ModelGraphRunner's variants bound by an adapter's ``for_variant`` (docs/dispatch.md):
a binding that cannot run its variant (the same adapter object for two variants, None,
not an adapter, or one that raises) is refused at construction, naming the adapter and
the variant; it captured one variant's forward under another's key (silently wrong
logits) or failed deep in the phase runner."""

from __future__ import annotations

import pytest
import torch

from graphslot.graphs import TapeBackend
from graphslot.runners.contract import AdapterContractError
from graphslot.runners.decode import DecodeRunnerConfig
from graphslot.runners.model_runner import ModelGraphRunner
from test_model_runner import BiasedDecode, BiasedPrefill, Biases, runtime


def biased(cls):
    rt = runtime()
    gen = torch.Generator().manual_seed(3)
    return cls(rt, {v: torch.randn(rt.config.hidden_size, generator=gen) for v in Biases.variants})


def full_runner(adapter):
    return ModelGraphRunner(adapter, None, modes=("full",), max_bs=4, backend=TapeBackend(), defer_capture=True,
                            decode_config=DecodeRunnerConfig(capture_bs=[1, 2], context_buckets=None), progress=False)


class SameDecode(BiasedDecode):
    def for_variant(self, variant):
        return self


class SamePrefill(BiasedPrefill):
    def for_variant(self, variant):
        return self


def test_one_adapter_object_bound_to_two_variants_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"^SameDecode.for_variant\('lora'\) returned the adapter it returned for "
                                         r"variant '': "):
        full_runner(biased(SameDecode))
    with pytest.raises(ValueError, match=r"^SamePrefill.for_variant\('lora'\) returned the adapter it returned for "):
        ModelGraphRunner(None, biased(SamePrefill), modes=("piecewise",), max_bs=4, max_num_tokens=16,
                         backend=TapeBackend(), defer_capture=True, progress=False)


class NoneDecode(BiasedDecode):
    def for_variant(self, variant):
        return None if variant == "lora" else super().for_variant(variant)


class TextDecode(BiasedDecode):
    def for_variant(self, variant):
        return "lora weights" if variant == "lora" else super().for_variant(variant)


def test_a_binding_that_is_not_an_adapter_is_refused_naming_the_adapter_and_variant():
    with pytest.raises(TypeError, match=r"^NoneDecode.for_variant\('lora'\) returned None, expected the adapter "):
        full_runner(biased(NoneDecode))
    with pytest.raises(AdapterContractError, match=r"^TextDecode.for_variant\('lora'\) returned str 'lora weights', "
                                                   r"not a DecodeAdapter: str \(a DecodeAdapter\) does not implement"):
        full_runner(biased(TextDecode))


class RaisingDecode(BiasedDecode):
    def for_variant(self, variant):
        if variant == "lora":
            raise KeyError("no LoRA loaded")
        return super().for_variant(variant)


def test_a_binding_that_raises_keeps_its_error_with_a_note_naming_the_adapter_and_variant():
    with pytest.raises(KeyError, match="no LoRA loaded") as exc:
        full_runner(biased(RaisingDecode))
    assert exc.value.__notes__ == ["graphslot: while binding RaisingDecode to variant 'lora' (for_variant('lora'))"]
