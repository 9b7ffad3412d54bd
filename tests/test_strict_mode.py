"""Strict mode: every mismatch between a batch and the registry is a SlotError.

``Tensor.copy_`` casts and broadcasts silently, so a batch field of the wrong dtype or
length would corrupt a buffer without an error. A strict registry checks a step's
sources (and sizes) before it copies anything, and says which slot, what it expected
and what came. Strict mode is chosen when the registry is built — ``strict=True`` or
``GRAPHSLOT_STRICT=1`` — so a registry that is not strict runs no check at all (and a
generated one calls the generated ``fill_from`` directly). Both registry modes behave
the same.
"""

from __future__ import annotations

import linecache
import textwrap
import types

import pytest
import torch

import graphslot as gs
import graphslot.framework.registry as registry_module

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
    spec = gs.parse_spec(SPEC, source="strict.yaml")
    return gs.build_registry(spec, MAX_BS, MAX_NUM_TOKENS, device=device, mode=mode, hooks=HOOKS, **kwargs)


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
        assert torch.equal(reg.slot(name).buffer, value), f"slot '{name}' was written before the check"


@pytest.fixture(params=["strict=True", "GRAPHSLOT_STRICT=1"])
def how(request, monkeypatch):
    if request.param == "GRAPHSLOT_STRICT=1":
        monkeypatch.setenv("GRAPHSLOT_STRICT", "1")
        return {}
    return {"strict": True}


@pytest.fixture(params=MODES)
def strict_reg(request, how):
    reg = build(request.param, **how)
    assert reg.strict and reg.mode == request.param
    return reg


# --- what strict mode accepts ---------------------------------------------------------------


def test_a_good_batch_fills_exactly_as_without_strict_mode(strict_reg, monkeypatch):
    monkeypatch.delenv("GRAPHSLOT_STRICT", raising=False)
    plain = build(strict_reg.mode)
    assert not plain.strict
    for raw_bs, padded_bs, raw_nt, padded_nt in [(2, 3, 3, 5), (4, 4, 8, 8), (0, 0, 0, 0), (1, 4, 0, 8)]:
        for reg in (strict_reg, plain):
            reg.fill_from(good_batch(raw_bs, raw_nt), raw_bs, padded_bs, raw_nt, padded_nt)
        for name in plain.slot_names():
            assert torch.equal(strict_reg.slot(name).buffer, plain.slot(name).buffer), name
    assert strict_reg.slot("count").buffer.tolist() == [0]


def test_absent_or_none_fields_that_may_be_absent_are_accepted(strict_reg):
    fb = good_batch()
    fb.rope = None  # optional
    fb.extra_rows = None  # a source returning None: no copy
    fb.meta = types.SimpleNamespace()  # dotted_field finds nothing: None
    strict_reg.fill_from(fb, 2, 3, 3, 5)
    del fb.rope
    strict_reg.fill_from(fb, 2, 3, 3, 5)
    assert strict_reg.slot("ids").buffer[:3].tolist() == [10, 11, 12]


@pytest.mark.parametrize("rows", [0, 1, 3, MAX_BS])
def test_a_source_may_return_any_row_count_up_to_the_capacity(strict_reg, rows):
    fb = good_batch(raw_bs=2)
    fb.extra_rows = torch.arange(1, rows + 1)
    strict_reg.fill_from(fb, 2, 3, 3, 5)
    assert strict_reg.slot("extra").buffer[:rows].tolist() == list(range(1, rows + 1))


def test_disabled_and_computed_slots_are_not_checked(strict_reg):
    fb = good_batch()
    fb.gated = [1, 2, 3]  # the slot is disabled with gate=false
    fb.count = torch.zeros(9, dtype=torch.float64)  # copy_from_fb: false — never read
    strict_reg.fill_from(fb, 2, 3, 3, 5)
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
    "not a tensor": (_set("ids", [10, 11, 12]), "slot 'ids': expected a torch.Tensor, got list"),
    "not a tensor (host slot)": (_set("lens_cpu", 5), "slot 'lens_cpu': expected a torch.Tensor, got int"),
    "wrong dtype": (_set("lens", torch.tensor([5, 6])),
                    "slot 'lens': expected dtype torch.int32, got torch.int64 (copy_ would cast silently)"),
    "wrong dtype (float)": (_set("table", torch.ones(2, 4, dtype=torch.float64)),
                            "slot 'table': expected dtype torch.float32, got torch.float64 (copy_ would cast "
                            "silently)"),
    "too short along the tokens axis": (_set("ids", torch.tensor([10, 11])),
                                        "slot 'ids': expected shape [3], got [2] (copy_ would broadcast or fail)"),
    "too long along the bs axis": (_set("lens", torch.arange(4, dtype=torch.int32)),
                                   "slot 'lens': expected shape [2], got [4] (copy_ would broadcast or fail)"),
    "one row that would broadcast": (_set("lens", torch.tensor([5], dtype=torch.int32)),
                                     "slot 'lens': expected shape [2], got [1] (copy_ would broadcast or fail)"),
    "wrong length along slice_dim 1": (_set("rope", torch.zeros(3, 2, dtype=torch.int64)),
                                       "slot 'rope': expected shape [3, 3], got [3, 2] (copy_ would broadcast or "
                                       "fail)"),
    "wrong leading extent": (_set("rope", torch.zeros(2, 3, dtype=torch.int64)),
                             "slot 'rope': expected shape [3, 3], got [2, 3] (copy_ would broadcast or fail)"),
    "wrong trailing dims": (_set("table", torch.ones(2, 5)),
                            "slot 'table': expected shape [2, 4], got [2, 5] (copy_ would broadcast or fail)"),
    "missing trailing dim": (_set("table", torch.ones(2)),
                             "slot 'table': expected shape [2, 4], got [2] (copy_ would broadcast or fail)"),
    "axis none: whole buffer": (_set("flags", torch.tensor([True])),
                                "slot 'flags': expected shape [2], got [1] (copy_ would broadcast or fail)"),
    "None in a non-optional slot": (_set("lens", None), f"slot 'lens': {NOT_OPTIONAL}"),
    "absent non-optional field": (_delete("table"), f"slot 'table': {NOT_OPTIONAL}"),
    "source returns more rows than capacity": (_set("extra_rows", torch.arange(MAX_BS + 1)),
                                               "slot 'extra': source returned 5 rows, more than the capacity 4"),
    "source returns the wrong dtype": (_set("extra_rows", torch.tensor([1, 2], dtype=torch.int32)),
                                       "slot 'extra': expected dtype torch.int64, got torch.int32 (copy_ would "
                                       "cast silently)"),
    "source returns a non-tensor": (_set("extra_rows", [1, 2]), "slot 'extra': expected a torch.Tensor, got list"),
    "dotted source of the wrong dtype": (_set("meta", types.SimpleNamespace(mask=torch.ones(2, dtype=torch.int64))),
                                         "slot 'meta.mask': expected dtype torch.bool, got torch.int64 (copy_ would "
                                         "cast silently)"),
    "dotted source with wrong trailing dims": (
        _set("meta", types.SimpleNamespace(mask=torch.ones(2, 1, dtype=torch.bool))),
        "slot 'meta.mask': expected shape [4], got [2, 1] (copy_ would broadcast or fail)"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_each_mismatch_is_a_slot_error_naming_slot_expected_and_got(strict_reg, case):
    mutate, message = MISMATCHES[case]
    strict_reg.fill_from(good_batch(), 2, 3, 3, 5)  # a first, good step
    before = buffers(strict_reg)
    fb = good_batch()
    mutate(fb)
    with pytest.raises(gs.SlotError) as info:
        strict_reg.fill_from(fb, 2, 3, 3, 5)
    assert str(info.value) == message
    assert_untouched(strict_reg, before)  # checked before anything is copied


COUNTS = {
    "raw > padded (bs)": ((3, 2, 3, 5), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=3, "
                                        "padded=2, capacity=4 (registry 'strict')"),
    "raw > padded (tokens)": ((2, 3, 6, 5), "tokens counts must satisfy 0 <= raw <= padded <= capacity, got "
                                            "raw=6, padded=5, capacity=8 (registry 'strict')"),
    "padded > capacity (bs)": ((2, 5, 3, 5), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=2, "
                                             "padded=5, capacity=4 (registry 'strict')"),
    "padded > capacity (tokens)": ((2, 3, 3, 9), "tokens counts must satisfy 0 <= raw <= padded <= capacity, got "
                                                 "raw=3, padded=9, capacity=8 (registry 'strict')"),
    "negative raw": ((-1, 3, 3, 5), "bs counts must satisfy 0 <= raw <= padded <= capacity, got raw=-1, "
                                    "padded=3, capacity=4 (registry 'strict')"),
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_impossible_step_sizes_are_slot_errors(strict_reg, case):
    sizes, message = COUNTS[case]
    raw_bs, _, raw_nt, _ = sizes
    fb = good_batch(max(raw_bs, 0), raw_nt)
    before = buffers(strict_reg)
    with pytest.raises(gs.SlotError) as info:
        strict_reg.fill_from(fb, *sizes)
    assert str(info.value) == message
    assert_untouched(strict_reg, before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_a_source_on_the_wrong_device_is_a_slot_error(mode):
    reg = build(mode, device="cuda", strict=True)
    reg.fill_from(good_batch(device="cuda"), 2, 3, 3, 5)
    fb = good_batch(device="cuda")
    fb.ids = fb.ids.cpu()
    with pytest.raises(gs.SlotError) as info:
        reg.fill_from(fb, 2, 3, 3, 5)
    assert str(info.value) == f"slot 'ids': expected device {reg.slot('ids').buffer.device}, got cpu"
    fb = good_batch(device="cuda")
    fb.lens_cpu = fb.lens_cpu.cuda()  # a host slot wants a host tensor
    with pytest.raises(gs.SlotError) as info:
        reg.fill_from(fb, 2, 3, 3, 5)
    assert str(info.value) == f"slot 'lens_cpu': expected device cpu, got {fb.lens_cpu.device}"


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
    reg.fill_from(fb, 2, 3, 3, 5)
    assert not reg.strict and build(mode).strict


@pytest.mark.parametrize("mode", MODES)
def test_without_strict_no_check_runs(monkeypatch, mode):
    calls = []

    def recording_check(registry, *args):
        calls.append((registry, args))

    monkeypatch.setattr(registry_module, "check_fill", recording_check)
    plain, strict = build(mode), build(mode, strict=True)
    fb = good_batch()
    plain.fill_from(fb, 2, 3, 3, 5)
    assert calls == []
    strict.fill_from(fb, 2, 3, 3, 5, side_inputs="side")
    assert calls == [(strict, (fb, 2, 3, 3, 5, "side"))]


@pytest.mark.parametrize("mode", MODES)
def test_without_strict_a_wrong_dtype_is_cast_silently(mode):
    """What strict mode exists to catch: copy_ casts (int64 → int32, float64 → float32)."""
    reg = build(mode)
    fb = good_batch()
    fb.lens = torch.tensor([5, 6])  # int64 into an int32 slot
    fb.table = torch.full((2, 4), 2.5, dtype=torch.float64)
    reg.fill_from(fb, 2, 3, 3, 5)
    assert reg.slot("lens").buffer.dtype == torch.int32
    assert reg.slot("lens").buffer.tolist() == [5, 6, 1, 1]
    assert reg.slot("table").buffer[:2].tolist() == [[2.5] * 4] * 2
    with pytest.raises(gs.SlotError, match=r"^slot 'lens': expected dtype torch.int32, got torch.int64"):
        build(mode, strict=True).fill_from(fb, 2, 3, 3, 5)


def test_a_generated_registry_without_strict_calls_the_generated_fill_from_directly():
    reg = build("generated")
    fill_from = reg.fill_from
    code = fill_from.__code__
    assert fill_from.__name__ == "fill_from"
    assert fill_from.__qualname__ == "bind.<locals>.fill_from"
    assert code.co_filename == reg.module.__file__
    assert code.co_filename.startswith("<graphslot-generated strict-") and code.co_filename.endswith(".py>")
    assert linecache.getline(code.co_filename, code.co_firstlineno).strip().startswith("def fill_from(fb, ")
    assert reg.extract.__name__ == "extract" and reg.extract.__code__.co_filename == code.co_filename


def test_a_strict_generated_registry_checks_then_calls_the_generated_fill_from():
    reg = build("generated", strict=True)
    assert reg.fill_from.__code__.co_filename != reg.module.__file__  # the checking wrapper
    assert reg.extract.__code__.co_filename == reg.module.__file__  # extract is never wrapped
    fb = good_batch()
    reg.fill_from(fb, 2, 3, 3, 5)
    assert reg.slot("ids").buffer[:5].tolist() == [10, 11, 12, 0, 0]
