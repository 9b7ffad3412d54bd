"""Split-op handles (``runners.piecewise.op_handle``) hold their objects weakly: a model
whose runner was released and dropped is freed, whatever named its parts to a split op."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from graphslot.reference import build_reference_model, make_extend_batch
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners import PrefillGraphRunner
from graphslot.runners.piecewise import op_handle, op_object


class Thing:
    pass


def test_a_handle_names_its_object_while_it_lives():
    thing = Thing()
    handle = op_handle(thing)
    assert op_handle(thing) == handle and op_object(handle) is thing
    other = Thing()
    assert op_handle(other) != handle and op_object(op_handle(other)) is other


def test_a_handle_does_not_keep_its_object_alive():
    thing = Thing()
    handle = op_handle(thing)
    ref = weakref.ref(thing)
    del thing
    gc.collect()
    assert ref() is None
    with pytest.raises(LookupError, match=rf"^split-op handle {handle} names an object that was freed"):
        op_object(handle)


def test_an_unknown_handle_is_a_clear_error():
    with pytest.raises(LookupError, match=r"^split-op handle -5 was never given out by op_handle\(\)"):
        op_object(-5)


@pytest.mark.parametrize("capture", ["breakable", "piecewise"])
def test_a_released_reference_runner_frees_its_model(capture):
    rt = build_reference_model(max_num_reqs=8)
    runner = PrefillGraphRunner(ReferencePrefillAdapter(rt), capture=capture, token_buckets=[16], progress=False)
    fb = make_extend_batch(rt, rt.req_to_token_pool.alloc(2), [0, 0], [[1, 2, 3], [4, 5]])
    runner(fb)
    refs = [weakref.ref(rt.attn_backend), weakref.ref(rt.token_to_kv_pool.k_buffer[0]),
            weakref.ref(rt.model.layers[0].self_attn.qkv_proj.weight)]
    runner.release()
    del runner, rt, fb
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_a_routed_transformers_model_is_freed():
    pytest.importorskip("transformers")
    from graphslot.integrations.transformers import tiny_model
    from graphslot.integrations.transformers.attention import route_attention

    model = tiny_model("llama")
    route_attention(model)
    attention = model.model.layers[0].self_attn
    ref = weakref.ref(attention.q_proj.weight)
    assert op_object(attention._graphslot_handle) is attention
    del model, attention
    gc.collect()
    assert ref() is None
    torch.compiler.reset()


def test_an_object_without_weak_references_is_a_clear_error():
    with pytest.raises(TypeError, match=r"^op_handle\(\) needs an object that takes weak references; a dict does not"):
        op_handle({})
