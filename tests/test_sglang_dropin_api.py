"""graphslot.integrations.sglang: its API against sglang 0.5.23's, the lazy binding that
keeps registrations off the per-step path, live params, the 0-d slot, and each
documented difference from sglang (docs/sglang.md, "Differences"), each shown next to
what sglang does."""

from __future__ import annotations

import dataclasses
import inspect
import random
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import pytest
import torch

import graphslot as gs
import sglang_loader

try:
    SGL = sglang_loader.load()
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang's buffer registry cannot be imported: {exc}", allow_module_level=True)

import graphslot.integrations.sglang as dropin
from graphslot.integrations.sglang import registry as dropin_registry

REG = SGL.registry
CPU = torch.device("cpu")
DECODE_KW = dict(device=CPU, max_bs=4, max_num_token=8, seq_len_fill_value=1, cache_loc_dtype=torch.int64,
                 share_pool=False)


@dataclasses.dataclass
class Batch:
    batch_size: int = 0
    input_ids: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    mamba_track_indices: Optional[torch.Tensor] = None
    mamba_track_mask: Optional[torch.Tensor] = None
    mamba_track_seqlens: Optional[torch.Tensor] = None
    out_cache_loc: Optional[torch.Tensor] = None
    global_num_token_non_padded: Optional[torch.Tensor] = None
    num_token_non_padded: Optional[torch.Tensor] = None
    extra: object = None


def registries(max_bs=4, max_num_tokens=8):
    return (REG.CudaGraphBufferRegistry(device=CPU, max_bs=max_bs, max_num_tokens=max_num_tokens),
            dropin.CudaGraphBufferRegistry(device=CPU, max_bs=max_bs, max_num_tokens=max_num_tokens))


def slot_pair(**kw):
    """The same slot as sglang's GraphSlot and the drop-in's (policy given by name)."""
    policy = kw.pop("padding_policy", "FOREACH_COPY")
    return (REG.GraphSlot(**kw, padding_policy=REG.PaddingPolicy[policy]),
            dropin.GraphSlot(**kw, padding_policy=dropin.PaddingPolicy[policy]))


def fill(reg, fb, raw_bs, padded_bs, raw_n, padded_n, **kw):
    reg.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_n, padded_num_tokens=padded_n, **kw)


# --- the API is sglang's ----------------------------------------------------------------

def test_classes_have_sglangs_fields_members_and_signatures():
    def fields(cls):
        def plain(default):  # the two enums' members by value
            return getattr(default, "value", default)
        return [(f.name, plain(f.default), f.repr) for f in dataclasses.fields(cls)]

    assert fields(dropin.GraphSlot) == fields(REG.GraphSlot)
    assert fields(dropin.FillContext)[:5] == fields(REG.FillContext)
    assert [f.name for f in dataclasses.fields(dropin.FillContext)][5:] == ["params"]  # the one extension
    assert [(p.name, p.value) for p in dropin.PaddingPolicy] == [(p.name, p.value) for p in REG.PaddingPolicy]
    for name in ("__init__", "register_slot", "has_slot", "get_slot", "slot_names", "fill_from", "copy_slots",
                 "extract_buffer"):
        theirs = inspect.signature(getattr(REG.CudaGraphBufferRegistry, name))
        ours = inspect.signature(getattr(dropin.CudaGraphBufferRegistry, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()], name


@pytest.mark.parametrize("factory", ["build_decode_registry", "build_prefill_registry", "build_eager_registry"])
def test_factories_take_sglangs_arguments_with_its_defaults(factory):
    theirs = inspect.signature(getattr(REG, factory)).parameters
    ours = dict(inspect.signature(getattr(dropin, factory)).parameters)
    later = ours.pop("enable_global_num_token_non_padded", None)  # the flag of later sglang versions
    assert (later is None) == (factory == "build_eager_registry")
    assert later is None or (later.kind, later.default) == (inspect.Parameter.KEYWORD_ONLY, False)
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        q = ours[name]
        assert q.kind == p.kind == inspect.Parameter.KEYWORD_ONLY, name
        if name == "attn_tp_sharded_fn":  # a lambda in sglang: compare what it answers
            assert [q.default(n) for n in (1, 8, 1024)] == [p.default(n) for n in (1, 8, 1024)] == [False] * 3
        else:
            assert q.default == p.default, name


def test_same_tensor_view_agrees_with_sglangs():
    base = torch.arange(24).reshape(4, 6)
    views = [base, base[:2], base[:, :3], base.t(), base.reshape(24)[:6], base.clone(), base[1:], base.view(6, 4)]
    for a in views:
        for b in views:
            assert dropin.same_tensor_view(a, b) == REG.same_tensor_view(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_slice_for_and_reset_padding_agree_with_sglangs_methods(seed):
    rng = random.Random(seed)
    for kw in ({"shape": (8,), "axis": "tokens"}, {"shape": (4,), "axis": "bs"}, {"shape": (2,), "axis": "none"},
               {"shape": (3, 8), "axis": "tokens", "slice_fn": lambda b, n: b[:, :n]},
               {"shape": (8, 2), "axis": "tokens"}):
        policy = rng.choice(list(REG.PaddingPolicy)).name
        kw = dict(kw)
        shape = kw.pop("shape")
        pair = slot_pair(name="x", shape_fn=lambda bs, mt, s=shape: s, dtype=torch.int64, pad_value=7,
                         padding_policy=policy, **kw)
        start = torch.randint(0, 100, shape)
        for slot in pair:
            slot.buffer = start.clone()
        raw, padded = sorted(rng.sample(range(9), 2))
        for slot in pair:
            slot.reset_padding(raw, padded)
        assert torch.equal(pair[0].buffer, pair[1].buffer)
        assert torch.equal(pair[0].slice_for(3, padded), pair[1].slice_for(3, padded))
    unallocated = slot_pair(name="x", shape_fn=lambda bs, mt: (1,), dtype=torch.int32)
    for slot in unallocated:
        with pytest.raises(RuntimeError, match="'x'"):
            slot.slice_for(1, 1)


def test_copy_slots_like_sglangs():
    for reg in registries():
        reg.register_slot(dropin.GraphSlot("ids", lambda bs, mt: (mt,), torch.int64))
        reg.register_slot(dropin.GraphSlot("off", lambda bs, mt: (bs,), torch.int64, axis="bs", enabled=False))
        buf = reg.get_slot("ids").buffer
        reg.copy_slots({"ids": torch.tensor([5, 6, 7])})
        assert buf.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
        reg.copy_slots({"ids": buf[:2]})  # its own view: nothing to copy
        assert buf.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
        with pytest.raises(KeyError):
            reg.copy_slots({"nope": torch.zeros(1)})
        with pytest.raises(TypeError):
            reg.copy_slots({"off": torch.zeros(1, dtype=torch.int64)})


# --- what register_slot and fill_from take, and the errors for what they do not ------

def test_a_bare_int_from_shape_fn_is_a_1d_shape_like_sglang():
    theirs, ours = registries()
    for reg, slot in zip((theirs, ours), slot_pair(name="input_ids", shape_fn=lambda bs, mt: mt, dtype=torch.int64,
                                                     padding_policy="ZERO")):
        reg.register_slot(slot)
        fill(reg, Batch(input_ids=torch.arange(1, 4)), 3, 3, 3, 5)
    assert ours.get_slot("input_ids").buffer.tolist() == theirs.get_slot("input_ids").buffer.tolist() == [
        1, 2, 3, 0, 0, 0, 0, 0]
    theirs, ours = registries()
    bind = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(TypeError, match="'int' object is not iterable"):  # sglang 0.5.23: tuple(shape) with bind=
        theirs.register_slot(slot_pair(name="input_ids", shape_fn=lambda bs, mt: mt, dtype=torch.int64)[0], bind=bind)
    assert ours.register_slot(slot_pair(name="input_ids", shape_fn=lambda bs, mt: mt, dtype=torch.int64)[1],
                              bind=bind).buffer is bind


def test_integer_likes_from_shape_fn_are_extents_like_sglang():
    import numpy as np

    for reg, slot in zip(registries(), slot_pair(name="rows", shape_fn=lambda bs, mt: [np.int64(mt), torch.tensor(2)],
                                                   dtype=torch.int64)):
        assert tuple(reg.register_slot(slot).buffer.shape) == (8, 2)


@pytest.mark.parametrize("extents, error, message", [
    ((4.9,), TypeError, "GraphSlot 'x': shape_fn returned (4.9,): extents must be ints, got 4.9 (float)"),
    ((8, "4"), TypeError, "GraphSlot 'x': shape_fn returned (8, '4'): extents must be ints, got '4' (str)"),
    ((True, 8), TypeError, "GraphSlot 'x': shape_fn returned (True, 8): extents must be ints, got True (bool)"),
    (None, TypeError, "GraphSlot 'x': shape_fn returned None: a shape is a tuple of ints (or one int)"),
    ((8, -1), ValueError, "GraphSlot 'x': shape_fn returned (8, -1): extents must be positive"),
    ((1 << 63,), ValueError, f"GraphSlot 'x': shape_fn returned ({1 << 63},): extents must be below 2**63"),
    ((1 << 62,), RuntimeError, f"GraphSlot 'x': cannot allocate its ({1 << 62},) int64 buffer on cpu: "),
    ((1 << 50,), RuntimeError, f"GraphSlot 'x': cannot allocate its ({1 << 50},) int64 buffer on cpu: "),
])
def test_a_shape_fn_result_that_is_no_shape_is_an_error_naming_the_slot(extents, error, message):
    """sglang hands shape_fn's result to torch.zeros, whose errors name no slot; the
    drop-in raises the same kind of error, naming the slot and the result."""
    theirs, ours = registries()
    their_slot, our_slot = slot_pair(name="x", shape_fn=lambda bs, mt: extents, dtype=torch.int64, axis="none")
    with pytest.raises((TypeError, RuntimeError)) as sglangs:  # torch.zeros's
        theirs.register_slot(their_slot)
    assert "'x'" not in str(sglangs.value)
    with pytest.raises(error) as drop_ins:
        ours.register_slot(our_slot)
    assert str(drop_ins.value).startswith(message)
    assert ours.slot_names() == [] and our_slot.buffer is None


def test_difference_a_bool_extent_is_refused_wherever_it_stands():
    """torch.zeros refuses a bool as the first extent only: sglang allocates (8, True) as (8, 1)."""
    theirs, ours = registries()
    their_slot, our_slot = slot_pair(name="x", shape_fn=lambda bs, mt: (mt, True), dtype=torch.int64)
    assert tuple(theirs.register_slot(their_slot).buffer.shape) == (8, 1)
    with pytest.raises(TypeError, match=r"^GraphSlot 'x': shape_fn returned \(8, True\): extents must be ints, got "
                                        r"True \(bool\)$"):
        ours.register_slot(our_slot)

@pytest.mark.parametrize("skip", [frozenset({"input_ids"}), {"input_ids"}, ["input_ids"], ("input_ids",),
                                  {"input_ids": None}])
def test_skip_slots_is_any_collection_of_names(skip):
    theirs, ours = registries()
    for reg, slot in zip((theirs, ours), slot_pair(name="input_ids", shape_fn=lambda bs, mt: (mt,),
                                                     dtype=torch.int64)):
        reg.register_slot(slot)
        slot.buffer.fill_(9)
        fill(reg, Batch(input_ids=torch.arange(2)), 2, 2, 2, 2, skip_slots=skip)
    assert ours.get_slot("input_ids").buffer.tolist() == theirs.get_slot("input_ids").buffer.tolist() == [9] * 8


@pytest.mark.parametrize("skip", ["input_ids", "input_ids,positions", b"input_ids"])
def test_skip_slots_as_a_bare_string_is_a_type_error_naming_the_argument(skip):
    """sglang tests ``name in skip_slots``: a str skips every slot whose name is part of
    it (a substring test); the drop-in refuses it rather than guess."""
    theirs, ours = registries()
    for reg, slot in zip((theirs, ours), slot_pair(name="input_ids", shape_fn=lambda bs, mt: (mt,),
                                                     dtype=torch.int64)):
        reg.register_slot(slot)
        slot.buffer.fill_(9)
    if isinstance(skip, str):
        fill(theirs, Batch(input_ids=torch.arange(2)), 2, 2, 2, 2, skip_slots=skip)
        assert theirs.get_slot("input_ids").buffer.tolist() == [9] * 8  # skipped: "input_ids" in skip
    for _ in range(2):  # refused every time, never cached
        with pytest.raises(TypeError) as exc:
            fill(ours, Batch(input_ids=torch.arange(2)), 2, 2, 2, 2, skip_slots=skip)
        hint = f": pass {{{skip!r}}}" if isinstance(skip, str) else ""
        assert str(exc.value) == (f"skip_slots must be a collection of slot names (a set, frozenset, list or "
                                  f"tuple), got the {type(skip).__name__} {skip!r}{hint}")
    assert ours.get_slot("input_ids").buffer.tolist() == [9] * 8
    with pytest.raises(TypeError, match=r"^skip_slots must be a collection of slot names .*, got the int 5$"):
        fill(ours, Batch(input_ids=torch.arange(2)), 2, 2, 2, 2, skip_slots=5)


# --- binding stays off the per-step path ---------------------------------------------

@pytest.fixture
def binds():
    """Counts the registry builds (graphslot.api.build) the drop-in makes."""
    with mock.patch.object(dropin_registry, "build", wraps=dropin_registry.build) as counter:
        yield counter


def test_registrations_bind_once_at_the_next_fill_never_per_registration(binds):
    reg = dropin.build_decode_registry(**DECODE_KW)
    assert binds.call_count == 0  # construction binds nothing
    fb = Batch(input_ids=torch.arange(3))
    for _ in range(5):
        fill(reg, fb, 3, 4, 3, 4)
        reg.extract_buffer(padded_bs=4, padded_num_tokens=4, forward_batch_template=fb)
    assert binds.call_count == 1
    bound = reg.graphslot
    for name in ("a", "b", "c"):
        reg.register_slot(dropin.GraphSlot(name, lambda bs, mt: (mt,), torch.int32,
                                           padding_policy=dropin.PaddingPolicy.ZERO))
    assert binds.call_count == 1
    fill(reg, fb, 3, 4, 3, 4)
    assert binds.call_count == 2 and reg.graphslot is not bound
    assert reg.graphslot.slot("c").buffer is reg.get_slot("c").buffer  # bound to the registry's buffers
    for _ in range(3):
        fill(reg, fb, 3, 4, 3, 4)
    assert binds.call_count == 2


def test_a_skip_set_is_bound_once_then_looked_up(binds):
    reg = dropin.build_decode_registry(**DECODE_KW)
    fb = Batch(input_ids=torch.arange(3), positions=torch.arange(3))
    fill(reg, fb, 3, 4, 3, 4)
    with mock.patch.object(type(reg.graphslot), "fill_from_skipping", wraps=reg.graphslot.fill_from_skipping) as var:
        for skip in (frozenset({"positions"}), frozenset({"positions"}), {"positions"}, frozenset({"positions"})):
            reg.get_slot("positions").buffer.fill_(9)
            fill(reg, fb, 3, 4, 3, 4, skip_slots=skip)
            assert reg.get_slot("positions").buffer.tolist() == [9] * 8  # no copy, no reset
        assert var.call_count == 1
        fill(reg, fb, 3, 4, 3, 4, skip_slots=frozenset({"not_a_slot"}))
        assert reg.get_slot("positions").buffer.tolist() == [0, 1, 2, 0, 9, 9, 9, 9]  # beyond padded: untouched
    assert binds.call_count == 1


def test_identical_slot_sets_share_one_compiled_module():
    import graphslot.codegen.generator as generator

    def make(scale):
        reg = dropin.CudaGraphBufferRegistry(device=CPU, max_bs=4, max_num_tokens=8)
        reg.register_slot(dropin.GraphSlot("h", lambda bs, mt: (mt,), torch.int64,
                                           post_fill=lambda buf, fb, ctx: buf.mul_(scale)))
        return reg

    first = make(2)
    first.graphslot
    with mock.patch.object(generator, "render_module", wraps=generator.render_module) as render:
        second = make(3)
        fb = Batch()
        fb.h = torch.tensor([1, 2])
        fill(second, fb, 2, 2, 2, 2)
    assert render.call_count == 0
    assert second.spec is first.spec
    assert second.get_slot("h").buffer[:2].tolist() == [3, 6]  # its own hook, bound to its own buffers
    assert second.spec.slots[0].post_fill == "sglang.post_fill.h"


# --- live params ----------------------------------------------------------------------

def test_attention_tp_rank_and_size_are_read_at_each_fill_and_only_when_sharded():
    fbi = SGL.fbi
    sharded_for = set()
    reg = dropin.build_decode_registry(**DECODE_KW, enable_num_token_non_padded=True,
                                       attn_tp_sharded_fn=lambda n: n in sharded_for)
    fb = Batch(global_num_token_non_padded=torch.tensor([7], dtype=torch.int32))
    parallel = SimpleNamespace(attn_tp_rank=0, attn_tp_size=2)
    with mock.patch.object(fbi, "get_parallel", return_value=parallel) as get_parallel:
        fill(reg, fb, 4, 4, 8, 8)
        assert get_parallel.call_count == 0 and reg.get_slot("num_token_non_padded").buffer.tolist() == [7]
        sharded_for.add(8)
        fill(reg, fb, 4, 4, 8, 8)
        assert get_parallel.call_count > 0 and reg.get_slot("num_token_non_padded").buffer.tolist() == [4]
        parallel.attn_tp_rank = 1  # the runtime context changed: seen at the next fill, no rebuild
        fill(reg, fb, 4, 4, 8, 8)
        assert reg.get_slot("num_token_non_padded").buffer.tolist() == [3]


def test_sglang_pool_is_looked_up_at_call_time(monkeypatch):
    shared = []

    def share_input_buffer(name, buffer):
        shared.append(name)
        return buffer

    monkeypatch.setattr(SGL.input_buffers, "share_input_buffer", share_input_buffer)
    reg = dropin.CudaGraphBufferRegistry(device=CPU, max_bs=2, max_num_tokens=2, share_pool=True)
    reg.register_slot(dropin.GraphSlot("ids", lambda bs, mt: (mt,), torch.int64))
    reg.register_slot(dropin.GraphSlot("pinned", lambda bs, mt: (mt,), torch.int64),
                      bind=torch.zeros(2, dtype=torch.int64))
    assert shared == ["ids"]  # bind= bypasses the pool, as in sglang


def test_share_pool_may_be_a_graphslot_share_pool():
    pool = gs.BufferPool()
    regs = [dropin.CudaGraphBufferRegistry(device=CPU, max_bs=2, max_num_tokens=4, share_pool=pool) for _ in range(2)]
    for reg in regs:
        reg.register_slot(dropin.GraphSlot("ids", lambda bs, mt: (mt,), torch.int64))
    assert regs[0].get_slot("ids").buffer.data_ptr() == regs[1].get_slot("ids").buffer.data_ptr()


class ReturnsFromShare:
    """A share pool whose ``share`` returns ``make(tensor)`` as its result."""

    def __init__(self, make):
        self.make = make

    def share(self, name, tensor, init_value=None):
        return self.make(tensor)


BAD_SHARES = {
    "too short": lambda t: (t[:1], True),
    "another dtype": lambda t: (t.to(torch.float32), True),
    "None": lambda t: (None, True),
    "a bare tensor": lambda t: t,
}


@pytest.mark.parametrize("bad", list(BAD_SHARES))
def test_a_bad_share_pool_result_is_refused_at_registration_naming_share_pool_and_the_slot(bad):
    pool = ReturnsFromShare(BAD_SHARES[bad])
    reg = dropin.CudaGraphBufferRegistry(device=CPU, max_bs=2, max_num_tokens=4, share_pool=pool)
    with pytest.raises(ValueError,
                       match=r"^GraphSlot 'ids': share_pool=ReturnsFromShare returned .*, expected ") as exc:
        reg.register_slot(dropin.GraphSlot("ids", lambda bs, mt: (mt, 2), torch.int64))
    assert "buffers=" not in str(exc.value) and not reg.has_slot("ids")
    with pytest.raises(ValueError, match=r"^GraphSlot '\w+': share_pool=ReturnsFromShare returned "):
        dropin.build_decode_registry(**{**DECODE_KW, "share_pool": pool})


class ByShape:
    """A share pool keyed by size and dtype alone: slots of other names get one tensor."""

    def __init__(self):
        self.tensors = {}

    def share(self, name, tensor, init_value=None):
        return self.tensors.setdefault((tensor.numel(), tensor.dtype), tensor).view(tensor.shape), True


def test_a_share_pool_giving_two_slots_one_tensor_is_refused_at_registration_naming_them():
    reg = dropin.CudaGraphBufferRegistry(device=CPU, max_bs=2, max_num_tokens=4, share_pool=ByShape())
    reg.register_slot(dropin.GraphSlot("ids", lambda bs, mt: (mt,), torch.int64))
    with pytest.raises(ValueError, match=r"^GraphSlot 'positions': share_pool=ByShape returned memory slot 'ids' "
                                         r"holds \(32 bytes\): "):
        reg.register_slot(dropin.GraphSlot("positions", lambda bs, mt: (mt,), torch.int64))
    assert reg.slot_names() == ["ids"]


def test_a_bad_tensor_from_sglangs_pool_is_refused_at_registration_naming_it(monkeypatch):
    monkeypatch.setattr(SGL.input_buffers, "share_input_buffer", lambda name, buffer: buffer[:1])
    with pytest.raises(ValueError, match=r"^GraphSlot '\w+': share_pool=True \(sglang's share_input_buffer\) "
                                         r"returned a torch.int\d+ tensor of shape \[1\]"):
        dropin.build_decode_registry(**{**DECODE_KW, "share_pool": True})


# --- the 0-d slot and sglang's later enable_global_num_token_non_padded -----------------

@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_global_num_token_non_padded_is_a_registry_owned_0d_slot(kind):
    kw = dict(device=CPU, max_bs=4, max_num_token=8, cache_loc_dtype=torch.int64, share_pool=False,
              enable_num_token_non_padded=True, attn_tp_sharded_fn=lambda n: True)
    build = dropin.build_decode_registry if kind == "decode" else dropin.build_prefill_registry
    if kind == "decode":
        kw["seq_len_fill_value"] = 1
    assert not build(**kw).has_slot("global_num_token_non_padded")
    reg = build(**kw, enable_global_num_token_non_padded=True)
    buf = reg.get_slot("global_num_token_non_padded").buffer
    assert buf.shape == torch.Size([]) and buf.dtype == torch.int32
    names = reg.slot_names()
    assert names.index("global_num_token_non_padded") < names.index("num_token_non_padded")
    with sglang_loader.parallel(attn_tp_rank=0, attn_tp_size=2):
        for count, local in ((100, 4), (3, 3), (0, 0), (7, 4)):
            fb = Batch(global_num_token_non_padded=torch.tensor(count, dtype=torch.int32),
                       input_ids=torch.arange(4), positions=torch.arange(4), out_cache_loc=torch.arange(4))
            fb.global_num_token_non_padded_cpu = count
            fill(reg, fb, 4, 4, 4, 8)
            view = reg.extract_buffer(padded_bs=4, padded_num_tokens=8, forward_batch_template=fb)
            assert view.global_num_token_non_padded.shape == torch.Size([])
            assert view.global_num_token_non_padded.item() == count
            assert view.global_num_token_non_padded.data_ptr() == buf.data_ptr()
            assert reg.get_slot("num_token_non_padded").buffer.tolist() == [local]


def test_a_0d_slot_from_python_works_where_sglang_0_5_23_fails():
    theirs, ours = registries()
    for reg, slot in zip((theirs, ours), slot_pair(name="scalar", shape_fn=lambda bs, mt: (), dtype=torch.int32,
                                                     axis="none")):
        reg.register_slot(slot)
    fb = Batch()
    fb.scalar = torch.tensor(42, dtype=torch.int32)
    with pytest.raises(IndexError):
        fill(theirs, fb, 2, 2, 2, 2)
    fill(ours, fb, 2, 2, 2, 2)
    assert ours.get_slot("scalar").buffer.item() == 42
    assert ours.get_slot("scalar").slice_for(2, 2) is ours.get_slot("scalar").buffer


def test_a_global_count_on_the_source_is_not_adopted():
    src = SimpleNamespace(input_ids=torch.zeros(8, dtype=torch.int64), positions=torch.zeros(8, dtype=torch.int64),
                          out_cache_loc=torch.zeros(8, dtype=torch.int64),
                          global_num_token_non_padded=torch.zeros((), dtype=torch.int32))
    reg = dropin.build_prefill_registry(device=CPU, max_bs=1, max_num_token=8, cache_loc_dtype=torch.int64,
                                        share_pool=False, source=src, enable_global_num_token_non_padded=True)
    assert reg.get_slot("input_ids").buffer.data_ptr() == src.input_ids.data_ptr()
    assert reg.get_slot("global_num_token_non_padded").buffer.data_ptr() != src.global_num_token_non_padded.data_ptr()


# --- differences from sglang, each shown against sglang --------------------------------

def test_difference_a_source_of_the_wrong_length_raises_instead_of_broadcasting():
    theirs, ours = registries()
    for reg, slot in zip((theirs, ours), slot_pair(name="seq_lens", shape_fn=lambda bs, mt: (bs,),
                                                     dtype=torch.int64, axis="bs")):
        reg.register_slot(slot)
    fb = Batch(seq_lens=torch.tensor([9]))
    fill(theirs, fb, 3, 4, 3, 4)
    assert theirs.get_slot("seq_lens").buffer.tolist() == [9, 9, 9, 0]  # broadcast into every real row
    with pytest.raises(gs.SlotError, match=r"slot 'seq_lens': expected shape \[3\], got \[1\]"):
        fill(ours, fb, 3, 4, 3, 4)
    assert ours.get_slot("seq_lens").buffer.tolist() == [0, 0, 0, 0]  # nothing written


def test_a_non_tensor_field_is_skipped_and_its_view_exposed_like_sglang():
    theirs, ours = registries()
    for reg, slot in zip((theirs, ours), slot_pair(name="input_ids", shape_fn=lambda bs, mt: (mt,),
                                                     dtype=torch.int64)):
        reg.register_slot(slot)
        slot.buffer.fill_(4)
    fb = Batch(input_ids=[1, 2, 3])
    views = []
    for reg in (theirs, ours):
        fill(reg, fb, 3, 3, 3, 3)
        views.append(reg.extract_buffer(padded_bs=3, padded_num_tokens=3, forward_batch_template=fb))
    assert [v.input_ids.tolist() for v in views] == [[4, 4, 4]] * 2  # not copied; the buffer's view exposed
    assert views[1].input_ids.data_ptr() == ours.get_slot("input_ids").buffer.data_ptr()


def test_difference_fill_sentinel_without_pad_value_fails_at_registration():
    theirs, ours = registries()
    their_slot, our_slot = slot_pair(name="s", shape_fn=lambda bs, mt: (bs,), dtype=torch.int32, axis="bs",
                                     padding_policy="FILL_SENTINEL")
    theirs.register_slot(their_slot)
    with pytest.raises(RuntimeError, match="FILL_SENTINEL requires pad_value"):
        fill(theirs, Batch(), 1, 2, 1, 2)
    with pytest.raises(ValueError, match="GraphSlot 's': FILL_SENTINEL requires pad_value"):
        ours.register_slot(our_slot)
    assert not ours.has_slot("s")


@pytest.mark.parametrize("slice_fn, message", [
    (lambda buf, n: buf.t()[:n], "slice_fn is not the first n entries of one dimension"),
    (lambda buf, n: buf[:n].clone(), "slice_fn is not the first n entries of one dimension"),
    (lambda buf, n: buf[1:n + 1], "slice_fn is not the first n entries of one dimension"),
    (lambda buf, n: buf[:n], "sglang resets a slice_fn slot's tail along its last dimension"),
])
def test_difference_a_slice_fn_graphslot_cannot_express_is_refused_at_registration(slice_fn, message):
    ours = dropin.CudaGraphBufferRegistry(device=CPU, max_bs=4, max_num_tokens=8)
    with pytest.raises(ValueError, match=message):
        ours.register_slot(dropin.GraphSlot("x", lambda bs, mt: (mt, 8), torch.int64, slice_fn=slice_fn,
                                            padding_policy=dropin.PaddingPolicy.ZERO))
    assert ours.slot_names() == []
    ours.register_slot(dropin.GraphSlot("x", lambda bs, mt: (mt, 8), torch.int64, slice_fn=dropin.SliceDim(0),
                                        padding_policy=dropin.PaddingPolicy.ZERO))
    assert ours.spec.slots[0].slice_dim == 0


@pytest.mark.parametrize("kwargs, bind, message", [
    (dict(device=torch.device("meta")), None, "device meta is neither the registry's"),
    (dict(shape_fn=lambda bs, mt: (3, mt), slice_fn=lambda b, n: b[:, :n], source_fn=lambda fb, ctx: None),
     None, "copies a source_fn result along dimension 0, but the slot slices dimension 1"),
    (dict(shape_fn=lambda bs, mt: (mt + 1,)), None, "extent must be max_num_tokens=8"),
    (dict(axis="bs", shape_fn=lambda bs, mt: ()), None, "a 0-d buffer cannot be sliced"),
    (dict(name="batch_size"), None, "batch_size"),
    (dict(name="a-b"), None, "a-b"),
    (dict(padding_policy=dropin.PaddingPolicy.FILL_SENTINEL, pad_value=1.5), None, "does not fit dtype int64"),
    (dict(), torch.zeros(8, dtype=torch.int64, device="meta"), "is on meta, expected cpu"),
])
def test_difference_what_a_graphslot_spec_cannot_say_is_a_value_error_at_registration(kwargs, bind, message):
    ours = dropin.CudaGraphBufferRegistry(device=CPU, max_bs=4, max_num_tokens=8)
    slot = dropin.GraphSlot(**{"name": "x", "shape_fn": lambda bs, mt: (mt,), "dtype": torch.int64, **kwargs})
    with pytest.raises(ValueError, match=message):
        ours.register_slot(slot, bind=bind)
    assert ours.slot_names() == [] and slot.buffer is None
    theirs = REG.CudaGraphBufferRegistry(device=CPU, max_bs=4, max_num_tokens=8)
    if "device" not in kwargs and bind is None:  # sglang takes each of these
        theirs.register_slot(REG.GraphSlot(**{"name": "x", "shape_fn": lambda bs, mt: (mt,), "dtype": torch.int64,
                                              **{k: v for k, v in kwargs.items() if k != "padding_policy"}}))


def test_difference_changing_a_slot_after_registration_changes_nothing():
    theirs, ours = registries()
    pair = slot_pair(name="positions", shape_fn=lambda bs, mt: (mt,), dtype=torch.int64, padding_policy="ZERO")
    for reg, slot in zip((theirs, ours), pair):
        reg.register_slot(slot)
        slot.padding_policy = type(slot.padding_policy).KEEP_PAD
        slot.buffer.fill_(5)
        fill(reg, Batch(positions=torch.arange(2)), 2, 4, 2, 4)
    assert theirs.get_slot("positions").buffer.tolist() == [0, 1, 5, 5, 5, 5, 5, 5]  # read at each fill
    assert ours.get_slot("positions").buffer.tolist() == [0, 1, 0, 0, 5, 5, 5, 5]  # snapshot at registration


def test_difference_prefill_mamba_index_tails_are_zeroed():
    src_kw = dict(device=CPU, max_bs=4, max_num_token=8, cache_loc_dtype=torch.int64, share_pool=False,
                  enable_mamba_track=True)
    theirs, ours = REG.build_prefill_registry(**src_kw), dropin.build_prefill_registry(**src_kw)
    fb = Batch(mamba_track_indices=torch.tensor([3, 4]), mamba_track_mask=torch.tensor([True, False]),
               mamba_track_seqlens=torch.tensor([5, 6], dtype=torch.int32))
    for reg in (theirs, ours):
        for name in ("mamba_track_indices", "mamba_track_mask", "mamba_track_seqlens"):
            reg.get_slot(name).buffer.fill_(1)
        fill(reg, fb, 2, 4, 2, 4)  # a padded batch size: never on sglang's prefill path
    assert theirs.get_slot("mamba_track_indices").buffer.tolist() == [3, 4, 1, 1]
    assert ours.get_slot("mamba_track_indices").buffer.tolist() == [3, 4, 0, 0]
    assert ours.get_slot("mamba_track_mask").buffer.tolist() == [True, False, False, False]
    assert ours.get_slot("mamba_track_seqlens").buffer.tolist() == [5, 6, 1, 1]  # not an index: as sglang
    fill(ours, fb, 2, 2, 2, 4)
    fill(theirs, fb, 2, 2, 2, 4)
    assert ours.get_slot("mamba_track_indices").buffer[:2].tolist() == [3, 4]


def test_difference_the_view_is_a_copy_without_init():
    calls = []

    @dataclasses.dataclass
    class Checked(Batch):
        def __post_init__(self):
            calls.append(self.batch_size)

    theirs, ours = registries()
    for reg, slot in zip((theirs, ours), slot_pair(name="input_ids", shape_fn=lambda bs, mt: (mt,),
                                                     dtype=torch.int64)):
        reg.register_slot(slot)
    fb = Checked(batch_size=2, input_ids=torch.arange(2), extra="kept")
    calls.clear()
    views = [r.extract_buffer(padded_bs=2, padded_num_tokens=2, forward_batch_template=fb) for r in (theirs, ours)]
    assert calls == [2]  # sglang's dataclasses.replace ran __post_init__; the drop-in's copy did not
    assert [v.extra for v in views] == ["kept", "kept"] and type(views[1]) is Checked
    assert torch.equal(views[0].input_ids, views[1].input_ids)


def test_difference_source_fns_run_before_any_write():
    """sglang calls source_fn after resetting tails; graphslot reads every source first."""
    theirs, ours = registries()
    for module, reg in ((REG, theirs), (dropin, ours)):
        reg.register_slot(module.GraphSlot("a", lambda bs, mt: (mt,), torch.int64,
                                           padding_policy=module.PaddingPolicy.ZERO))
        a = reg.get_slot("a")
        reg.register_slot(module.GraphSlot("b", lambda bs, mt: (mt,), torch.int64,
                                           source_fn=lambda fb, ctx, a=a: a.buffer[2:4].clone()))
        a.buffer.fill_(6)
        fill(reg, Batch(), 2, 4, 2, 4)
    assert theirs.get_slot("b").buffer[:2].tolist() == [0, 0]
    assert ours.get_slot("b").buffer[:2].tolist() == [6, 6]


def test_difference_zero_width_buffers_are_refused():
    kw = dict(device=CPU, max_bs=1, max_num_token=8, cache_loc_dtype=torch.int64, share_pool=False,
              is_multimodal=True)  # hidden_size=0 by default
    assert tuple(REG.build_prefill_registry(**kw).get_slot("input_embeds").buffer.shape) == (8, 0)
    with pytest.raises(ValueError, match="input_embeds.*extents must be positive"):
        dropin.build_prefill_registry(**kw)


def test_difference_eager_registry_does_not_read_the_dp_size(monkeypatch):
    def unavailable():
        raise RuntimeError("no parallel state in this process")

    monkeypatch.setattr(REG, "get_parallel", unavailable)
    kw = dict(device=CPU, max_bs=2, max_num_token=4, cache_loc_dtype=torch.int64)
    with pytest.raises(RuntimeError, match="no parallel state"):
        REG.build_eager_registry(**kw)
    SGL.input_buffers._forward_input_buffer_pool.clear()
    try:
        reg = dropin.build_eager_registry(**kw)
    finally:
        SGL.input_buffers._forward_input_buffer_pool.clear()
    assert not reg.has_slot("global_num_tokens_gpu")


def test_difference_a_rank_outside_its_group_is_an_error_when_sharded():
    reg = dropin.build_decode_registry(**DECODE_KW, enable_num_token_non_padded=True,
                                       attn_tp_sharded_fn=lambda n: True)
    fb = Batch(global_num_token_non_padded=torch.tensor([7], dtype=torch.int32))
    with sglang_loader.parallel(attn_tp_rank=2, attn_tp_size=2):
        with pytest.raises(gs.SlotError, match=r"attn_tp_rank=2 must lie in \[0, attn_tp_size=2\)"):
            fill(reg, fb, 4, 4, 8, 8)
