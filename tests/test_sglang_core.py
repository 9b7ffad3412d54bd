"""The core features graphslot's sglang drop-in builds on (issue 24), in both modes:
0-d slots, ``absent_fields: skip``, ``live`` params, ``adopt: never``, the SharePool
protocol, ``fill_from_skipping``, ``build_registry(buffers=, context=)``. The contract
is graphslot/slot_specs/README.md; specs from code and the construction caches are in
tests/test_spec_from_code.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import graphslot as gs
from graphslot.api import build as build_full
from conftest import make_slot_yaml, parse, spec_error
from test_registry_semantics import poison, t

MODES = ("interpreted", "generated")
LIVE_SPEC_TEXT = """\
    name: sharded
    params:
      enable_prefill_cp: {type: bool, default: false}
      attn_tp_sharded: {type: bool, default: false, live: true}
      attn_tp_rank: {type: int, default: 0, live: true}
      attn_tp_size: {type: int, default: 1, live: true}
    slots:
      - name: num_token_non_padded
        shape: [1]
        dtype: int32
        axis: none
        copy_from_fb: false
        post_fill: local_num_token_non_padded
"""


def build(text_or_spec: Any, mode: str, max_bs: int = 4, max_num_tokens: int = 8, **kwargs) -> gs.SlotRegistry:
    spec = parse(text_or_spec) if isinstance(text_or_spec, str) else text_or_spec
    return build_full(spec, device="cpu", max_bs=max_bs, max_num_tokens=max_num_tokens, impl=mode, **kwargs)


# --- 0-d slots ----------------------------------------------------------------------------

ZERO_D = """\
    name: scalar
    slots:
      - name: count
        shape: []
        dtype: int32
        axis: none
      - name: fed
        shape: []
        dtype: int64
        axis: none
        source: feed
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_0d_slot_copies_a_0d_value_and_extract_exposes_the_buffer_itself(mode):
    reg = build(ZERO_D, mode, hooks={"feed": lambda fb, ctx: fb.feed})
    buffer = reg.slot("count").buffer
    assert buffer.shape == torch.Size([]) and reg.slot("fed").buffer.shape == torch.Size([])
    fb = SimpleNamespace(count=torch.tensor(100, dtype=torch.int32), feed=torch.tensor(-5))
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=8)
    assert buffer.item() == 100 and reg.slot("fed").buffer.item() == -5
    view = reg.extract(fb, padded_bs=4, padded_num_tokens=8)
    assert view.count is buffer and view.count.shape == torch.Size([])
    assert reg.slot("count").slice_for(4, 8) is buffer
    fb.feed = None  # a source hook's None: no copy
    fb.count = torch.tensor(7, dtype=torch.int32)
    reg.fill_from(fb, raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert buffer.item() == 7 and reg.slot("fed").buffer.item() == -5


@pytest.mark.parametrize("mode", MODES)
def test_a_0d_slot_refuses_a_one_element_tensor(mode):
    reg = build(ZERO_D, mode, hooks={"feed": lambda fb, ctx: fb.feed})
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(SimpleNamespace(count=t(3, dtype=torch.int32), feed=None),
                      raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert str(err.value) == ("spec 'scalar', slot 'count': expected shape [], got [1] (copy_ would broadcast "
                              "or fail)")
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(SimpleNamespace(count=torch.tensor(1, dtype=torch.int32), feed=t(3)),
                      raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert str(err.value) == ("spec 'scalar', slot 'fed': expected shape [], got [1] (copy_ would broadcast or "
                              "fail)")


def test_a_0d_slot_must_be_unsliced():
    assert spec_error(make_slot_yaml(shape=[])) == [
        "spec.yaml:4: slot 'x': a 0-d slot (shape: []) has no dimension to slice: use axis 'none', not 'bs'"]
    assert spec_error(make_slot_yaml(shape=[], axis="none", padding=None, slice_dim=1)) == [
        "spec.yaml:7: slot 'x': a 0-d slot (shape: []) has no dimension to slice; remove slice_dim"]


def test_the_schema_allows_an_empty_shape():
    schema = gs.RegistrySpec.model_json_schema()
    assert "minItems" not in schema["$defs"]["SlotSpec"]["properties"]["shape"]


# --- absent_fields: skip ----------------------------------------------------------------

SKIPPING = """\
    name: lenient
    absent_fields: skip
    slots:
      - name: ids
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
      - name: lens
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: fill_sentinel
        pad_value: 1
      - name: computed
        shape: [1]
        dtype: int32
        axis: none
        post_fill: count_non_padded_tokens
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("absent", ["missing", None, "a string", 3])
def test_absent_fields_skip_leaves_the_head_and_resets_the_tail(mode, absent):
    reg = build(SKIPPING, mode)
    poison(reg, 9)
    fb = SimpleNamespace(lens=t(5, 6), computed=None)
    if absent != "missing":
        fb.ids = absent
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert reg.slot("ids").buffer.tolist() == [9, 9, 0, 9]  # no copy; the tail [2:3] reset
    assert reg.slot("lens").buffer.tolist() == [5, 6, 1, 9]
    assert reg.slot("computed").buffer.tolist() == [2]  # copied slots with a hook are skipped too, the hook runs
    view = reg.extract(fb, padded_bs=3, padded_num_tokens=3)
    if absent is None or absent == "missing":
        assert getattr(view, "ids", "missing") == (None if absent is None else "missing")  # carried
    else:  # a non-tensor: the view is the slot's (unwritten) head, as sglang's registry exposes it
        assert view.ids.tolist() == [9, 9, 0]
    assert view.lens.tolist() == [5, 6, 1]


@pytest.mark.parametrize("mode", MODES)
def test_absent_fields_error_is_the_default_and_names_the_slot(mode):
    reg = build(SKIPPING.replace("    absent_fields: skip\n", ""), mode)
    assert reg.spec.absent_fields == "error"
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(SimpleNamespace(ids="a string", lens=t(1), computed=t(0, dtype=torch.int32)),
                      raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert str(err.value) == "spec 'lenient', slot 'ids': expected a torch.Tensor, got str 'a string'"


def test_the_shipped_specs_keep_absent_fields_error():
    assert {name: gs.load_spec(name).absent_fields for name in gs.shipped_spec_names()} == {
        "decode": "error", "prefill": "error", "vllm": "error"}


def test_absent_fields_takes_error_or_skip():
    text = "name: t\nabsent_fields: maybe\n" + make_slot_yaml().split("\n", 1)[1]
    assert spec_error(text) == ["spec.yaml:2: bad value for 'absent_fields': input should be 'error' or 'skip' "
                                "(got 'maybe')"]


# --- live params --------------------------------------------------------------------------


class Calls:
    """Providers that record which params were read, with the context they got."""

    def __init__(self, sharded=True, rank=1, size=2):
        self.values, self.seen = {"attn_tp_sharded": sharded, "attn_tp_rank": rank, "attn_tp_size": size}, []

    def providers(self):
        return {name: (lambda ctx, name=name: self.read(name, ctx)) for name in self.values}

    def read(self, name, ctx):
        self.seen.append((name, ctx.padded_num_tokens))
        return self.values[name]


@pytest.mark.parametrize("mode", MODES)
def test_live_params_are_read_at_fill_once_each_and_only_on_the_branch_that_needs_them(mode):
    calls = Calls()
    reg = build(LIVE_SPEC_TEXT, mode, params=calls.providers())
    assert calls.seen == []  # nothing read at build
    buffer = reg.slot("num_token_non_padded").buffer
    reg.fill_from(SimpleNamespace(global_num_token_non_padded=None, num_token_non_padded=t(3)),
                  raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=8)
    assert calls.seen == [] and buffer.tolist() == [3]  # no global count: nothing sharded to decide
    reg.fill_from(SimpleNamespace(global_num_token_non_padded=torch.tensor(7)),
                  raw_bs=3, padded_bs=4, raw_num_tokens=7, padded_num_tokens=8)
    # rank 1 of 2 on 8 padded tokens: rows [4, 8), 7 real -> 3
    assert buffer.tolist() == [3]
    assert calls.seen == [("attn_tp_sharded", 8), ("attn_tp_rank", 8), ("attn_tp_size", 8)]
    calls.seen.clear()
    calls.values["attn_tp_sharded"] = False  # a per-bucket predicate: decided again at every fill
    reg.fill_from(SimpleNamespace(global_num_token_non_padded=torch.tensor(7)),
                  raw_bs=3, padded_bs=4, raw_num_tokens=7, padded_num_tokens=8)
    assert buffer.tolist() == [7] and calls.seen == [("attn_tp_sharded", 8)]  # rank and size not read


@pytest.mark.parametrize("mode", MODES)
def test_live_params_with_plain_values_are_decided_at_build(mode):
    reg = build(LIVE_SPEC_TEXT, mode, params={"attn_tp_sharded": True, "attn_tp_rank": 0, "attn_tp_size": 2})
    reg.fill_from(SimpleNamespace(global_num_token_non_padded=torch.tensor(7)),
                  raw_bs=3, padded_bs=4, raw_num_tokens=7, padded_num_tokens=8)
    assert reg.slot("num_token_non_padded").buffer.tolist() == [4]
    with pytest.raises(gs.SpecError) as err:
        build(LIVE_SPEC_TEXT, mode, params={"attn_tp_sharded": True, "attn_tp_rank": 2, "attn_tp_size": 2})
    assert str(err.value) == ("spec.yaml:13: slot 'num_token_non_padded': attn_tp_rank=2 must lie in "
                              "[0, attn_tp_size=2) when the non-padded count is sharded (attn_tp_sharded)")


@pytest.mark.parametrize("mode", MODES)
def test_a_live_rank_out_of_range_is_a_slot_error_at_the_fill(mode):
    reg = build(LIVE_SPEC_TEXT, mode, params=Calls(rank=5).providers())
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(SimpleNamespace(global_num_token_non_padded=torch.tensor(7)),
                      raw_bs=3, padded_bs=4, raw_num_tokens=7, padded_num_tokens=8)
    assert str(err.value) == ("slot 'num_token_non_padded': attn_tp_rank=5 must lie in [0, attn_tp_size=2) "
                              "when the non-padded count is sharded (attn_tp_sharded)")


@pytest.mark.parametrize("mode", MODES)
def test_enable_prefill_cp_never_reads_the_live_predicate(mode):
    calls = Calls()
    reg = build(LIVE_SPEC_TEXT, mode, params=dict(calls.providers(), enable_prefill_cp=True))
    reg.fill_from(SimpleNamespace(global_num_token_non_padded=torch.tensor(7)),
                  raw_bs=3, padded_bs=4, raw_num_tokens=7, padded_num_tokens=8)
    assert calls.seen == [] and reg.slot("num_token_non_padded").buffer.tolist() == [7]


USER_LIVE = """\
    name: user
    params:
      scale: {type: int, default: 2, live: true}
    slots:
      - name: out
        shape: [1]
        dtype: int64
        axis: none
        copy_from_fb: false
        post_fill: scaled
        pre_capture: at_capture
"""


@pytest.mark.parametrize("mode", MODES)
def test_user_hooks_read_live_params_through_ctx_params(mode):
    seen = []

    def scaled(buffer, fb, ctx):
        buffer.fill_(ctx.params["scale"] + ctx.params["scale"])  # read twice: provided once

    def at_capture(buffer, ctx):
        seen.append(("capture", ctx.params["scale"]))

    def provider(ctx):
        seen.append(type(ctx).__name__)
        return ctx.raw_bs * 10 if hasattr(ctx, "raw_bs") else ctx.bs

    hooks = {"scaled": scaled, "at_capture": at_capture}
    reg = build(USER_LIVE, mode, params={"scale": provider}, hooks=hooks)
    reg.fill_from(SimpleNamespace(), raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert reg.slot("out").buffer.tolist() == [60] and seen == ["FillContext"]
    reg.run_pre_capture(4, 4)
    assert seen == ["FillContext", "CaptureContext", ("capture", 4)]
    plain = build(USER_LIVE, mode, params={"scale": 5}, hooks=hooks)
    plain.fill_from(SimpleNamespace(), raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert plain.slot("out").buffer.tolist() == [10]


@pytest.mark.parametrize("keys, error", [
    ({"params": {"w": {"type": "int", "default": 2, "live": True}}, "shape": ["max_bs", "w"]},
     "spec.yaml:6: slot 'x': shape[1] uses live param 'w'"),
    ({"params": {"v": {"type": "int", "default": 2, "live": True}}, "padding": "fill_sentinel", "pad_value": "v"},
     "spec.yaml:10: slot 'x': pad_value uses live param 'v'"),
    ({"params": {"flag": {"type": "bool", "default": True, "live": True}}, "enabled_if": "flag"},
     "spec.yaml:10: slot 'x': enabled_if uses live param 'flag'"),
    ({"params": {"v": {"type": "int", "default": 2, "live": True}, "u": {"type": "int", "default": "v + 1"}}},
     "spec.yaml:4: the default of param 'u' uses live param 'v'"),
])
def test_only_hooks_may_read_live_params(keys, error):
    assert spec_error(make_slot_yaml(**keys)) == [
        error + ": live params are evaluated at fill time by the hooks that read them (ctx.params), so shapes, "
                "dtypes, enabled_if, pad values and other params' defaults cannot use them"]


def test_a_live_param_is_not_runtime_nor_a_dtype():
    assert spec_error(make_slot_yaml(params={"v": {"type": "int", "default": 2, "live": True, "runtime": True}})) == [
        "spec.yaml:3: param 'v' cannot be both runtime and live: a runtime param is bound with the registry, a "
        "live one read by hooks at each fill"]
    assert spec_error(make_slot_yaml(params={"v": {"type": "dtype", "default": "int32", "live": True}})) == [
        "spec.yaml:3: live param 'v' must be int, float, bool or str: a dtype decides what is allocated, and "
        "live params are read only by hooks"]


def test_a_provider_for_a_param_that_is_not_live_says_which_params_take_one():
    spec = parse(make_slot_yaml(params={"n": {"type": "int", "default": 2}}))

    def provider(ctx):
        return 1

    with pytest.raises(gs.SpecError) as err:
        gs.resolve_params(spec, {"n": provider})
    assert str(err.value) == (f"spec.yaml:3: param 'n' is int, got function {provider!r}; a provider (a callable "
                              "read at fill time) is only taken by a `live: true` param")


# --- adopt: never -------------------------------------------------------------------------

OWNED = """\
    name: owned
    slots:
      - name: ids
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
      - name: total
        shape: []
        dtype: int32
        axis: none
        adopt: never
"""


@pytest.mark.parametrize("mode", MODES)
def test_an_adopt_never_slot_is_allocated_whatever_adopt_holds(mode):
    ids, total = torch.zeros(4, dtype=torch.int64), torch.zeros((), dtype=torch.int32)
    reg = build(OWNED, mode, adopt=SimpleNamespace(ids=ids, total=total))
    assert reg.slot("ids").buffer is ids
    assert reg.slot("total").buffer is not total and reg.slot("total").buffer.shape == torch.Size([])
    reg = build(OWNED, mode, adopt={"ids": ids})  # nothing to adopt for it: no error either
    assert reg.slot("ids").buffer is ids
    pool = gs.BufferPool()
    a, b = build(OWNED, mode, pool=pool), build(OWNED, mode, pool=pool, adopt={"ids": ids})
    assert a.slot("total").buffer.data_ptr() == b.slot("total").buffer.data_ptr()  # pooled as usual


# --- the SharePool protocol ---------------------------------------------------------------

SENTINEL = """\
    name: sentinel
    params:
      fill: {type: int, default: 1}
    slots:
      - name: lens
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: fill_sentinel
        pad_value: fill
"""


class LastWins:
    """sglang's pool: the first tensor of a key is canonical; every registrant is told
    fresh=True, so its initial value is written after sharing."""

    def __init__(self):
        self.buffers, self.calls = {}, []

    def share(self, name, tensor, init_value):
        self.calls.append((name, tuple(tensor.shape), init_value, tensor.tolist()))
        canonical = self.buffers.setdefault((name, tensor.numel()), tensor)
        return canonical.view(tensor.shape), True


@pytest.mark.parametrize("mode", MODES)
def test_a_pool_answering_fresh_gets_the_init_fill_after_sharing(mode):
    pool = LastWins()
    a = build(SENTINEL, mode, pool=pool)
    b = build(SENTINEL, mode, pool=pool, params={"fill": 5})
    assert pool.calls == [("lens", (4,), 1, [0, 0, 0, 0]), ("lens", (4,), 5, [0, 0, 0, 0])]  # zeros in
    assert a.slot("lens").buffer.data_ptr() == b.slot("lens").buffer.data_ptr()
    assert a.slot("lens").buffer.tolist() == [5, 5, 5, 5]  # the last registrant's value


@pytest.mark.parametrize("mode", MODES)
def test_a_pool_answering_not_fresh_keeps_the_canonical_content(mode):
    class KeepFirst(LastWins):
        def share(self, name, tensor, init_value):
            first = (name, tensor.numel()) not in self.buffers
            return super().share(name, tensor, init_value)[0], first

    pool = KeepFirst()
    a = build(SENTINEL, mode, pool=pool)
    build(SENTINEL, mode, pool=pool, params={"fill": 5})
    assert a.slot("lens").buffer.tolist() == [1, 1, 1, 1]
    assert isinstance(pool, gs.SharePool) and isinstance(gs.BufferPool(), gs.SharePool)


def test_buffers_is_a_pool_when_it_shares_else_the_object_buffers_are_adopted_from():
    pool = gs.BufferPool()
    spec = parse(SENTINEL)
    a = gs.build_registry(spec, device="cpu", max_bs=4, max_num_tokens=8, buffers=pool)
    b = gs.build_registry(spec, device="cpu", max_bs=4, max_num_tokens=8, buffers=pool)
    assert a.slot("lens").buffer.data_ptr() == b.slot("lens").buffer.data_ptr() and len(pool) == 1
    with pytest.raises(gs.SlotError) as err:
        gs.build_registry(spec, device="cpu", max_bs=4, max_num_tokens=8, buffers="yes")
    assert str(err.value) == ("slot 'lens': buffers= has no tensor 'lens' to adopt; give it one, or declare the "
                              "slot `adopt: never`")


# --- fill_from_skipping -------------------------------------------------------------------

STAGED = """\
    name: staged
    slots:
      - name: positions
        shape: [max_num_tokens]
        dtype: int64
        axis: tokens
        padding: zero
      - name: seq_lens
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: fill_sentinel
        pad_value: -1
      - name: input_ids
        shape: [max_num_tokens]
        dtype: int64
        axis: tokens
        padding: foreach_copy
      - name: counted
        shape: [1]
        dtype: int32
        axis: none
        copy_from_fb: false
        post_fill: count_non_padded_tokens
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strict", [False, True])
def test_skipped_slots_are_not_read_reset_or_hooked(mode, strict):
    reg = build(STAGED, mode, strict=strict)
    poison(reg, 9)
    fill = reg.fill_from_skipping({"positions", "seq_lens", "counted", "not_a_slot"})
    assert reg.fill_from_skipping({"seq_lens", "positions", "counted"}) is fill  # bound once per set
    fb = SimpleNamespace(positions=None, seq_lens="staged elsewhere", input_ids=t(1, 2))
    fill(fb, raw_bs=1, padded_bs=2, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.slot("positions").buffer.tolist() == [9] * 8
    assert reg.slot("seq_lens").buffer.tolist() == [9] * 4
    assert reg.slot("counted").buffer.tolist() == [9]
    assert reg.slot("input_ids").buffer.tolist() == [1, 2] + [9] * 6
    with pytest.raises(gs.SlotError) as err:  # fill_from itself is untouched
        reg.fill_from(fb, raw_bs=1, padded_bs=2, raw_num_tokens=2, padded_num_tokens=4)
    assert str(err.value) == ("spec 'staged', slot 'positions': the batch field is None, but the slot is not "
                              "optional; set it on the batch, or declare `optional: true` in the spec")
    assert reg.fill_from_skipping(frozenset()) == reg.fill_from  # (a bound method in interpreted mode)
    assert reg.fill_from_skipping({"not_a_slot"}) == reg.fill_from


@pytest.mark.parametrize("mode", MODES)
def test_extract_exposes_a_required_slot_whose_field_a_skipping_fill_left_none(mode):
    """Only optional slots carry a None into the view (the contract); a required slot's
    view is its buffer, which the engine staged (regression: the interpreter carried it)."""
    reg = build(STAGED, mode)
    fb = SimpleNamespace(positions=None, seq_lens=None, input_ids=t(1, 2))
    reg.fill_from_skipping({"positions", "seq_lens"})(fb, raw_bs=1, padded_bs=2, raw_num_tokens=2, padded_num_tokens=4)
    view = reg.extract(fb, padded_bs=2, padded_num_tokens=4)
    assert view.positions is not None and view.positions.shape == torch.Size([4])
    assert view.seq_lens.shape == torch.Size([2])


def test_a_skip_variant_is_compiled_once_per_process(monkeypatch):
    from graphslot.codegen import generator

    spec = parse(STAGED.replace("name: staged", "name: staged_once"))
    gs.build_registry(spec, max_bs=4, max_num_tokens=8, device="cpu").fill_from_skipping({"seq_lens"})
    rendered = []
    real = generator.render_module
    monkeypatch.setattr(generator, "render_module", lambda *a, **k: rendered.append(k) or real(*a, **k))
    again = gs.build_registry(spec, max_bs=4, max_num_tokens=8, device="cpu")
    again.fill_from_skipping({"seq_lens"})
    assert rendered == []
    again.fill_from_skipping({"positions"})
    assert rendered == [{"skip": frozenset({"positions"})}]


# --- buffers= and context= ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_buffers_binds_the_given_tensors_as_they_are(mode):
    given = {"lens": torch.full((4,), 42, dtype=torch.int64)}
    reg = build(SENTINEL, mode, bind=given)
    assert reg.slot("lens").buffer is given["lens"] and given["lens"].tolist() == [42] * 4  # no init fill
    reg.fill_from(SimpleNamespace(lens=t(3)), raw_bs=1, padded_bs=2, raw_num_tokens=1, padded_num_tokens=2)
    assert given["lens"].tolist() == [3, 1, 42, 42]


@pytest.mark.parametrize("buffers, error", [
    ({}, "spec 'sentinel', slot 'lens': buffers= has no tensor for it"),
    ({"lens": [0, 0, 0, 0]}, "spec 'sentinel', slot 'lens': buffers= has list for it"),
    ({"lens": torch.zeros(3, dtype=torch.int64)},
     "spec 'sentinel', slot 'lens': buffers= holds shape [3] torch.int64 on cpu, expected [4] torch.int64 on cpu"),
    ({"lens": torch.zeros(4, dtype=torch.int32)},
     "spec 'sentinel', slot 'lens': buffers= holds shape [4] torch.int32 on cpu, expected [4] torch.int64 on cpu"),
    ({"lens": torch.zeros(4, dtype=torch.int64, device="meta")},
     "spec 'sentinel', slot 'lens': buffers= holds shape [4] torch.int64 on meta, expected [4] torch.int64 on cpu"),
])
def test_buffers_must_fit_each_enabled_slot(buffers, error):
    with pytest.raises(gs.SlotError) as err:
        build(SENTINEL, "generated", bind=buffers)
    assert str(err.value) == error


@dataclass
class EngineContext:
    """An engine's own, mutable context with its own field order."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    extra: Any = None
    params: Any = None
    side_inputs: Any = None

    @classmethod
    def make(cls, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, params, side_inputs):
        return cls(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, params=params, side_inputs=side_inputs)


HOOKED = """\
    name: hooked
    params:
      k: {type: int, default: 3, live: true}
    slots:
      - name: first
        shape: [1]
        dtype: int64
        axis: none
        copy_from_fb: false
        post_fill: mark
      - name: second
        shape: [1]
        dtype: int64
        axis: none
        copy_from_fb: false
        post_fill: read_mark
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [4, "provider"])
def test_context_makes_the_one_context_every_hook_of_a_fill_gets(mode, k):
    seen = []

    def mark(buffer, fb, ctx):
        ctx.extra = ctx.padded_bs * 100  # mutable: the next hook sees it
        buffer.fill_(ctx.params["k"])

    def read_mark(buffer, fb, ctx):
        seen.append((type(ctx), ctx.raw_bs, ctx.padded_num_tokens, ctx.side_inputs))
        buffer.fill_(ctx.extra)

    params = {"k": (lambda ctx: ctx.raw_num_tokens) if k == "provider" else k}
    reg = build(HOOKED, mode, hooks={"mark": mark, "read_mark": read_mark}, context=EngineContext.make,
                params=params)
    reg.fill_from(SimpleNamespace(), raw_bs=1, padded_bs=2, raw_num_tokens=3, padded_num_tokens=4, side_inputs="pp")
    assert seen == [(EngineContext, 1, 4, "pp")]
    assert reg.slot("first").buffer.tolist() == [3 if k == "provider" else 4]
    assert reg.slot("second").buffer.tolist() == [200]
