"""The 1.0 API (docs/api.md): one keyword-only ``build_registry``, ``buffers=`` the one
answer to where the static tensors come from, keyword-only step counts in every impl."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

import graphslot as gs
from graphslot.generated import decode_default
from graphslot.runners import DecodeGraphRunner

IMPLS = ["generated", "interpreted", decode_default]


def test_build_registry_takes_the_spec_then_at_most_seven_keywords_and_device_has_no_default():
    params = inspect.signature(gs.build_registry).parameters
    assert len(params) <= 8
    first, *rest = params.values()
    assert first.name == "spec" and first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest)
    assert params["device"].default is inspect.Parameter.empty
    with pytest.raises(TypeError, match="device"):
        gs.build_registry("decode", max_bs=4, max_num_tokens=4)  # noqa
    with pytest.raises(TypeError, match="positional"):
        gs.build_registry("decode", 4, 4, device="cpu")  # noqa


@pytest.mark.parametrize("impl", IMPLS, ids=["generated", "interpreted", "module"])
@pytest.mark.parametrize("strict", ["0", "1"])
def test_fill_from_and_extract_refuse_positional_counts(impl, strict, monkeypatch):
    """A swapped bs/tokens pair cannot pass silently: the counts are keyword-only, as in
    sglang's registry, whatever implements the registry (strict mode wraps it)."""
    monkeypatch.setenv("GRAPHSLOT_STRICT", strict)
    reg = gs.build_registry("decode", device="cpu", max_bs=4, max_num_tokens=4, impl=impl)
    assert reg.strict is (strict == "1")
    ids = torch.tensor([7, 8])
    fb = SimpleNamespace(batch_size=2, input_ids=ids, positions=ids, out_cache_loc=ids, req_pool_indices=ids,
                         seq_lens=ids, seq_lens_cpu=ids)
    with pytest.raises(TypeError, match="positional argument"):
        reg.fill_from(fb, 2, 4, 2, 4)
    with pytest.raises(TypeError, match="positional argument"):
        reg.extract(fb, 4, 4)
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.extract(fb, padded_bs=4, padded_num_tokens=4).seq_lens.tolist() == [7, 8, 1, 1]


def test_buffers_shares_through_a_pool_or_adopts_an_engines_tensors():
    pool = gs.BufferPool()
    a, b = (gs.build_registry("decode", device="cpu", max_bs=4, max_num_tokens=4, buffers=pool) for _ in range(2))
    assert a.slot("seq_lens").buffer.data_ptr() == b.slot("seq_lens").buffer.data_ptr()
    owned = {s.name: s.buffer.clone() for s in a.active}
    c = gs.build_registry("decode", device="cpu", max_bs=4, max_num_tokens=4, buffers=owned)
    assert all(c.slot(name).buffer is tensor for name, tensor in owned.items())


def test_a_runner_config_names_the_registry_impl_impl_and_refuses_mode():
    import dataclasses

    from graphslot.runners import DecodeRunnerConfig, PrefillRunnerConfig

    for config in (DecodeRunnerConfig, PrefillRunnerConfig):
        names = {f.name for f in dataclasses.fields(config)}
        assert "impl" in names and "mode" not in names
    with pytest.raises(TypeError, match="mode"):
        DecodeGraphRunner(object(), mode="interpreted")
