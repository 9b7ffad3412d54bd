"""The slot semantics of graphslot/slot_specs/README.md, on the interpreted registry (the reference).

Buffers are "poisoned" (filled with a value no fill writes) before a step, so every
assertion can tell "written by this fill" from "left alone".
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import graphslot as gs
from conftest import Batch, build, make_slot_yaml, parse

POISON = 99

#: fill_from's counts, in order (they are keyword-only).
COUNTS = ("raw_bs", "padded_bs", "raw_num_tokens", "padded_num_tokens")


def poison(reg, value=POISON):
    for name in reg.slot_names():
        reg.slot(name).buffer.fill_(value)


def t(*values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


POLICIES = """\
    name: policies
    slots:
      - name: zeroed
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
      - name: sentinel
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: fill_sentinel
        pad_value: -1
      - name: kept
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: keep_pad
      - name: foreach
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: foreach_copy
      - name: once
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: fill_once
        pad_value: 7
      - name: fixed
        shape: [3]
        dtype: int64
        axis: none
        padding: fill_once
        pad_value: 5
        copy_from_fb: false
      - name: tok
        shape: [max_num_tokens, 2]
        dtype: int64
        axis: tokens
        padding: zero
    """


@pytest.fixture
def policies():
    return build(POLICIES, max_bs=8, max_num_tokens=8)


def policies_batch(raw_bs=3, raw_tokens=2):
    head = torch.arange(1, raw_bs + 1)
    return SimpleNamespace(
        batch_size=raw_bs, zeroed=head.clone(), sentinel=head.clone(), kept=head.clone(),
        foreach=head.clone(), once=head.clone(), fixed=t(1, 2, 3),
        tok=torch.arange(1, 2 * raw_tokens + 1).view(raw_tokens, 2),
    )


# --- padding policies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, tail",
    [("zeroed", [0, 0, 0]), ("sentinel", [-1, -1, -1]), ("kept", [POISON] * 3), ("foreach", [POISON] * 3),
     ("once", [POISON] * 3)],
)
def test_each_policy_head_tail_and_beyond(policies, name, tail):
    poison(policies)
    policies.fill_from(policies_batch(), raw_bs=3, padded_bs=6, raw_num_tokens=2, padded_num_tokens=4)
    buffer = policies.slot(name).buffer
    assert buffer[:3].tolist() == [1, 2, 3]  # head: the source
    assert buffer[3:6].tolist() == tail  # padded tail: by policy
    assert buffer[6:].tolist() == [POISON, POISON]  # past padded: never touched


def test_fill_once_fills_the_whole_buffer_at_allocation_only(policies):
    assert policies.slot("once").buffer.tolist() == [7] * 8
    assert policies.slot("fixed").buffer.tolist() == [5, 5, 5]
    policies.slot("once").buffer[5] = 42
    policies.fill_from(policies_batch(), raw_bs=3, padded_bs=6, raw_num_tokens=2, padded_num_tokens=4)
    assert policies.slot("once").buffer.tolist() == [1, 2, 3, 7, 7, 42, 7, 7]


def test_zero_and_sentinel_tails_are_reset_on_every_step(policies):
    batch = policies_batch(raw_bs=5)
    policies.fill_from(batch, raw_bs=5, padded_bs=5, raw_num_tokens=2, padded_num_tokens=2)
    policies.fill_from(policies_batch(raw_bs=2), raw_bs=2, padded_bs=5, raw_num_tokens=2, padded_num_tokens=2)
    assert policies.slot("zeroed").buffer[:5].tolist() == [1, 2, 0, 0, 0]
    assert policies.slot("sentinel").buffer[:5].tolist() == [1, 2, -1, -1, -1]
    assert policies.slot("kept").buffer[:5].tolist() == [1, 2, 3, 4, 5]  # stale rows stay


def test_tokens_axis_uses_token_counts_and_resets_whole_rows(policies):
    poison(policies)
    policies.fill_from(policies_batch(raw_tokens=2), raw_bs=3, padded_bs=3, raw_num_tokens=2, padded_num_tokens=5)
    tok = policies.slot("tok").buffer
    assert tok[:2].tolist() == [[1, 2], [3, 4]]
    assert tok[2:5].tolist() == [[0, 0]] * 3
    assert tok[5:].tolist() == [[POISON, POISON]] * 3


def test_axis_none_is_never_reset(policies):
    policies.slot("fixed").buffer.copy_(t(4, 5, 6))
    for raw, padded in [(1, 8), (0, 4), (3, 3)]:
        policies.fill_from(policies_batch(raw, 1), raw_bs=raw, padded_bs=padded, raw_num_tokens=1,
                           padded_num_tokens=8)
        assert policies.slot("fixed").buffer.tolist() == [4, 5, 6]


def test_axis_none_plain_slot_copies_the_whole_buffer():
    reg = build(make_slot_yaml(shape=[2, 2], axis="none", padding=None))
    reg.fill_from(SimpleNamespace(x=t(1, 2, 3, 4).view(2, 2)),
                  raw_bs=1, padded_bs=4, raw_num_tokens=1, padded_num_tokens=4)
    assert reg.slot("x").buffer.tolist() == [[1, 2], [3, 4]]
    assert reg.slot("x").slice_for(1, 1).shape == (2, 2)


def test_slice_dim_1_mrope_positions():
    reg = build(make_slot_yaml(name="mrope_positions", shape=[3, "max_num_tokens"], axis="tokens", slice_dim=1),
                max_num_tokens=8)
    poison(reg)
    src = torch.arange(6).view(3, 2)
    reg.fill_from(Batch(mrope_positions=src), raw_bs=1, padded_bs=1, raw_num_tokens=2, padded_num_tokens=5)
    buffer = reg.slot("mrope_positions").buffer
    assert torch.equal(buffer[:, :2], src)
    assert buffer[:, 2:5].eq(0).all()
    assert buffer[:, 5:].eq(POISON).all()
    view = reg.extract(Batch(mrope_positions=src), padded_bs=1, padded_num_tokens=5).mrope_positions
    assert view.shape == (3, 5)
    assert view.data_ptr() == buffer.data_ptr()


def test_host_slot_lives_on_the_cpu_and_is_filled_like_the_others():
    reg = build(make_slot_yaml(device="cpu", padding="fill_sentinel", pad_value=1))
    reg.fill_from(SimpleNamespace(x=t(5, 6)), raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.slot("x").buffer.device == torch.device("cpu")
    assert reg.slot("x").buffer.tolist() == [5, 6, 1, 1]


# --- sources ------------------------------------------------------------------------------------


def test_source_hook_result_is_copied_into_its_own_length():
    calls = []

    def two_rows(fb, ctx):
        calls.append((ctx.raw_bs, ctx.padded_bs, ctx.side_inputs))
        return fb.ids[:2]

    reg = build(make_slot_yaml(padding="keep_pad", source="two_rows"), hooks={"two_rows": two_rows})
    poison(reg)
    reg.fill_from(SimpleNamespace(ids=t(1, 2, 3)), raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4,
                  side_inputs="side")
    assert reg.slot("x").buffer.tolist() == [1, 2, POISON, POISON]
    assert calls == [(3, 4, "side")]


def test_dotted_slot_reads_its_field_through_the_builtin_source():
    reg = build(make_slot_yaml(name="extra.ids", source="dotted_field"))
    poison(reg)
    fb = Batch(extra=SimpleNamespace(ids=t(4, 5)))
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert reg.slot("extra.ids").buffer.tolist() == [4, 5, 0, POISON]
    # a missing part reads as None: no copy
    reg.fill_from(Batch(extra=None), raw_bs=1, padded_bs=3, raw_num_tokens=1, padded_num_tokens=3)
    assert reg.slot("extra.ids").buffer.tolist() == [4, 0, 0, POISON]


NOT_OPTIONAL = "but the slot is not optional; set it on the batch, or declare `optional: true` in the spec"


@pytest.mark.parametrize("value, got", [
    (None, f"the batch field is None, {NOT_OPTIONAL}"),
    ([1, 2], "expected a torch.Tensor, got list [1, 2]"),
    (3, "expected a torch.Tensor, got int 3"),
], ids=["None", "list", "int"])
def test_a_required_field_that_is_not_a_tensor_is_an_error_and_nothing_is_written(value, got):
    reg = build(make_slot_yaml())
    poison(reg)
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(SimpleNamespace(x=value), raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert str(err.value) == f"spec 't', slot 'x': {got}"
    assert reg.slot("x").buffer.tolist() == [POISON] * 4


def test_an_absent_required_field_is_an_error():
    reg = build(make_slot_yaml())
    with pytest.raises(gs.SlotError, match=f"slot 'x': the batch has no field 'x', {NOT_OPTIONAL}"):
        reg.fill_from(SimpleNamespace(), raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)


@pytest.mark.parametrize("value", [None, "absent"])
def test_an_optional_field_that_is_none_or_absent_is_skipped_but_the_tail_still_reset(value):
    reg = build(make_slot_yaml(optional=True))
    poison(reg)
    reg.fill_from(SimpleNamespace() if value == "absent" else SimpleNamespace(x=None),
                  raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert reg.slot("x").buffer.tolist() == [POISON, POISON, 0, POISON]


@pytest.mark.parametrize("value, shape", [(t(7), [1]), (torch.tensor(7), []), (t(1, 2, 3), [3])],
                         ids=["one row", "0-d", "too long"])
def test_a_field_with_other_rows_than_the_step_is_an_error_never_a_broadcast(value, shape):
    reg = build(make_slot_yaml())
    poison(reg)
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(SimpleNamespace(x=value), raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert str(err.value) == (f"spec 't', slot 'x': expected shape [2], got {shape} (copy_ would broadcast or "
                              "fail)")
    assert reg.slot("x").buffer.tolist() == [POISON] * 4


def test_source_hook_returning_none_skips_the_copy():
    reg = build(make_slot_yaml(source="nothing"), hooks={"nothing": lambda fb, ctx: None})
    poison(reg)
    reg.fill_from(SimpleNamespace(x=t(1, 2)), raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert reg.slot("x").buffer.tolist() == [POISON, POISON, 0, POISON]


def test_copy_from_fb_false_is_never_copied_but_its_tail_is_reset():
    reg = build(make_slot_yaml(copy_from_fb=False))
    poison(reg)
    reg.fill_from(SimpleNamespace(x=t(1, 2)), raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert reg.slot("x").buffer.tolist() == [POISON, POISON, 0, POISON]


def test_copies_cast_to_the_buffer_dtype_when_not_strict():
    """Not strict: ``copy_``'s dtype conversion (strict mode rejects another dtype)."""
    reg = build(make_slot_yaml(dtype="int32"))
    reg.fill_from(SimpleNamespace(x=t(1, 2)), raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)
    assert reg.slot("x").buffer[:2].tolist() == [1, 2]


# --- post_fill hooks ----------------------------------------------------------------------------

POST_FILL = """\
    name: post
    params:
      scale: {type: int, default: 10}
    slots:
      - name: total
        shape: [1]
        dtype: int64
        axis: none
        copy_from_fb: false
        post_fill: sum_of_x
      - name: x
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
    """


def test_post_fill_runs_after_every_copy_and_sees_the_context():
    seen = []

    def sum_of_x(buffer, fb, ctx):
        seen.append(ctx)
        x = reg.slot("x").buffer  # a later slot: already copied and padded
        buffer.fill_(int(x[: ctx.padded_bs].sum()) * ctx.params["scale"])

    reg = build(POST_FILL, max_bs=4, max_num_tokens=8, hooks={"sum_of_x": sum_of_x})
    poison(reg)
    side = {"pool": object()}
    reg.fill_from(SimpleNamespace(x=t(1, 2)), raw_bs=2, padded_bs=3, raw_num_tokens=5, padded_num_tokens=7,
                  side_inputs=side)
    assert reg.slot("total").buffer.tolist() == [30]
    (ctx,) = seen
    assert isinstance(ctx, gs.FillContext)
    assert (ctx.raw_bs, ctx.padded_bs, ctx.raw_num_tokens, ctx.padded_num_tokens) == (2, 3, 5, 7)
    assert ctx.params == {"scale": 10}
    assert ctx.side_inputs is side


def test_post_fill_gets_the_full_buffer():
    buffers = []
    reg = build(make_slot_yaml(post_fill="grab"), hooks={"grab": lambda buffer, fb, ctx: buffers.append(buffer)})
    reg.fill_from(SimpleNamespace(x=t(1)), raw_bs=1, padded_bs=2, raw_num_tokens=1, padded_num_tokens=2)
    assert buffers[0] is reg.slot("x").buffer


def test_post_fill_of_a_copied_slot_sees_the_copy():
    def double(buffer, fb, ctx):
        buffer.mul_(2)

    reg = build(make_slot_yaml(post_fill="double"), hooks={"double": double})
    reg.fill_from(SimpleNamespace(x=t(1, 2)), raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    assert reg.slot("x").buffer[:3].tolist() == [2, 4, 0]


def test_import_reference_hooks_run():
    import hooks_for_tests

    hooks_for_tests.CALLS.clear()
    reg = build(make_slot_yaml(post_fill="hooks_for_tests:post_fill_fits"))
    reg.fill_from(SimpleNamespace(x=t(1)), raw_bs=1, padded_bs=2, raw_num_tokens=1, padded_num_tokens=2)
    assert hooks_for_tests.CALLS == [("post_fill_fits", 1, 2)]


# --- extract ------------------------------------------------------------------------------------

EXTRACT = """\
    name: ex
    slots:
      - name: input_ids
        shape: [max_num_tokens]
        dtype: int64
        axis: tokens
        padding: foreach_copy
      - name: seq_lens
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: fill_sentinel
        pad_value: 1
      - name: mrope_positions
        shape: [3, max_num_tokens]
        dtype: int64
        axis: tokens
        slice_dim: 1
        padding: zero
        optional: true
      - name: num_token_non_padded
        shape: [1]
        dtype: int32
        axis: none
        copy_from_fb: false
        post_fill: count_non_padded_tokens
      - name: global_num_tokens_gpu
        shape: [1]
        dtype: int32
        axis: none
        copy_from_fb: false
      - name: extra.ids
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
        source: dotted_field
    """


@pytest.fixture
def ex():
    return build(EXTRACT, max_bs=4, max_num_tokens=8)


def ex_batch():
    return Batch(batch_size=2, input_ids=t(1, 2, 3), seq_lens=t(5, 6), extra=SimpleNamespace(ids=t(7, 8)))


def test_extract_sets_padded_batch_size_and_padded_views(ex):
    fb = ex_batch()
    ex.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=6)
    view = ex.extract(fb, padded_bs=4, padded_num_tokens=6)
    assert view.batch_size == 4
    assert isinstance(view, Batch)
    for name, shape in [("input_ids", (6,)), ("seq_lens", (4,))]:
        field = getattr(view, name)
        assert field.shape == shape
        assert field.data_ptr() == ex.slot(name).buffer.data_ptr()
        assert torch.equal(field, ex.slot(name).slice_for(4, 6))
    assert view.seq_lens.tolist() == [5, 6, 1, 1]


def test_extract_carries_none_for_a_plain_slot_absent_this_step(ex):
    fb = ex_batch()
    ex.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=6)
    assert ex.extract(fb, padded_bs=4, padded_num_tokens=6).mrope_positions is None
    fb.mrope_positions = torch.zeros(3, 3, dtype=torch.int64)
    ex.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=6)
    assert ex.extract(fb, padded_bs=4, padded_num_tokens=6).mrope_positions.shape == (3, 6)
    fb.mrope_positions = None  # gone again: never the stale buffer
    assert ex.extract(fb, padded_bs=4, padded_num_tokens=6).mrope_positions is None


def test_extract_always_exposes_computed_slots(ex):
    fb = ex_batch()
    assert fb.num_token_non_padded is None and fb.global_num_tokens_gpu is None
    ex.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=6)
    view = ex.extract(fb, padded_bs=4, padded_num_tokens=6)
    assert view.num_token_non_padded.tolist() == [3]
    assert view.num_token_non_padded.data_ptr() == ex.slot("num_token_non_padded").buffer.data_ptr()
    assert view.global_num_tokens_gpu.data_ptr() == ex.slot("global_num_tokens_gpu").buffer.data_ptr()


def test_extract_never_sets_dotted_names(ex):
    fb = ex_batch()
    extra = fb.extra
    ex.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=6)
    view = ex.extract(fb, padded_bs=4, padded_num_tokens=6)
    assert view.extra is extra
    assert view.extra.ids.tolist() == [7, 8]  # the batch's own tensor, not the buffer
    assert "extra.ids" not in vars(view)
    assert ex.slot("extra.ids").buffer.tolist() == [7, 8, 0, 0]


def test_extract_does_not_modify_the_template_batch(ex):
    fb = ex_batch()
    before = dict(vars(fb))
    ex.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=6)
    view = ex.extract(fb, padded_bs=4, padded_num_tokens=6)
    assert view is not fb
    assert vars(fb) == before  # same objects: nothing replaced, batch_size unchanged
    assert fb.batch_size == 2 and fb.input_ids.tolist() == [1, 2, 3]


def test_extract_keeps_fields_that_are_not_slots():
    reg = build(make_slot_yaml())
    fb = SimpleNamespace(x=t(1), spec_info=object(), forward_mode="decode")
    view = reg.extract(fb, padded_bs=2, padded_num_tokens=2)
    assert view.spec_info is fb.spec_info and view.forward_mode == "decode"


# --- disabled slots -------------------------------------------------------------------------------

TOGGLE = """\
    name: toggle
    params:
      use_mask: {type: bool, default: false}
    slots:
      - name: x
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
      - name: mask
        shape: [max_bs]
        dtype: bool
        axis: bs
        padding: zero
        enabled_if: use_mask
    """


def test_disabled_slot_is_introspectable_but_unallocated():
    reg = build(TOGGLE)
    slot = reg.slot("mask")
    assert slot.enabled is False and slot.buffer is None
    assert slot.resolved.dtype == torch.bool and slot.resolved.shape == (4,)
    assert reg.has_slot("x") and not reg.has_slot("mask")
    assert reg.slot_names() == ["x"]
    assert [s.name for s in reg.all_slots()] == ["x", "mask"]
    with pytest.raises(gs.SlotError, match=r"^slot 'mask' is disabled with these params and has no buffer$"):
        slot.slice_for(2, 2)


def test_disabled_slot_is_neither_filled_nor_extracted():
    reg = build(TOGGLE)
    mask = torch.ones(2, dtype=torch.bool)
    fb = SimpleNamespace(x=t(1, 2), mask=mask)
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.extract(fb, padded_bs=4, padded_num_tokens=4).mask is mask


def test_enabled_by_param():
    reg = build(TOGGLE, params={"use_mask": True})
    assert reg.slot_names() == ["x", "mask"]
    assert reg.slot("mask").buffer.dtype == torch.bool


def test_unknown_slot_name_suggests_the_close_one():
    reg = build(TOGGLE)
    with pytest.raises(KeyError, match="no slot 'msk' in spec 'toggle'; did you mean 'mask'"):
        reg.slot("msk")
    assert not reg.has_slot("msk")


# --- buffer pool --------------------------------------------------------------------------------


def once_spec(pad_value, name="shared", shape=("max_bs",)):
    return parse(make_slot_yaml(name=name, shape=list(shape), padding="fill_once", pad_value=pad_value))


def test_pool_shares_one_tensor_per_key():
    pool = gs.BufferPool()
    a = build(once_spec(1), pool=pool)
    b = build(once_spec(1), pool=pool)
    assert a.slot("shared").buffer.data_ptr() == b.slot("shared").buffer.data_ptr()
    a.fill_from(SimpleNamespace(shared=t(9)), raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert b.slot("shared").buffer[0] == 9
    assert len(pool) == 1


@pytest.mark.parametrize("first, second", [(1, 2), (2, 1)])
def test_pool_sharers_must_agree_on_the_initial_value(first, second):
    pool = gs.BufferPool()
    a = build(once_spec(first), pool=pool)
    with pytest.raises(gs.SlotError) as err:
        build(once_spec(second), pool=pool)
    assert str(err.value) == (f"slot 'shared': shared buffer (4 x torch.int64 on cpu) was first registered with "
                              f"initial value {first}, this registry needs {second}; give both the same pad value, "
                              "or build this registry with a pool of its own (or buffers=None)")
    assert a.slot("shared").buffer.tolist() == [first] * 4


def test_pool_registration_is_thread_safe():
    import threading

    pool, built, barrier = gs.BufferPool(), [], threading.Barrier(8)

    def register():
        barrier.wait()
        built.append(build(once_spec(1), pool=pool))

    threads = [threading.Thread(target=register) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({reg.slot("shared").buffer.data_ptr() for reg in built}) == 1 and len(pool) == 1


def test_pool_key_is_numel_not_shape():
    pool = gs.BufferPool()
    a = build(once_spec(1, shape=["max_bs", 2]), max_bs=4, pool=pool)
    b = build(once_spec(1), max_bs=8, pool=pool)
    assert b.slot("shared").buffer.shape == (8,)
    assert a.slot("shared").buffer.data_ptr() == b.slot("shared").buffer.data_ptr()


@pytest.mark.parametrize(
    "other",
    [dict(max_bs=8), dict(name="other"), dict(dtype="int32")],
    ids=["size", "name", "dtype"],
)
def test_pool_never_shares_across_keys(other):
    pool = gs.BufferPool()
    a = build(make_slot_yaml(), pool=pool)
    b = build(make_slot_yaml(**{k: v for k, v in other.items() if k != "max_bs"}),
              max_bs=other.get("max_bs", 4), pool=pool)
    name_b = other.get("name", "x")
    assert a.slot("x").buffer.data_ptr() != b.slot(name_b).buffer.data_ptr()
    assert len(pool) == 2


SHARED = gs.BufferPool()


def test_one_pool_shares_and_no_pool_shares_nothing():
    spec = once_spec(3, name="pool_probe_global_7f3a")
    a = build(spec, pool=SHARED)
    b = build(spec, pool=SHARED)
    c = build(spec)
    ptr = a.slot("pool_probe_global_7f3a").buffer.data_ptr()
    assert b.slot("pool_probe_global_7f3a").buffer.data_ptr() == ptr
    assert c.slot("pool_probe_global_7f3a").buffer.data_ptr() != ptr


def test_registries_without_a_pool_never_share():
    a, b = build(make_slot_yaml()), build(make_slot_yaml())
    assert a.slot("x").buffer.data_ptr() != b.slot("x").buffer.data_ptr()


# --- adopting existing tensors ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["interpreted", "generated"])
@pytest.mark.parametrize("container", [SimpleNamespace, dict])
def test_buffers_adopts_existing_tensors_as_they_are(container, mode):
    owned = torch.full((4,), 3, dtype=torch.int64)
    reg = gs.build_registry(parse(make_slot_yaml(padding="fill_once", pad_value=7)), device="cpu", max_bs=4,
                            max_num_tokens=8, impl=mode, buffers=container(x=owned))
    assert reg.slot("x").buffer is owned
    assert owned.tolist() == [3, 3, 3, 3]  # the owner initialised it: no fill_once


@pytest.mark.parametrize(
    "tensor, expected",
    [
        (torch.zeros(5, dtype=torch.int64),
         "slot 'x': cannot adopt the tensor: expected shape [4] dtype torch.int64, got shape [5] dtype torch.int64"),
        (torch.zeros(4, dtype=torch.int32),
         "slot 'x': cannot adopt the tensor: expected shape [4] dtype torch.int64, got shape [4] dtype torch.int32"),
        ([0, 0, 0, 0], "slot 'x': buffers= holds list, expected a torch.Tensor"),
    ],
    ids=["shape", "dtype", "not-a-tensor"],
)
def test_an_adopted_tensor_must_match(tensor, expected):
    with pytest.raises(gs.SlotError) as info:
        gs.build_registry(parse(make_slot_yaml()), device="cpu", max_bs=4, max_num_tokens=8,
                          buffers=SimpleNamespace(x=tensor))
    assert str(info.value) == expected


def test_adopt_without_the_tensor():
    with pytest.raises(gs.SlotError) as info:
        gs.build_registry(parse(make_slot_yaml()), device="cpu", max_bs=4, max_num_tokens=8,
                          buffers=SimpleNamespace(y=torch.zeros(4)))
    assert str(info.value) == ("slot 'x': buffers= has no tensor 'x' to adopt; give it one, or declare the slot "
                               "`adopt: never`")


# --- address stability --------------------------------------------------------------------------


def test_buffer_addresses_never_change_across_fills(policies):
    ptrs = {name: policies.slot(name).buffer.data_ptr() for name in policies.slot_names()}
    rng = random.Random(0)
    for _ in range(50):
        padded_bs, padded_tokens = rng.randint(1, 8), rng.randint(1, 8)
        raw_bs, raw_tokens = rng.randint(0, padded_bs), rng.randint(0, padded_tokens)
        fb = policies_batch(raw_bs, raw_tokens)
        policies.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_tokens,
                           padded_num_tokens=padded_tokens)
        view = policies.extract(fb, padded_bs=padded_bs, padded_num_tokens=padded_tokens)
        for name, ptr in ptrs.items():
            assert policies.slot(name).buffer.data_ptr() == ptr
            assert getattr(view, name).data_ptr() == ptr
    assert {name: policies.slot(name).buffer.data_ptr() for name in policies.slot_names()} == ptrs


# --- pre_capture --------------------------------------------------------------------------------

PRE_CAPTURE = """\
    name: pre
    params:
      use_c: {type: bool, default: false}
    slots:
      - name: a
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
        pre_capture: record
      - name: c
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
        pre_capture: record
        enabled_if: use_c
      - name: b
        shape: [max_num_tokens]
        dtype: int64
        axis: tokens
        padding: zero
        pre_capture: record
    """


def test_run_pre_capture_runs_enabled_hooks_in_spec_order():
    calls = []

    def record(buffer, ctx):
        calls.append((buffer.data_ptr(), ctx.bs, ctx.num_tokens, ctx.side_inputs, dict(ctx.params)))

    reg = build(PRE_CAPTURE, hooks={"record": record})
    assert calls == []  # building runs no hook
    reg.run_pre_capture(2, 6, side_inputs="side")
    ptr = {n: reg.slot(n).buffer.data_ptr() for n in ("a", "b")}
    assert calls == [(ptr["a"], 2, 6, "side", {"use_c": False}), (ptr["b"], 2, 6, "side", {"use_c": False})]

    calls.clear()
    reg = build(PRE_CAPTURE, hooks={"record": record}, params={"use_c": True})
    reg.run_pre_capture(1, 1)
    assert [c[0] for c in calls] == [reg.slot(n).buffer.data_ptr() for n in ("a", "c", "b")]


def test_pre_capture_hooks_do_not_run_on_fill():
    calls = []
    reg = build(PRE_CAPTURE, hooks={"record": lambda buffer, ctx: calls.append(1)})
    reg.fill_from(SimpleNamespace(a=t(1), b=t(2)), raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert calls == []


# --- strict mode --------------------------------------------------------------------------------

STRICT = """\
    name: s
    slots:
      - name: x
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
      - name: pair
        shape: [max_num_tokens, 2]
        dtype: int64
        axis: tokens
        padding: zero
      - name: maybe
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
        optional: true
    """


@pytest.fixture(params=["strict=True", "GRAPHSLOT_STRICT=1"])
def strict_reg(request, monkeypatch):
    if request.param == "strict=True":
        monkeypatch.delenv("GRAPHSLOT_STRICT", raising=False)
        return build(STRICT, max_bs=4, max_num_tokens=8, strict=True)
    monkeypatch.setenv("GRAPHSLOT_STRICT", "1")
    return build(STRICT, max_bs=4, max_num_tokens=8)


def good_strict_batch():
    return SimpleNamespace(x=t(1, 2), pair=torch.ones(3, 2, dtype=torch.int64), maybe=None)


def test_strict_accepts_a_good_batch(strict_reg):
    assert strict_reg.strict
    strict_reg.fill_from(good_strict_batch(), raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=8)
    assert strict_reg.slot("x").buffer.tolist() == [1, 2, 0, 0]


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"x": [1, 2]}, "spec 's', slot 'x': expected a torch.Tensor, got list [1, 2]"),
        ({"x": t(1, 2, dtype=torch.int32)}, "spec 's', slot 'x': expected dtype torch.int64, got torch.int32 "
                                             "(copy_ would cast silently)"),
        ({"x": t(1, 2).to("meta")}, "spec 's', slot 'x': expected device cpu, got meta"),
        ({"x": t(1)}, "spec 's', slot 'x': expected shape [2], got [1] (copy_ would broadcast or fail)"),
        ({"x": t(1, 2, 3)}, "spec 's', slot 'x': expected shape [2], got [3] (copy_ would broadcast or fail)"),
        ({"pair": torch.ones(3, 3, dtype=torch.int64)},
         "spec 's', slot 'pair': expected shape [3, 2], got [3, 3] (copy_ would broadcast or fail)"),
        ({"pair": torch.ones(3, dtype=torch.int64)},
         "spec 's', slot 'pair': expected shape [3, 2], got [3] (copy_ would broadcast or fail)"),
        ({"x": None}, "spec 's', slot 'x': the batch field is None, but the slot is not optional; set it on the batch, "
                      "or declare `optional: true` in the spec"),
    ],
    ids=["type", "dtype", "device", "short", "long", "trailing", "rank", "none"],
)
def test_strict_rejects_a_mismatched_field_before_touching_any_buffer(strict_reg, change, expected):
    poison(strict_reg)
    fb = good_strict_batch()
    vars(fb).update(change)
    with pytest.raises(gs.SlotError) as info:
        strict_reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=8)
    assert str(info.value) == expected
    for name in strict_reg.slot_names():
        assert strict_reg.slot(name).buffer.eq(POISON).all(), name


@pytest.mark.parametrize(
    "counts, expected",
    [
        ((3, 2, 3, 8), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=3, padded=2, capacity=4"),
        ((2, 5, 3, 8), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=2, padded=5, capacity=4"),
        ((2, 4, 3, 9), "tokens counts must satisfy 0 <= raw <= padded <= capacity, got raw=3, padded=9, "
                       "capacity=8"),
    ],
    ids=["raw>padded", "padded>capacity", "tokens-padded>capacity"],
)
def test_strict_rejects_bad_counts(strict_reg, counts, expected):
    with pytest.raises(gs.SlotError) as info:
        strict_reg.fill_from(good_strict_batch(), **dict(zip(COUNTS, counts)))
    assert str(info.value) == "spec 's': " + expected


def test_strict_checks_source_hook_results():
    reg = build(make_slot_yaml(source="rows"), strict=True, hooks={"rows": lambda fb, ctx: fb.rows})
    # any length up to the capacity
    reg.fill_from(SimpleNamespace(rows=t(1, 2, 3)), raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    # None: nothing to copy
    reg.fill_from(SimpleNamespace(rows=None), raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    with pytest.raises(gs.SlotError, match=r"^spec 't', slot 'x': source returned 5 rows, more than the capacity 4$"):
        reg.fill_from(SimpleNamespace(rows=t(1, 2, 3, 4, 5)),
                      raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    with pytest.raises(gs.SlotError, match=r"^spec 't', slot 'x': expected dtype torch.int64, got torch.float32"):
        reg.fill_from(SimpleNamespace(rows=torch.zeros(2)),
                      raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)


@pytest.mark.parametrize("value", ["", "0", "false", "No", "OFF"])
def test_strict_is_off_by_default_and_with_a_false_graphslot_strict(monkeypatch, value):
    monkeypatch.setenv("GRAPHSLOT_STRICT", value)
    reg = build(STRICT)
    assert not reg.strict
    # casts
    reg.fill_from(SimpleNamespace(x=t(1, 2), pair=torch.ones(3, 2, dtype=torch.int32)),
                  raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=8)


@pytest.mark.parametrize("value", ["1", "true", "Yes", "on"])
def test_a_true_graphslot_strict_turns_strict_mode_on(monkeypatch, value):
    monkeypatch.setenv("GRAPHSLOT_STRICT", value)
    assert build(STRICT).strict


def test_a_graphslot_strict_that_is_not_a_boolean_is_an_error(monkeypatch):
    monkeypatch.setenv("GRAPHSLOT_STRICT", "maybe")
    with pytest.raises(ValueError, match=r"^GRAPHSLOT_STRICT='maybe' is not a boolean: use 1/true/yes/on or "
                                         r"0/false/no/off$"):
        build(STRICT)


# --- the shipped decode spec ------------------------------------------------------------------------

DECODE_DEFAULT_SLOTS = ["input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "seq_lens_cpu",
                        "mrope_positions", "global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu"]


@pytest.fixture(scope="module")
def decode_spec():
    return gs.load_spec("decode")


def decode_batch(raw_bs=2, raw_tokens=None):
    raw_tokens = raw_bs if raw_tokens is None else raw_tokens  # one token per request, unless verifying
    return Batch(
        batch_size=raw_bs,
        input_ids=torch.arange(10, 10 + raw_tokens),
        positions=torch.arange(20, 20 + raw_tokens),
        out_cache_loc=torch.arange(30, 30 + raw_tokens),
        req_pool_indices=torch.arange(40, 40 + raw_bs),
        seq_lens=torch.arange(50, 50 + raw_bs),
        seq_lens_cpu=torch.arange(50, 50 + raw_bs),
    )


def fill_decode(reg, fb, raw_bs=2, padded_bs=4):
    poison(reg)
    reg.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_bs, padded_num_tokens=padded_bs)
    return reg.extract(fb, padded_bs=padded_bs, padded_num_tokens=padded_bs)


def test_decode_default_params(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8)
    assert reg.slot_names() == DECODE_DEFAULT_SLOTS
    view = fill_decode(reg, decode_batch())
    assert view.batch_size == 4
    assert view.input_ids.tolist() == [10, 11, POISON, POISON]  # foreach_copy: tail never read back
    assert view.positions.tolist() == [20, 21, 0, 0]
    assert view.out_cache_loc.tolist() == [30, 31, 0, 0]
    assert view.req_pool_indices.tolist() == [40, 41, 0, 0]
    assert view.seq_lens.tolist() == [50, 51, 1, 1]  # seq_len_fill_value
    assert view.seq_lens_cpu.tolist() == [50, 51, 1, 1]
    assert view.seq_lens_cpu.device == torch.device("cpu")
    assert view.mrope_positions is None
    assert reg.slot("global_num_tokens_gpu").buffer.shape == (1,)
    assert view.global_num_tokens_gpu.tolist() == [POISON]  # not gathered: left as it was


def test_decode_seq_len_fill_value_param(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8, params={"seq_len_fill_value": 5})
    assert fill_decode(reg, decode_batch()).seq_lens.tolist() == [50, 51, 5, 5]


def test_decode_eager_preset(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8, preset="eager")
    assert reg.slot_names() == DECODE_DEFAULT_SLOTS[:-2]
    fb = decode_batch()
    fb.global_num_tokens_gpu = own = t(2, dtype=torch.int32)
    view = fill_decode(reg, fb)
    assert view.seq_lens.tolist() == [50, 51, 0, 0]
    assert view.global_num_tokens_gpu is own  # the batch's own count is carried


def test_decode_gathered_buffers_hold_the_padded_token_count(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8, params={"require_gathered_buffer": True})
    view = fill_decode(reg, decode_batch(3), raw_bs=3, padded_bs=4)
    assert view.global_num_tokens_gpu.tolist() == [4]
    assert view.global_num_tokens_for_logprob_gpu.tolist() == [4]


def test_decode_mlp_tp_gather_has_one_count_per_dp_rank(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8,
                params={"require_gathered_buffer": True, "require_mlp_tp_gather": True, "dp_size": 4})
    assert reg.slot("global_num_tokens_gpu").buffer.shape == (4,)
    view = fill_decode(reg, decode_batch(1), raw_bs=1, padded_bs=2)
    assert view.global_num_tokens_gpu.tolist() == [2, 2, 2, 2]
    assert view.global_num_tokens_for_logprob_gpu.tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("rank, expected", [(0, [4]), (1, [1])])
def test_decode_local_num_token_non_padded_per_attention_tp_rank(decode_spec, rank, expected):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8,
                params={"enable_num_token_non_padded": True, "require_gathered_buffer": True,
                        "attn_tp_size": 2, "attn_tp_rank": rank})
    fb = decode_batch(2, raw_tokens=5)
    fb.global_num_token_non_padded = torch.tensor(5, dtype=torch.int32)  # global real tokens, 0-d
    fb.num_token_non_padded = t(9, dtype=torch.int32)  # ignored: the global count wins
    poison(reg)
    buffer = reg.slot("num_token_non_padded").buffer
    reg.fill_from(fb, raw_bs=2, padded_bs=8, raw_num_tokens=5, padded_num_tokens=8)  # 4 tokens per rank
    assert reg.extract(fb, padded_bs=8, padded_num_tokens=8).num_token_non_padded.tolist() == expected
    assert buffer.shape == (1,) and reg.slot("num_token_non_padded").buffer is buffer  # never resized


@pytest.mark.parametrize("params", [{}, {"require_gathered_buffer": True, "enable_prefill_cp": True,
                                         "attn_tp_size": 2, "attn_tp_rank": 1},
                                    {"require_gathered_buffer": True, "attn_tp_sharded": False,
                                     "attn_tp_size": 2, "attn_tp_rank": 1}])
def test_decode_num_token_non_padded_not_sharded_keeps_the_global_count(decode_spec, params):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8, params={"enable_num_token_non_padded": True, **params})
    fb = decode_batch()
    fb.global_num_token_non_padded = t(2, dtype=torch.int64)
    assert fill_decode(reg, fb).num_token_non_padded.tolist() == [2]


def test_decode_num_token_non_padded_rejects_a_rank_outside_the_group(decode_spec):
    with pytest.raises(gs.SpecError,
                       match=r"slot 'num_token_non_padded'.*attn_tp_rank=2 must lie in \[0, attn_tp_size=2\)"):
        build(decode_spec, max_bs=8, max_num_tokens=8,
              params={"enable_num_token_non_padded": True, "require_gathered_buffer": True,
                      "attn_tp_size": 2, "attn_tp_rank": 2})


def test_decode_num_token_non_padded_falls_back_to_the_local_count(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8, params={"enable_num_token_non_padded": True})
    fb = decode_batch()
    fb.num_token_non_padded = t(2, dtype=torch.int32)
    assert fill_decode(reg, fb).num_token_non_padded.tolist() == [2]
    fb.num_token_non_padded = None  # neither count: the buffer is left as it is
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.extract(fb, padded_bs=4, padded_num_tokens=4).num_token_non_padded.tolist() == [2]


def test_decode_cache_loc_dtype_param(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8, params={"cache_loc_dtype": torch.int32})
    assert reg.slot("out_cache_loc").buffer.dtype == torch.int32


def test_decode_swa_slot_registers_with_the_kv_pool_before_capture(decode_spec):
    reg = build(decode_spec, max_bs=8, max_num_tokens=8, params={"is_hybrid_swa": True})
    registered = []
    pool = SimpleNamespace(register_out_cache_loc_swa=registered.append)
    reg.run_pre_capture(4, 4, side_inputs={"token_to_kv_pool": pool})
    assert registered == [reg.slot("out_cache_loc_swa").buffer]
    with pytest.raises(RuntimeError, match=r"^slot 'out_cache_loc_swa': pre_capture hook register_swa_out_cache_loc"):
        reg.run_pre_capture(4, 4)


# --- the shipped prefill spec's sglang-aligned slots ------------------------------------


def prefill_batch(raw_bs=2, raw_tokens=5, **fields):
    fb = Batch(batch_size=raw_bs, input_ids=torch.arange(10, 10 + raw_tokens),
               positions=torch.arange(20, 20 + raw_tokens), out_cache_loc=torch.arange(30, 30 + raw_tokens))
    for name, value in fields.items():
        setattr(fb, name, value)
    return fb


def test_prefill_input_ids_tail_is_zeroed():
    reg = build(gs.load_spec("prefill"), max_bs=4, max_num_tokens=8)
    poison(reg)
    reg.fill_from(prefill_batch(), raw_bs=2, padded_bs=2, raw_num_tokens=5, padded_num_tokens=8)
    assert (reg.extract(prefill_batch(), padded_bs=2, padded_num_tokens=8).input_ids.tolist()
            == [10, 11, 12, 13, 14, 0, 0, 0])


def test_prefill_mamba_track_slots():
    reg = build(gs.load_spec("prefill"), max_bs=4, max_num_tokens=8, params={"enable_mamba_track": True})
    assert reg.slot("mamba_track_seqlens").buffer.dtype == torch.int32
    assert reg.slot("mamba_track_indices").resolved.index and reg.slot("mamba_track_mask").resolved.index
    poison(reg)
    fb = prefill_batch(mamba_track_indices=t(3, 4), mamba_track_mask=torch.tensor([True, False]),
                       mamba_track_seqlens=t(7, 8))
    reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=5, padded_num_tokens=8)
    assert reg.slot("mamba_track_seqlens").buffer[:2].tolist() == [7, 8]
    assert reg.slot("mamba_track_seqlens").buffer[2:].tolist() == [POISON, POISON]  # bs is never padded here


@pytest.mark.parametrize("params, global_cpu, expected", [
    ({}, None, 5),                      # no global count: the raw tokens of the step
    ({}, 6, 6),                         # replicated: the global count, clamped to the bucket
    ({}, 11, 8),
    ({"require_gathered_buffer": True, "attn_tp_size": 2, "attn_tp_rank": 0}, 6, 4),
    ({"require_gathered_buffer": True, "attn_tp_size": 2, "attn_tp_rank": 1}, 6, 2),
    ({"require_gathered_buffer": True, "attn_tp_size": 2, "attn_tp_rank": 1}, 3, 0),
    ({"require_gathered_buffer": True, "attn_tp_size": 2, "attn_tp_rank": 1, "enable_prefill_cp": True}, 6, 6),
    ({"attn_tp_sharded": True, "attn_tp_size": 4, "attn_tp_rank": 3}, 7, 1),
])
def test_prefill_num_token_non_padded(params, global_cpu, expected):
    reg = build(gs.load_spec("prefill"), max_bs=4, max_num_tokens=8,
                params={"enable_num_token_non_padded": True, **params})
    poison(reg)
    fb = prefill_batch(global_num_token_non_padded_cpu=global_cpu)
    reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=5, padded_num_tokens=8)
    assert reg.extract(fb, padded_bs=2, padded_num_tokens=8).num_token_non_padded.tolist() == [expected]


# --- sources are copied as data: requires_grad ------------------------------------------------

GRAD = """\
    name: grad
    slots:
      - {name: kept, shape: [max_bs, 2], dtype: float32, axis: bs, padding: keep_pad}
      - {name: zeroed, shape: [max_bs], dtype: float32, axis: bs, padding: zero}
      - {name: sentinel, shape: [max_num_tokens], dtype: float32, axis: tokens, padding: fill_sentinel,
         pad_value: -1.0}
      - {name: doubled, shape: [max_bs], dtype: float32, axis: bs, padding: keep_pad, source: double_kept}
    """


def grad_registry(mode):
    return gs.build_registry(parse(GRAD), max_bs=4, max_num_tokens=8, impl=mode,
                             # a non-leaf result
                             hooks={"double_kept": lambda fb, ctx: fb.kept[:, 0] * 2}, device="cpu")


def grad_batch(step):
    """Sources that require grad: leaves, and a non-leaf (``kept``), as a training loop has."""
    leaf = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    return SimpleNamespace(leaf=leaf, kept=leaf * (step + 1), zeroed=torch.tensor([5.0, 6.0], requires_grad=True),
                           sentinel=torch.tensor([7.0, 8.0, 9.0], requires_grad=True))


def assert_plain_data(reg):
    for name in reg.slot_names():
        buffer = reg.slot(name).buffer
        assert not buffer.requires_grad and buffer.grad_fn is None, f"slot '{name}' records autograd history"


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_a_source_that_requires_grad_is_copied_by_value_on_every_fill(mode):
    reg = grad_registry(mode)
    for step in range(3):
        fb = grad_batch(step)
        reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
        assert reg.slot("kept").buffer[:2].tolist() == [[1.0 * (step + 1), 2.0 * (step + 1)],
                                                        [3.0 * (step + 1), 4.0 * (step + 1)]]
        assert reg.slot("zeroed").buffer[:3].tolist() == [5.0, 6.0, 0.0]
        assert reg.slot("sentinel").buffer[:5].tolist() == [7.0, 8.0, 9.0, -1.0, -1.0]
        assert reg.slot("doubled").buffer[:2].tolist() == [2.0 * (step + 1), 6.0 * (step + 1)]
        assert_plain_data(reg)
        view = reg.extract(fb, padded_bs=3, padded_num_tokens=5)
        assert not any(getattr(view, name).requires_grad for name in ("kept", "zeroed", "sentinel"))
    fb.kept.sum().backward()  # the sources' own graph is untouched by the copy
    assert fb.leaf.grad.tolist() == [[3.0, 3.0], [3.0, 3.0]]


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_keep_pad_slots_accumulate_no_autograd_history_over_many_fills(mode):
    reg = grad_registry(mode)
    for step in range(200):
        reg.fill_from(grad_batch(step % 5), raw_bs=2, padded_bs=2 + step % 2,
                      raw_num_tokens=3, padded_num_tokens=3 + step % 2)
    for name in ("kept", "doubled"):  # keep_pad: never reset, so history would chain step after step
        assert reg.slot(name).buffer.grad_fn is None
    assert_plain_data(reg)


COUNT_HOOKS = """\
    name: counts
    absent_fields: skip
    slots:
      - {name: local, shape: [1], dtype: int32, axis: none, copy_from_fb: false,
         post_fill: local_num_token_non_padded}
      - {name: host, shape: [1], dtype: int64, axis: none, device: cpu, copy_from_fb: false,
         post_fill: local_num_token_non_padded_cpu}
"""


@pytest.mark.parametrize("mode", ["interpreted", "generated"])
@pytest.mark.parametrize("field, value, slot", [
    ("num_token_non_padded", [3], "local"), ("global_num_token_non_padded", [3], "local"),
    ("global_num_token_non_padded_cpu", [3], "host"), ("num_token_non_padded", "3", "local"),
    ("global_num_token_non_padded_cpu", 3.0, "host")])
def test_a_count_field_that_is_not_an_int_or_a_tensor_is_a_slot_error_naming_slot_and_field(mode, field, value, slot):
    """Issue 37: a list-valued count was a TypeError naming nothing, and "3" was int()-ed."""
    reg = gs.build_registry(parse(COUNT_HOOKS), max_bs=4, max_num_tokens=8, impl=mode, device="cpu")
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(SimpleNamespace(**{field: value}), raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=8)
    assert str(err.value) == (f"slot '{slot}': fb.{field} is {type(value).__name__} {value!r}; a count is an int "
                              "or a tensor")
    reg.fill_from(SimpleNamespace(**{field: 3}), raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=8)
    assert reg.slot(slot).buffer.tolist() == [3]
