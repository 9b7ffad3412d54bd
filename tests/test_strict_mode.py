"""Strict mode: every mismatch between a batch and the registry is a SlotError.

``Tensor.copy_`` casts and broadcasts silently, so a batch field of the wrong dtype or
length would corrupt a buffer without an error. A strict registry checks a step's
sources (and sizes) before it copies anything, and says which slot, what it expected
and what came. Without strict mode a registry still rejects what would corrupt a buffer
silently or replay stale data (a missing field, a non-tensor, another row count); strict
mode adds dtype, device, count types on every call and aliasing. It is chosen when the
registry is built — ``strict=True`` or ``GRAPHSLOT_STRICT=1`` — so a generated registry
that is not strict calls the generated ``fill_from`` directly. Both registry modes
behave the same.
"""

from __future__ import annotations

import dataclasses
import linecache
import textwrap
import types

import pytest
import torch

import graphslot as gs
from graphslot.registry.stepcheck import StepChecker, byte_extent
from graphslot.api import build as build_full

MAX_BS, MAX_NUM_TOKENS = 4, 8

SPEC = textwrap.dedent("""
    name: strict
    params:
      fill: {type: int, default: 1, runtime: true}
      gate: {type: bool, default: false}
    slots:
      - {name: ids, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: zero}
      - {name: lens, shape: [max_bs], dtype: int32, axis: bs, padding: fill_sentinel, pad_value: fill}
      - {name: lens_cpu, shape: [max_bs], dtype: int32, axis: bs, device: cpu, padding: fill_sentinel,
         pad_value: fill}
      - {name: table, shape: [max_bs, 4], dtype: float32, axis: bs, padding: zero}
      - {name: rope, shape: [3, max_num_tokens], dtype: int64, axis: tokens, slice_dim: 1, padding: zero,
         optional: true}
      - {name: flags, shape: [2], dtype: bool, axis: none, padding: keep_pad}
      - {name: extra, shape: [max_bs], dtype: int64, axis: bs, padding: zero, source: take_extra}
      - {name: meta.mask, shape: [max_bs], dtype: bool, axis: bs, padding: zero, source: dotted_field}
      - {name: count, shape: [1], dtype: int32, axis: none, copy_from_fb: false,
         post_fill: count_non_padded_tokens}
      - {name: gated, shape: [max_bs], dtype: int64, axis: bs, padding: zero, enabled_if: gate}
""")


def take_extra(fb, ctx):
    """A user source hook on a plain name: the batch's extra rows (None: no copy)."""
    return fb.extra_rows


HOOKS = {"take_extra": take_extra}
MODES = ["generated", "interpreted"]


@pytest.fixture(autouse=True)
def no_strict_env(monkeypatch):
    monkeypatch.delenv("GRAPHSLOT_STRICT", raising=False)


def build(mode, device="cpu", **kwargs):
    spec = gs.parse_spec(SPEC, path="strict.yaml")
    return build_full(spec, device=device, max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, impl=mode, hooks=HOOKS,
                      **kwargs)


class Batch:
    pass


def good_batch(raw_bs=2, raw_num_tokens=3, device="cpu"):
    """A batch every slot accepts: ``raw`` rows along each sliced dimension."""
    fb = Batch()
    fb.batch_size = raw_bs
    fb.ids = torch.arange(10, 10 + raw_num_tokens, device=device)
    fb.lens = torch.arange(5, 5 + raw_bs, dtype=torch.int32, device=device)
    fb.lens_cpu = torch.arange(5, 5 + raw_bs, dtype=torch.int32)
    fb.table = torch.ones(raw_bs, 4, device=device)
    fb.rope = torch.full((3, raw_num_tokens), 7, dtype=torch.int64, device=device)
    fb.flags = torch.tensor([True, False], device=device)
    fb.extra_rows = torch.full((raw_bs,), 9, dtype=torch.int64, device=device)
    fb.meta = types.SimpleNamespace(mask=torch.ones(raw_bs, dtype=torch.bool, device=device))
    fb.count = "not read: computed slot"
    fb.gated = "not read: disabled slot"
    return fb


def buffers(reg):
    return {name: reg.slot(name).buffer.clone() for name in reg.slot_names()}


def assert_untouched(reg, before):
    for name, value in before.items():
        assert torch.equal(reg.slot(name).buffer, value), f"spec 'strict', slot '{name}' was written before the check"


@pytest.fixture(params=["strict=True", "GRAPHSLOT_STRICT=1"])
def how(request, monkeypatch):
    if request.param == "GRAPHSLOT_STRICT=1":
        monkeypatch.setenv("GRAPHSLOT_STRICT", "1")
        return {}
    return {"strict": True}


@pytest.fixture(params=MODES)
def strict_reg(request, how):
    reg = build(request.param, **how)
    assert reg.strict and reg.impl == request.param
    return reg


# --- what strict mode accepts ---------------------------------------------------------------


def test_a_good_batch_fills_exactly_as_without_strict_mode(strict_reg, monkeypatch):
    monkeypatch.delenv("GRAPHSLOT_STRICT", raising=False)
    plain = build(strict_reg.impl)
    assert not plain.strict
    for raw_bs, padded_bs, raw_nt, padded_nt in [(2, 3, 3, 5), (4, 4, 8, 8), (0, 0, 0, 0), (1, 4, 0, 8)]:
        for reg in (strict_reg, plain):
            reg.fill_from(good_batch(raw_bs, raw_nt), raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_nt,
                          padded_num_tokens=padded_nt)
        for name in plain.slot_names():
            assert torch.equal(strict_reg.slot(name).buffer, plain.slot(name).buffer), name
    assert strict_reg.slot("count").buffer.tolist() == [0]


def test_absent_or_none_fields_that_may_be_absent_are_accepted(strict_reg):
    fb = good_batch()
    fb.rope = None  # optional
    fb.extra_rows = None  # a source returning None: no copy
    fb.meta = types.SimpleNamespace()  # dotted_field finds nothing: None
    strict_reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    del fb.rope
    strict_reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert strict_reg.slot("ids").buffer[:3].tolist() == [10, 11, 12]


@pytest.mark.parametrize("rows", [0, 1, 3, MAX_BS])
def test_a_source_may_return_any_row_count_up_to_the_capacity(strict_reg, rows):
    fb = good_batch(raw_bs=2)
    fb.extra_rows = torch.arange(1, rows + 1)
    strict_reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert strict_reg.slot("extra").buffer[:rows].tolist() == list(range(1, rows + 1))


def test_disabled_and_computed_slots_are_not_checked(strict_reg):
    fb = good_batch()
    fb.gated = [1, 2, 3]  # the slot is disabled with gate=false
    fb.count = torch.zeros(9, dtype=torch.float64)  # copy_from_fb: false — never read
    strict_reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert not strict_reg.has_slot("gated")


# --- what strict mode rejects, and how it says so -------------------------------------------


def _set(name, value):
    def mutate(fb):
        setattr(fb, name, value)

    return mutate


def _delete(name):
    def mutate(fb):
        delattr(fb, name)

    return mutate


NOT_OPTIONAL = ("the batch field is None, but the slot is not optional; set it on the batch, or declare "
                "`optional: true` in the spec")

MISMATCHES = {
    "not a tensor": (_set("ids", [10, 11, 12]),
                     "spec 'strict', slot 'ids': expected a torch.Tensor, got list [10, 11, 12]"),
    "not a tensor (host slot)": (_set("lens_cpu", 5),
                                 "spec 'strict', slot 'lens_cpu': expected a torch.Tensor, got int 5"),
    "wrong dtype": (
        _set("lens", torch.tensor([5, 6])),
        "spec 'strict', slot 'lens': expected dtype torch.int32, got torch.int64 (copy_ would cast silently)"),
    "wrong dtype (float)": (
        _set("table", torch.ones(2, 4, dtype=torch.float64)),
        "spec 'strict', slot 'table': expected dtype torch.float32, got torch.float64 (copy_ would cast silently)"),
    "too short along the tokens axis": (
        _set("ids", torch.tensor([10, 11])),
        "spec 'strict', slot 'ids': expected shape [3], got [2] (copy_ would broadcast or fail)"),
    "too long along the bs axis": (
        _set("lens", torch.arange(4, dtype=torch.int32)),
        "spec 'strict', slot 'lens': expected shape [2], got [4] (copy_ would broadcast or fail)"),
    "one row that would broadcast": (
        _set("lens", torch.tensor([5], dtype=torch.int32)),
        "spec 'strict', slot 'lens': expected shape [2], got [1] (copy_ would broadcast or fail)"),
    "wrong length along slice_dim 1": (
        _set("rope", torch.zeros(3, 2, dtype=torch.int64)),
        "spec 'strict', slot 'rope': expected shape [3, 3], got [3, 2] (copy_ would broadcast or fail)"),
    "wrong leading extent": (
        _set("rope", torch.zeros(2, 3, dtype=torch.int64)),
        "spec 'strict', slot 'rope': expected shape [3, 3], got [2, 3] (copy_ would broadcast or fail)"),
    "wrong trailing dims": (
        _set("table", torch.ones(2, 5)),
        "spec 'strict', slot 'table': expected shape [2, 4], got [2, 5] (copy_ would broadcast or fail)"),
    "missing trailing dim": (
        _set("table", torch.ones(2)),
        "spec 'strict', slot 'table': expected shape [2, 4], got [2] (copy_ would broadcast or fail)"),
    "axis none: whole buffer": (
        _set("flags", torch.tensor([True])),
        "spec 'strict', slot 'flags': expected shape [2], got [1] (copy_ would broadcast or fail)"),
    "None in a non-optional slot": (_set("lens", None), f"spec 'strict', slot 'lens': {NOT_OPTIONAL}"),
    "absent non-optional field": (_delete("table"), "spec 'strict', slot 'table': the batch has no field 'table', "
                                                   "but the slot is not optional; set it on the batch, or declare "
                                                   "`optional: true` in the spec"),
    "source returns more rows than capacity": (
        _set("extra_rows", torch.arange(MAX_BS + 1)),
        "spec 'strict', slot 'extra': source returned 5 rows, more than the capacity 4"),
    "source returns the wrong dtype": (
        _set("extra_rows", torch.tensor([1, 2], dtype=torch.int32)),
        "spec 'strict', slot 'extra': expected dtype torch.int64, got torch.int32 (copy_ would cast silently)"),
    "source returns a non-tensor": (
        _set("extra_rows", [1, 2]),
        "spec 'strict', slot 'extra': expected a torch.Tensor, got list [1, 2]"),
    "dotted source of the wrong dtype": (
        _set("meta", types.SimpleNamespace(mask=torch.ones(2, dtype=torch.int64))),
        "spec 'strict', slot 'meta.mask': expected dtype torch.bool, got torch.int64 (copy_ would cast silently)"),
    "dotted source with wrong trailing dims": (
        _set("meta", types.SimpleNamespace(mask=torch.ones(2, 1, dtype=torch.bool))),
        "spec 'strict', slot 'meta.mask': expected shape [4], got [2, 1] (copy_ would broadcast or fail)"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_each_mismatch_is_a_slot_error_naming_slot_expected_and_got(strict_reg, case):
    mutate, message = MISMATCHES[case]
    # a first, good step
    strict_reg.fill_from(good_batch(), raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    before = buffers(strict_reg)
    fb = good_batch()
    mutate(fb)
    with pytest.raises(gs.SlotError) as info:
        strict_reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert str(info.value) == message
    assert_untouched(strict_reg, before)  # checked before anything is copied


COUNTS = {
    "raw > padded (bs)": ((3, 2, 3, 5), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=3, "
                                        "padded=2, capacity=4"),
    "raw > padded (tokens)": ((2, 3, 6, 5), "tokens counts must satisfy 0 <= raw <= padded <= capacity, got "
                                            "raw=6, padded=5, capacity=8"),
    "padded > capacity (bs)": ((2, 5, 3, 5), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=2, "
                                             "padded=5, capacity=4"),
    "padded > capacity (tokens)": ((2, 3, 3, 9), "tokens counts must satisfy 0 <= raw <= padded <= capacity, got "
                                                 "raw=3, padded=9, capacity=8"),
    "negative raw": ((-1, 3, 3, 5), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=-1, "
                                    "padded=3, capacity=4"),
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_impossible_step_sizes_are_slot_errors(strict_reg, case):
    sizes, message = COUNTS[case]
    raw_bs, _, raw_nt, _ = sizes
    fb = good_batch(max(raw_bs, 0), raw_nt)
    before = buffers(strict_reg)
    with pytest.raises(gs.SlotError) as info:
        strict_reg.fill_from(fb, **dict(zip(("raw_bs", "padded_bs", "raw_num_tokens", "padded_num_tokens"), sizes)))
    assert str(info.value) == "spec 'strict': " + message
    assert_untouched(strict_reg, before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_a_source_on_the_wrong_device_is_a_slot_error(mode):
    reg = build(mode, device="cuda", strict=True)
    reg.fill_from(good_batch(device="cuda"), raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    fb = good_batch(device="cuda")
    fb.ids = fb.ids.cpu()
    with pytest.raises(gs.SlotError) as info:
        reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert str(info.value) == f"spec 'strict', slot 'ids': expected device {reg.slot('ids').buffer.device}, got cpu"
    fb = good_batch(device="cuda")
    fb.lens_cpu = fb.lens_cpu.cuda()  # a host slot wants a host tensor
    with pytest.raises(gs.SlotError) as info:
        reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert str(info.value) == f"spec 'strict', slot 'lens_cpu': expected device cpu, got {fb.lens_cpu.device}"


# --- without strict mode nothing is checked -------------------------------------------------


@pytest.mark.parametrize("env", [None, "", "0"])
@pytest.mark.parametrize("mode", MODES)
def test_strict_is_off_by_default_and_with_graphslot_strict_0(monkeypatch, mode, env):
    if env is not None:
        monkeypatch.setenv("GRAPHSLOT_STRICT", env)
    assert not build(mode).strict


@pytest.mark.parametrize("mode", MODES)
def test_strict_mode_is_chosen_at_build_time(monkeypatch, mode):
    reg = build(mode)
    monkeypatch.setenv("GRAPHSLOT_STRICT", "1")  # too late for this registry
    fb = good_batch()
    fb.lens = torch.tensor([5, 6])
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert not reg.strict and build(mode).strict


def test_without_strict_a_generated_registry_checks_a_step_size_once(monkeypatch):
    calls = []
    for method in ("counts", "view_counts", "diagnose", "strict_fill", "plain_source"):
        original = getattr(StepChecker, method)
        monkeypatch.setattr(StepChecker, method,
                            lambda self, *a, _m=method, _f=original: (calls.append(_m), _f(self, *a))[1])
    reg, fb = build("generated"), good_batch()
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    reg.extract(fb, padded_bs=3, padded_num_tokens=5)
    first_seen = ["counts", "view_counts", "counts"]  # view_counts checks through counts
    assert calls == first_seen
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    reg.extract(fb, padded_bs=3, padded_num_tokens=5)
    assert calls == first_seen  # nothing more on later steps of that size
    strict = build("generated", strict=True)
    strict.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert calls.count("strict_fill") == 1


@pytest.mark.parametrize("mode", MODES)
def test_without_strict_a_wrong_dtype_is_cast_silently(mode):
    """What strict mode exists to catch: copy_ casts (int64 → int32, float64 → float32)."""
    reg = build(mode)
    fb = good_batch()
    fb.lens = torch.tensor([5, 6])  # int64 into an int32 slot
    fb.table = torch.full((2, 4), 2.5, dtype=torch.float64)
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert reg.slot("lens").buffer.dtype == torch.int32
    assert reg.slot("lens").buffer.tolist() == [5, 6, 1, 1]
    assert reg.slot("table").buffer[:2].tolist() == [[2.5] * 4] * 2
    with pytest.raises(gs.SlotError, match=r"^spec 'strict', slot 'lens': expected dtype torch.int32, got torch.int64"):
        build(mode, strict=True).fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)


def test_a_generated_registry_without_strict_calls_the_generated_fill_from_directly():
    reg = build("generated")
    fill_from = reg.fill_from
    code = fill_from.__code__
    assert fill_from.__name__ == "fill_from"
    assert fill_from.__qualname__ == "bind.<locals>.fill_from"
    assert code.co_filename == reg.module.__file__
    assert code.co_filename.startswith("<graphslot-generated strict-") and code.co_filename.endswith(".py>")
    assert linecache.getline(code.co_filename, code.co_firstlineno).strip() == "def fill_from("
    assert reg.extract.__name__ == "extract" and reg.extract.__code__.co_filename == code.co_filename


def test_a_strict_generated_registry_checks_then_calls_the_generated_fill_from():
    reg = build("generated", strict=True)
    assert reg.fill_from.__code__.co_filename != reg.module.__file__  # the checking wrappers
    assert reg.extract.__code__.co_filename != reg.module.__file__
    fb = good_batch()
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    assert reg.slot("ids").buffer[:5].tolist() == [10, 11, 12, 0, 0]


# --- the rest of the contract, in both modes ---------------------------------------------------

ALIAS = textwrap.dedent("""
    name: alias
    slots:
      - {name: x, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
      - {name: y, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: -1}
      - {name: z, shape: [max_bs], dtype: int64, axis: bs, padding: zero, source: rows}
""")


def alias_registry(mode, strict):
    reg = build_full(gs.parse_spec(ALIAS, path="alias.yaml"), max_bs=8, max_num_tokens=8, impl=mode, strict=strict,
                            hooks={"rows": lambda fb, ctx: fb.z_rows}, device="cpu")
    for name in ("x", "y", "z"):
        reg.slot(name).buffer.copy_(torch.arange(8) + 10 * (1 + "xyz".index(name)))
    return reg


def alias_batch(reg, x=None, y=None):
    fb = types.SimpleNamespace(x=torch.tensor([1, 2]), y=torch.tensor([3, 4]), z_rows=torch.tensor([5]))
    fb.x = reg.slot("x").buffer[x[0]:x[1]] if x else fb.x
    fb.y = reg.slot("y").buffer[y[0]:y[1]] if y else fb.y
    return fb


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_slots_own_head_view_passed_back_copies_onto_itself(mode, strict):
    reg = alias_registry(mode, strict)
    reg.fill_from(alias_batch(reg, x=(0, 2)), raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.slot("x").buffer[:5].tolist() == [10, 11, 0, 0, 14]


@pytest.mark.parametrize("mode", MODES)
def test_without_strict_a_source_viewing_its_own_tail_is_read_before_the_reset(mode):
    reg = alias_registry(mode, strict=False)
    # y's head <- y[2:4], then its tail reset
    reg.fill_from(alias_batch(reg, y=(2, 4)), raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.slot("y").buffer[:5].tolist() == [22, 23, -1, -1, 24]


@pytest.mark.parametrize("mode", MODES)
def test_without_strict_a_source_overlapping_its_head_is_refused_by_copy_naming_the_slot(mode):
    reg = alias_registry(mode, strict=False)
    with pytest.raises(gs.SlotError, match="slot 'x': the source aliases the buffer of slot 'x'") as caught:
        reg.fill_from(alias_batch(reg, x=(1, 3)), raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert "refer to a single memory location" in str(caught.value.__cause__)  # torch's refusal, kept as the cause


class CountingBatch(types.SimpleNamespace):
    """A batch that counts each read of its fields (a property on a real batch may compute or move a tensor)."""

    def __getattribute__(self, name):
        if not name.startswith("__"):
            reads = object.__getattribute__(self, "__dict__").setdefault("__reads", {})
            reads[name] = reads.get(name, 0) + 1
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("error", [RuntimeError("the copy failed"), None], ids=["exc re-raised", "aliasing"])
def test_diagnose_reads_each_batch_field_once(error):
    reg = alias_registry("interpreted", strict=False)
    fb = CountingBatch(**vars(alias_batch(reg, x=None if error else (1, 3))))
    exc = error or RuntimeError("unsupported operation: more than one element refers to a single memory location")
    with pytest.raises((RuntimeError, gs.SlotError)) as info:
        reg.checker.diagnose(fb, 2, 2, exc)
    assert (info.value is exc) == (error is not None)  # no slot to blame: the fill's own error, unchanged
    assert {name: n for name, n in vars(fb)["__reads"].items() if name in ("x", "y")} == {"x": 1, "y": 1}


@pytest.mark.parametrize("batch, message", [
    (dict(x=(1, 3)), "slot 'x': the source aliases the buffer of slot 'x'"),
    (dict(y=(2, 4)), "slot 'y': the source aliases the buffer of slot 'y'"),
    (dict(y=(0, 2), x=(0, 2)), None),  # both exactly their own heads: fine
], ids=["overlapping own head", "own tail", "own heads"])
@pytest.mark.parametrize("mode", MODES)
def test_strict_rejects_a_source_aliasing_a_buffer(mode, batch, message):
    reg = alias_registry(mode, strict=True)
    before = buffers(reg)
    fb = alias_batch(reg, **batch)
    if message is None:
        reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
        return
    with pytest.raises(gs.SlotError) as info:
        reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert str(info.value) == (f"spec 'alias', {message} (a view of a static buffer other than this slot's own "
                               "head); copy it first, or pass the batch's own tensor")
    assert_untouched(reg, before)


@pytest.mark.parametrize("mode", MODES)
def test_strict_rejects_a_source_aliasing_another_slots_buffer(mode):
    reg = alias_registry(mode, strict=True)
    fb = alias_batch(reg)
    fb.x = reg.slot("y").buffer[:2]
    with pytest.raises(gs.SlotError, match=r"^spec 'alias', slot 'x': the source aliases the buffer of slot 'y'"):
        reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)


ALIASES = "(a view of a static buffer other than this slot's own head); copy it first, or pass the batch's own tensor"


def dlpack_view(buffer, start, stop):
    """A view made by DLPack: a storage object of its own, starting at ``buffer[start]``."""
    return torch.from_dlpack(buffer[start:stop])


def numpy_view(buffer, start, stop):
    """A view made through numpy: a storage object of its own, at an offset."""
    return torch.from_numpy(buffer.numpy()[start:stop])


def with_fields(fb, **fields):
    for name, value in fields.items():
        setattr(fb, name, value)
    return fb


@pytest.mark.parametrize("field, owner, start", [("x", "x", 2), ("x", "x", 1), ("y", "x", 5), ("x", "y", 1)])
@pytest.mark.parametrize("make", [dlpack_view, numpy_view])
@pytest.mark.parametrize("mode", MODES)
def test_strict_rejects_a_dlpack_or_numpy_view_of_a_buffer_at_an_offset(mode, make, field, owner, start):
    reg = alias_registry(mode, strict=True)
    before = buffers(reg)
    view = make(reg.slot(owner).buffer, start, start + 2)
    # Another storage object than the buffer's: only its bytes tell that it aliases.
    assert view.untyped_storage().data_ptr() != reg.slot(owner).buffer.untyped_storage().data_ptr()
    with pytest.raises(gs.SlotError) as info:
        reg.fill_from(with_fields(alias_batch(reg), **{field: view}),
                      raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert str(info.value) == f"spec 'alias', slot '{field}': the source aliases the buffer of slot '{owner}' {ALIASES}"
    assert_untouched(reg, before)


@pytest.mark.parametrize("make", [dlpack_view, numpy_view])
@pytest.mark.parametrize("mode", MODES)
def test_strict_accepts_a_dlpack_or_numpy_view_of_exactly_its_own_head(mode, make):
    reg = alias_registry(mode, strict=True)
    reg.fill_from(with_fields(alias_batch(reg), x=make(reg.slot("x").buffer, 0, 2)),
                  raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.slot("x").buffer[:5].tolist() == [10, 11, 0, 0, 14]  # copied onto itself, tail reset


def adopted_alias_registry(mode):
    """x, y and z adopted from one tensor, back to back: ``arena[0:8]``, ``[8:16]``, ``[16:24]``."""
    arena = torch.arange(26)
    reg = build_full(gs.parse_spec(ALIAS, path="alias.yaml"), max_bs=8, max_num_tokens=8, impl=mode, strict=True,
                            hooks={"rows": lambda fb, ctx: fb.z_rows},
                            bind={"x": arena[0:8], "y": arena[8:16], "z": arena[16:24]}, device="cpu")
    return reg, arena


@pytest.mark.parametrize("view", [lambda a: a[24:26], lambda a: torch.from_numpy(a.numpy()[24:26]),
                                  lambda a: torch.from_dlpack(a[24:26])], ids=["slice", "numpy", "dlpack"])
@pytest.mark.parametrize("mode", MODES)
def test_strict_accepts_a_source_next_to_a_buffer_in_the_same_storage(mode, view):
    reg, arena = adopted_alias_registry(mode)
    # right after z's bytes: no overlap
    reg.fill_from(with_fields(alias_batch(reg), x=view(arena)),
                  raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.slot("x").buffer[:4].tolist() == [24, 25, 0, 0]


@pytest.mark.parametrize("rows, owners", [((23, 25), ["z"]), ((6, 8), ["x"]), ((7, 9), ["x", "y"])],
                         ids=["last byte of z", "inside x", "across x and y"])
@pytest.mark.parametrize("mode", MODES)
def test_strict_rejects_a_source_overlapping_a_buffer_by_one_row(mode, rows, owners):
    reg, arena = adopted_alias_registry(mode)
    before = buffers(reg)
    fb = with_fields(alias_batch(reg), y=torch.from_numpy(arena.numpy()[rows[0]:rows[1]]))
    with pytest.raises(gs.SlotError) as info:
        reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert str(info.value) in [f"spec 'alias', slot 'y': the source aliases the buffer of slot '{owner}' {ALIASES}"
                               for owner in owners]
    assert_untouched(reg, before)


def test_byte_extent_spans_a_strided_view_from_its_first_to_its_last_element():
    base = torch.zeros(3, 8, dtype=torch.int64)
    start = base.data_ptr()
    assert byte_extent(base) == (start, start + 3 * 8 * 8)
    assert byte_extent(base[:, 1:3]) == (start + 8, start + (2 * 8 + 2 + 1) * 8)  # rows 0..2, columns 1..2
    assert byte_extent(base.t()[2]) == (start + 2 * 8, start + (2 * 8 + 2 + 1) * 8)  # a column: stride 8
    assert byte_extent(base[:, 1:1]) == (0, 0)  # no elements, no bytes


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_source_hook_runs_once_per_fill(mode, strict):
    calls = []
    spec = gs.parse_spec(ALIAS, path="alias.yaml")
    reg = build_full(spec, max_bs=8, max_num_tokens=8, impl=mode, strict=strict,
                            hooks={"rows": lambda fb, ctx: calls.append(1) or fb.z_rows}, device="cpu")
    reg.fill_from(alias_batch(reg), raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert calls == [1]
    assert reg.slot("z").buffer[:4].tolist() == [5, 0, 0, 0]  # [:len(src)] after the tail reset


EXTRACT_COUNTS = {
    "padded beyond the capacity": ((12, 4), "spec 'strict': bs counts must satisfy 0 <= raw <= padded <= "
                                            "capacity, got raw=0, padded=12, capacity=4"),
    "negative": ((2, -1), "spec 'strict': tokens counts must satisfy 0 <= raw <= padded <= capacity, got "
                          "raw=0, padded=-1, capacity=8"),
    "float": ((2.0, 4), "spec 'strict': padded bs count must be an int, got float 2.0"),
}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("case", list(EXTRACT_COUNTS))
@pytest.mark.parametrize("mode", MODES)
def test_extract_checks_its_counts(mode, case, strict):
    counts, message = EXTRACT_COUNTS[case]
    reg = build(mode, strict=strict)
    with pytest.raises(gs.SlotError) as info:
        reg.extract(good_batch(), **dict(zip(("padded_bs", "padded_num_tokens"), counts)))
    assert str(info.value) == message


@pytest.mark.parametrize("mode", MODES)
def test_counts_are_checked_on_the_first_step_of_a_size_without_strict_mode(mode):
    reg = build(mode)
    with pytest.raises(gs.SlotError, match=r"^spec 'strict': raw bs count must be an int, got float 2.0$"):
        reg.fill_from(good_batch(), raw_bs=2.0, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    with pytest.raises(gs.SlotError, match="got raw=3, padded=2, capacity=4$"):
        reg.fill_from(good_batch(3), raw_bs=3, padded_bs=2, raw_num_tokens=3, padded_num_tokens=5)
    reg.fill_from(good_batch(), raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    # equal to a size already checked: not checked again
    reg.fill_from(good_batch(), raw_bs=2.0, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    with pytest.raises(gs.SlotError, match="must be an int, got float 2.0$"):
        # strict: every call
        build(mode, strict=True).fill_from(good_batch(), raw_bs=2.0, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)


BATCH_FIELDS = [("ids", torch.Tensor), ("lens", torch.Tensor), ("lens_cpu", torch.Tensor), ("table", torch.Tensor),
                ("flags", torch.Tensor), ("extra_rows", torch.Tensor), ("meta", types.SimpleNamespace),
                ("rope", object, None),
                ("extra", object, None),  # a slot fed by a source hook: extract sets it
                ("count", object, None),  # a computed slot: extract sets it
                ("batch_size", int, 0)]
FrozenBatch = dataclasses.make_dataclass("FrozenBatch", BATCH_FIELDS, frozen=True)
SlottedBatch = dataclasses.make_dataclass("SlottedBatch", BATCH_FIELDS, frozen=True, slots=True)


@pytest.mark.parametrize("batch_type", [FrozenBatch, SlottedBatch])
@pytest.mark.parametrize("mode", MODES)
def test_extract_works_on_frozen_and_slotted_dataclass_batches(mode, batch_type):
    reg = build(mode)
    good = good_batch()
    fb = batch_type(**{f.name: getattr(good, f.name) for f in dataclasses.fields(batch_type)
                       if f.name not in ("rope", "extra", "count", "batch_size")}, batch_size=2)
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=5)
    view = reg.extract(fb, padded_bs=3, padded_num_tokens=5)
    assert type(view) is batch_type and view is not fb
    assert view.batch_size == 3 and fb.batch_size == 2
    assert view.ids.data_ptr() == reg.slot("ids").buffer.data_ptr() and view.ids.shape == (5,)
    assert fb.ids.tolist() == [10, 11, 12]  # the template keeps its own tensors
    assert view.rope is None  # an optional slot absent this step carries the None


@pytest.mark.parametrize("mode", MODES)
def test_every_shape_expression_the_interpreter_accepts_builds_in_both_modes(mode):
    spec = gs.parse_spec(textwrap.dedent("""
        name: capacity
        slots:
          - {name: x, shape: ["max_bs // 100"], dtype: int64, axis: none, padding: keep_pad}
          - {name: y, shape: ["max_bs - 60", max_bs], dtype: int64, axis: bs, slice_dim: 1, padding: zero}
    """), path="capacity.yaml")
    reg = gs.build_registry(spec, max_bs=300, max_num_tokens=4, impl=mode, device="cpu")
    assert reg.slot("x").buffer.shape == (3,) and reg.slot("y").buffer.shape == (240, 300)
    fb = types.SimpleNamespace(x=torch.tensor([1, 2, 3]), y=torch.ones(240, 2, dtype=torch.int64))
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=1, padded_num_tokens=1)
    assert reg.slot("y").buffer[:, :5].sum(1).tolist() == [2] * 240
