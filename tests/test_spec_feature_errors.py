"""The rules of the slot keys for every engine (docs/spec-features.md), as exact messages: under the
defaults, under a preset, and for the params a registry or a module is built with.

Line numbers are those of ``make_slot_yaml`` (conftest): 4 shape, 5 dtype, 6 axis, 7 padding, new keys
from 8 in the order given; with ``params``, every line is one per param further down.
"""

from __future__ import annotations

import pytest

import graphslot as gs
from conftest import build_error, make_slot_yaml, parse, spec_error
from graphslot.codegen.generator import render_module
from graphslot.spec.resolve import resolve_params

STR_PARAM = {"p": {"type": "str", "default": "zero"}}


@pytest.mark.parametrize("keys, expected", [
    ({"axis": "none", "shape": [4], "padding": None, "extra_rows": 1},
     "spec.yaml:7: slot 'x': extra_rows needs axis 'bs' or 'tokens': an axis-'none' slot is never sliced, so it "
     "has no head to lengthen"),
    ({"extra_rows": -1}, "spec.yaml:8: slot 'x': extra_rows must be 0 or more, got -1"),
    ({"extra_rows": 1},
     "spec.yaml:4: slot 'x': axis 'bs' slices dimension 0 and extra_rows is 1, so that extent must be 'max_bs + 1' "
     "(the capacity plus extra_rows), got 'max_bs'"),
    ({"extra_rows": 2, "shape": ["max_bs + 1"]},
     "spec.yaml:4: slot 'x': axis 'bs' slices dimension 0 and extra_rows is 2, so that extent must be 'max_bs + 2' "
     "(the capacity plus extra_rows), got 'max_bs + 1'"),
    ({"shape": ["max_bs + 1"]},
     "spec.yaml:4: slot 'x': axis 'bs' slices dimension 0, so that extent must be 'max_bs' (the buffer's capacity), "
     "got 'max_bs + 1'"),
    ({"padding": "repeat_last", "pad_value": 3},
     "spec.yaml:8: slot 'x': pad_value is only used by fill_sentinel and fill_once, not 'repeat_last'; remove it or "
     "change the padding"),
    ({"axis": "none", "shape": [4], "padding": "repeat_last"},
     "spec.yaml:7: slot 'x': axis 'none' is never sliced, so padding 'repeat_last' would never reset anything; use "
     "keep_pad, or fill_once to initialise the buffer"),
    ({"padding": "repeat_last", "index": True},
     "spec.yaml:8: slot 'x': index slots may use padding 'repeat_last' only with extra_rows >= 1 (cu_seqlens-style "
     "offsets, where a repeated value is an empty request); else use 'zero': a repeated index would send the padded "
     "rows to a real row"),
    ({"index": "skip"},
     "spec.yaml:8: slot 'x': index: skip slots must use padding 'fill_sentinel' with a negative pad_value (got "
     "'zero'): their kernels skip the rows holding it"),
    ({"padding": "fill_sentinel", "pad_value": 0, "index": "skip"},
     "spec.yaml:8: slot 'x': index: skip needs a negative integer pad_value, got 0: a negative value indexes no row "
     "(a kernel that forgot to skip it fails loudly), a zero or more would silently write into a real row"),
    ({"padding": "fill_sentinel", "pad_value": -1.0, "dtype": "float32", "index": "skip"},
     "spec.yaml:8: slot 'x': index: skip needs a negative integer pad_value, got -1.0: a negative value indexes no "
     "row (a kernel that forgot to skip it fails loudly), a zero or more would silently write into a real row"),
    ({"padding": "keep_pad", "reset_to": "capacity"},
     "spec.yaml:8: slot 'x': reset_to 'capacity' applies to the policies that write the tail (zero, fill_sentinel, "
     "repeat_last); 'keep_pad' writes none, so there is nothing to reset to the end: remove reset_to or change the "
     "padding"),
    ({"device": "cpu", "staged": True},
     "spec.yaml:9: slot 'x': staged: true and device: cpu exclude each other: a staged slot has a host buffer the "
     "fill writes and a device buffer the graph reads; a device: cpu slot is the host buffer alone"),
    ({"reset_to": "capacty"},
     "spec.yaml:8: slot 'x': 'capacty' is not a valid reset_to (one of: padded, capacity); did you mean "
     "'capacity'?"),
    ({"index": "skp"}, "spec.yaml:8: slot 'x': 'skp' is not a valid index (one of: true, false, skip); did you mean "
     "'skip'?"),
], ids=["extra-rows-axis-none", "extra-rows-negative", "extent-without-extra", "extent-other-extra",
        "extra-extent-without-extra-rows", "repeat-last-pad-value", "repeat-last-axis-none", "index-repeat-last",
        "skip-not-sentinel", "skip-zero", "skip-float", "capacity-keep-pad", "staged-cpu", "reset-to-typo",
        "index-typo"])
def test_a_broken_rule(keys, expected):
    assert spec_error(make_slot_yaml(**keys)) == [expected]


@pytest.mark.parametrize("keys", [
    {"shape": ["max_bs + 1"], "extra_rows": 1, "padding": "repeat_last", "index": True, "staged": True},
    {"shape": ["1 + max_bs"], "extra_rows": 1, "padding": "zero", "reset_to": "capacity"},
    {"padding": "fill_sentinel", "pad_value": -1, "index": "skip", "reset_to": "capacity"},
    {"padding": "repeat_last", "reset_to": "capacity", "staged": True, "copy_from_fb": False},
    {"axis": "none", "shape": [4], "padding": None, "staged": True},
])
def test_what_the_rules_allow(keys):
    parse(make_slot_yaml(**keys))


def test_a_padding_that_is_neither_a_policy_nor_a_param():
    assert spec_error(make_slot_yaml(params=STR_PARAM, padding="q")) == [
        "spec.yaml:9: slot 'x': 'q' is not a valid padding (one of: zero, fill_sentinel, keep_pad, foreach_copy, "
        "fill_once, repeat_last) or a str param"]


@pytest.mark.parametrize("param, expected", [
    ({"type": "int", "default": 1},
     "param 'p' is int, not a str (a padding param's value is one of: zero, fill_sentinel, keep_pad, foreach_copy, "
     "fill_once, repeat_last)"),
    ({"type": "str", "default": "zero", "live": True},
     "padding names live param 'p': the choice decides what a fill does and what code is generated, and live "
     "params are read only by hooks at fill time"),
    ({"type": "str", "default": "zeros"},
     "padding names param 'p', whose value 'zeros' is not a valid padding (one of: zero, fill_sentinel, keep_pad, "
     "foreach_copy, fill_once, repeat_last); did you mean 'zero'?"),
])
def test_a_padding_param_that_cannot_choose(param, expected):
    assert spec_error(make_slot_yaml(params={"p": param}, padding="p")) == [f"spec.yaml:9: slot 'x': {expected}"]


PRESET_SPEC = """\
name: t
params:
  reset: {type: str, default: capacity}
  policy: {type: str, default: fill_sentinel}
  sentinel: {type: int, default: -1, runtime: true}
presets:
  cpu: {reset: padded, policy: keep_pad}
  odd: {reset: padding, sentinel: 2}
slots:
  - name: x
    shape: [max_num_tokens]
    dtype: int64
    axis: tokens
    padding: policy
    pad_value: sentinel
    reset_to: reset
  - name: y
    shape: [max_num_tokens]
    dtype: int64
    axis: tokens
    padding: fill_sentinel
    pad_value: sentinel
    index: skip
"""


def test_the_rules_hold_under_every_preset():
    assert spec_error(PRESET_SPEC) == [
        "spec.yaml:16: slot 'x': reset_to names param 'reset', whose value 'padding' is not a valid reset_to (one "
        "of: padded, capacity); did you mean 'padded'? (with preset 'odd')",
        "spec.yaml:22: slot 'y': index: skip needs a negative integer pad_value, got 2: a negative value indexes no "
        "row (a kernel that forgot to skip it fails loudly), a zero or more would silently write into a real row "
        "(with preset 'odd')",
    ]


def test_a_param_chosen_padding_may_carry_a_pad_value_it_does_not_use():
    spec = parse(PRESET_SPEC.replace("  odd: {reset: padding, sentinel: 2}\n", ""))
    assert spec.slots[0].pad_value == "sentinel"  # used by fill_sentinel (the defaults), unused by keep_pad (cpu)


def test_a_param_chosen_policy_still_needs_its_pad_value():
    text = make_slot_yaml(params={"p": {"type": "str", "default": "fill_once"}}, padding="p")
    assert spec_error(text) == ["spec.yaml:5: slot 'x': padding 'fill_once' needs a 'pad_value' (under the "
                                "defaults: p = 'fill_once')"]


GOOD = PRESET_SPEC.replace("  odd: {reset: padding, sentinel: 2}\n", "")


@pytest.mark.parametrize("params, expected", [
    ({"reset": "cap"}, "spec.yaml:15: slot 'x': reset_to names param 'reset', whose value 'cap' is not a valid "
     "reset_to (one of: padded, capacity)"),
    ({"policy": "foreach_copy"}, "spec.yaml:15: slot 'x': reset_to 'capacity' applies to the policies that write "
     "the tail (zero, fill_sentinel, repeat_last); 'foreach_copy' writes none, so there is nothing to reset to the "
     "end: remove reset_to or change the padding"),
    ({"sentinel": 0}, "spec.yaml:21: slot 'y': index: skip needs a negative integer pad_value, got 0: a negative "
     "value indexes no row (a kernel that forgot to skip it fails loudly), a zero or more would silently write into "
     "a real row"),
])
def test_the_params_a_registry_is_built_with_are_checked_too(params, expected):
    assert build_error(parse(GOOD), params=params) == [expected]
    with pytest.raises(gs.SpecError) as info:
        gs.build_registry(parse(GOOD), device="cpu", max_bs=4, max_num_tokens=4, params=params, impl="generated")
    assert str(info.value) == expected


def test_a_module_is_not_generated_for_params_that_break_a_rule():
    spec = parse(GOOD)
    with pytest.raises(gs.SpecError) as info:
        render_module(spec, resolve_params(spec, {"reset": "cap"}, torch_dtypes=False))
    assert str(info.value) == ("spec.yaml:15: slot 'x': reset_to names param 'reset', whose value 'cap' is not a "
                               "valid reset_to (one of: padded, capacity)")


@pytest.mark.parametrize("written, value", [('"true"', "true"), ("'false'", "false")])
def test_a_quoted_boolean_index_says_to_unquote_it(written, value):
    """``index: "true"`` is the string, not the boolean: the error says so (it said: did you mean 'true'?)."""
    text = ("name: s\nslots:\n"
            f"  - {{name: x, shape: [max_bs], dtype: int32, axis: bs, padding: zero, index: {written}}}\n")
    assert spec_error(text) == [
        f"spec.yaml:3: slot 'x': '{value}' is not a valid index (one of: true, false, skip): it is a quoted string; "
        f"write {value} unquoted for the boolean"]
