"""Spec validation as a specification: YAML text in, exact error text out.

Every problem is one ``file:line: slot 'x': message`` line (the slot part only where a
slot is concerned), and one parse reports every problem in the file. The line numbers
below are those of the YAML texts in each test (``make_slot_yaml`` documents its own).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import graphslot as gs
from conftest import build_error, make_slot_yaml, parse, spec_error
from graphslot.api import build

EXPRESSIONS_MAY_USE = (
    "expressions may use names, int/float/bool literals, + - * // %, comparisons, and/or/not, "
    "'a if c else b', max(), min()"
)
PADDINGS = "zero, fill_sentinel, keep_pad, foreach_copy, fill_once, repeat_last"
SLOT_KEYS = ("name, shape, dtype, axis, slice_dim, device, padding, pad_value, index, optional, enabled_if, "
             "copy_from_fb, post_fill, source, pre_capture, adopt, extra_rows, reset_to, staged, description")


def test_make_slot_yaml_alone_is_a_valid_spec():
    spec = parse(make_slot_yaml())
    assert [s.name for s in spec.slots] == ["x"]
    assert spec.slot_line(0, "padding") == 7


# --- YAML itself ------------------------------------------------------------------------


def test_yaml_syntax_error_names_its_line():
    text = """\
        name: t
        slots:
          - name: x
           shape: [max_bs]
        """
    assert spec_error(text) == [
        "spec.yaml:4: YAML syntax error: while parsing a block collection, did not find expected '-' indicator"
    ]


def test_a_spec_must_be_a_mapping():
    assert spec_error("- just\n- a list\n") == [
        "spec.yaml:1: a spec is a mapping with keys name, description, params, presets, absent_fields, slots"
    ]


def test_duplicate_key_in_a_slot_is_an_error_not_last_one_wins():
    text = make_slot_yaml() + "    padding: keep_pad\n"
    assert spec_error(text) == [
        "spec.yaml:8: duplicate key 'padding' (first at line 7); "
        "YAML would silently keep the last one: remove one of them"
    ]


def test_duplicate_top_level_key():
    text = "name: t\nname: u\n" + make_slot_yaml().split("\n", 1)[1]
    assert spec_error(text) == [
        "spec.yaml:2: duplicate key 'name' (first at line 1); "
        "YAML would silently keep the last one: remove one of them"
    ]


# --- keys ---------------------------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_close_one():
    text = make_slot_yaml().replace("name: t\n", "name: t\ndescripton: typo\n", 1)
    assert spec_error(text) == ["spec.yaml:2: unknown key 'descripton'; did you mean 'description'?"]


def test_unknown_param_key_suggests_the_close_one():
    text = """\
        name: t
        params:
          width:
            type: int
            defualt: 2
        slots:
          - name: x
            shape: [max_bs]
            dtype: int64
            axis: bs
            padding: zero
        """
    assert spec_error(text) == [
        "spec.yaml:3: missing required key 'default'",
        "spec.yaml:5: unknown key 'defualt'; did you mean 'default'?",
    ]


def test_unknown_slot_key_suggests_the_close_one():
    assert spec_error(make_slot_yaml(optinal=True)) == [
        "spec.yaml:8: slot 'x': unknown key 'optinal'; did you mean 'optional'?"
    ]


def test_unknown_slot_key_with_nothing_close_lists_the_allowed_keys():
    assert spec_error(make_slot_yaml(colour="red")) == [
        f"spec.yaml:8: slot 'x': unknown key 'colour'; allowed keys: {SLOT_KEYS}"
    ]


@pytest.mark.parametrize(
    "drop, expected",
    [
        ("dtype", "spec.yaml:3: slot 'x': missing required key 'dtype'"),
        ("shape", "spec.yaml:3: slot 'x': missing required key 'shape'"),
        ("axis", "spec.yaml:3: slot 'x': missing required key 'axis'"),
    ],
)
def test_missing_required_slot_key_points_at_the_slot(drop, expected):
    assert spec_error(make_slot_yaml(**{drop: None})) == [expected]


def test_missing_spec_name():
    text = make_slot_yaml().replace("name: t\n", "", 1)
    assert spec_error(text) == ["spec.yaml:1: missing required key 'name'"]


def test_duplicate_slot_names():
    text = make_slot_yaml() + textwrap.indent(textwrap.dedent("""\
        - name: x
          shape: [max_num_tokens]
          dtype: int64
          axis: tokens
          padding: zero
        """), "  ")
    assert spec_error(text) == ["spec.yaml:8: slot 'x': duplicate slot name (first at line 3)"]


# --- choices: axis, padding, dtype, device -----------------------------------------------------


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"axis": "token"},
         "spec.yaml:6: slot 'x': 'token' is not a valid axis (one of: bs, tokens, none); did you mean 'tokens'?"),
        ({"axis": "batch"}, "spec.yaml:6: slot 'x': 'batch' is not a valid axis (one of: bs, tokens, none)"),
        ({"padding": "zeros"},
         f"spec.yaml:7: slot 'x': 'zeros' is not a valid padding (one of: {PADDINGS}); did you mean 'zero'?"),
        ({"padding": "sentinel"},
         f"spec.yaml:7: slot 'x': 'sentinel' is not a valid padding (one of: {PADDINGS}); did you mean "
         "'fill_sentinel'?"),
        ({"dtype": "in64"},
         "spec.yaml:5: slot 'x': unknown dtype 'in64': use a torch dtype name (int64, int32, bool, float32, "
         "bfloat16, …) or a dtype param; did you mean 'int64'?"),
        ({"device": "cuda"}, "spec.yaml:8: slot 'x': 'cuda' is not a valid device (one of: cpu)"),
    ],
    ids=["axis-hint", "axis", "padding-hint", "padding", "dtype", "device"],
)
def test_bad_choice(keys, expected):
    assert spec_error(make_slot_yaml(**keys)) == [expected]


def test_dtype_naming_a_param_that_is_not_a_dtype():
    text = make_slot_yaml(params={"width": {"type": "int", "default": 2}}, dtype="width")
    assert spec_error(text) == ["spec.yaml:7: slot 'x': param 'width' is int, not a dtype"]


# --- padding and pad_value ---------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["fill_sentinel", "fill_once"])
def test_padding_that_writes_a_value_needs_pad_value(padding):
    assert spec_error(make_slot_yaml(padding=padding)) == [
        f"spec.yaml:3: slot 'x': padding '{padding}' needs a 'pad_value'"
    ]


@pytest.mark.parametrize("padding", ["zero", "keep_pad", "foreach_copy"])
def test_pad_value_with_a_policy_that_ignores_it(padding):
    assert spec_error(make_slot_yaml(padding=padding, pad_value=3)) == [
        f"spec.yaml:8: slot 'x': pad_value is only used by fill_sentinel and fill_once, not '{padding}'; "
        "remove it or change the padding"
    ]


def test_pad_value_must_fit_the_dtype():
    assert spec_error(make_slot_yaml(padding="fill_sentinel", pad_value=1.5)) == [
        "spec.yaml:8: slot 'x': pad_value 1.5 (float) does not fit dtype int64"
    ]


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "bool", "int4"])
@pytest.mark.parametrize("value, shown", [(".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan")])
def test_a_non_finite_pad_value_does_not_fit_an_integer_or_bool_dtype(dtype, value, shown):
    text = make_slot_yaml(dtype=dtype, padding="fill_sentinel")
    assert spec_error(text + f"    pad_value: {value}\n") == [
        f"spec.yaml:8: slot 'x': pad_value {shown} (float) does not fit dtype {dtype}"
    ]


def test_a_non_finite_param_as_the_pad_value_of_an_integer_slot():
    text = textwrap.dedent("""\
        name: t
        params:
          p: {type: float, default: -.inf}
        slots:
          - {name: x, shape: [max_bs], dtype: int32, axis: bs, padding: fill_once, pad_value: p}
    """)
    assert spec_error(text) == ["spec.yaml:5: slot 'x': pad_value -inf (float) does not fit dtype int32"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "float8_e4m3fn"])
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "-0.0"])
def test_a_non_finite_or_negative_zero_pad_value_fits_a_float_dtype(dtype, value):
    text = make_slot_yaml(dtype=dtype, padding="fill_sentinel") + f"    pad_value: {value}\n"
    assert parse(text).slots[0].pad_value is not None


def test_a_huge_float_pad_value_must_fit_the_float_dtype():
    text = make_slot_yaml(dtype="float16", padding="fill_sentinel")
    assert spec_error(text + "    pad_value: 1.0e+5\n") == [
        "spec.yaml:8: slot 'x': pad_value 100000.0 (float) does not fit dtype float16"
    ]
    assert parse(text + "    pad_value: 65504.0\n").slots[0].pad_value == 65504.0


def test_missing_padding_on_a_sliced_axis():
    assert spec_error(make_slot_yaml(padding=None)) == [
        "spec.yaml:3: slot 'x': missing 'padding': a 'bs'-axis slot must say how its padded tail is made safe "
        f"(one of {PADDINGS})"
    ]


@pytest.mark.parametrize(
    "keys", [{"padding": "zero"}, {"padding": "fill_sentinel", "pad_value": 1}], ids=["zero", "fill_sentinel"]
)
def test_axis_none_with_a_resetting_policy(keys):
    text = make_slot_yaml(shape=[4], axis="none", **keys)
    assert spec_error(text) == [
        f"spec.yaml:7: slot 'x': axis 'none' is never sliced, so padding '{keys['padding']}' would never reset "
        "anything; use keep_pad, or fill_once to initialise the buffer"
    ]


def test_axis_none_may_keep_or_fill_once():
    parse(make_slot_yaml(shape=[4], axis="none", padding="keep_pad"))
    parse(make_slot_yaml(shape=[4], axis="none", padding="fill_once", pad_value=0))
    parse(make_slot_yaml(shape=[4], axis="none", padding=None))


# --- shapes and slicing ----------------------------------------------------------------------


@pytest.mark.parametrize("extent", [0, -1])
def test_non_positive_literal_extent(extent):
    assert spec_error(make_slot_yaml(shape=["max_bs", extent])) == [
        f"spec.yaml:4: slot 'x': shape[1] is {extent}; extents must be positive"
    ]


def test_non_positive_extent_from_a_param_expression():
    text = make_slot_yaml(params={"width": {"type": "int", "default": 2}}, shape=["max_bs", "width - 2"])
    assert spec_error(text) == [
        "spec.yaml:6: slot 'x': shape[1] = 'width - 2' evaluates to 0; extents must be positive"
    ]


def test_non_positive_extent_under_a_preset_is_checked_too():
    text = """\
        name: t
        params:
          width: {type: int, default: 2}
        presets:
          tiny: {width: 0}
        slots:
          - name: x
            shape: [max_bs, width]
            dtype: int64
            axis: bs
            padding: zero
        """
    assert spec_error(text) == ["spec.yaml:8: slot 'x': shape[1] = 'width' evaluates to 0; extents must be positive"]


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"shape": ["max_num_tokens"]},
         "axis 'bs' slices dimension 0, so that extent must be 'max_bs' (the buffer's capacity), "
         "got 'max_num_tokens'"),
        ({"axis": "tokens"},
         "axis 'tokens' slices dimension 0, so that extent must be 'max_num_tokens' (the buffer's capacity), "
         "got 'max_bs'"),
        ({"shape": [8]},
         "axis 'bs' slices dimension 0, so that extent must be 'max_bs' (the buffer's capacity), got 8"),
        ({"shape": ["max_bs * 2"]},
         "axis 'bs' slices dimension 0, so that extent must be 'max_bs' (the buffer's capacity), got 'max_bs * 2'"),
        ({"shape": ["max_num_tokens", 3], "axis": "tokens", "slice_dim": 1},
         "axis 'tokens' slices dimension 1, so that extent must be 'max_num_tokens' (the buffer's capacity), got 3"),
    ],
    ids=["bs", "tokens", "literal", "expression", "slice_dim-1"],
)
def test_sliced_dimension_must_be_the_axis_capacity(keys, expected):
    assert spec_error(make_slot_yaml(**keys)) == [f"spec.yaml:4: slot 'x': {expected}"]


def test_slice_dim_1_on_the_capacity_is_valid():
    spec = parse(make_slot_yaml(shape=[3, "max_num_tokens"], axis="tokens", slice_dim=1))
    assert spec.slots[0].slice_dim == 1


def test_slice_dim_beyond_the_shape():
    assert spec_error(make_slot_yaml(slice_dim=2)) == [
        "spec.yaml:8: slot 'x': slice_dim 2 is beyond the shape ['max_bs'] (it has 1 dimension(s))"
    ]


@pytest.mark.parametrize(
    "keys, got",
    [({"padding": "keep_pad"}, "keep_pad"), ({"padding": "foreach_copy"}, "foreach_copy"),
     ({"padding": "fill_sentinel", "pad_value": -1}, "fill_sentinel")],
)
def test_index_slot_must_pad_with_zero(keys, got):
    assert spec_error(make_slot_yaml(index=True, **keys)) == [
        f"spec.yaml:8: slot 'x': index slots must use padding 'zero' (got '{got}'): "
        "a stale or sentinel tail would index out of the pool"
    ]


def test_index_slot_with_zero_padding_is_valid():
    assert parse(make_slot_yaml(index=True)).slots[0].index is True


# --- expressions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extent, expected",
    [
        ("max_bz * 2", "shape[1]: unknown name 'max_bz' in expression 'max_bz * 2'; did you mean 'max_bs'?"),
        ("__import__('os')",
         f"shape[1]: unsupported syntax '__import__('os')' in expression '__import__('os')': {EXPRESSIONS_MAY_USE}"),
        ("max_bs.bit_length()",
         "shape[1]: unsupported syntax 'max_bs.bit_length()' in expression 'max_bs.bit_length()': "
         f"{EXPRESSIONS_MAY_USE}"),
        ("max_bs ** 2",
         f"shape[1]: unsupported syntax 'max_bs ** 2' in expression 'max_bs ** 2': {EXPRESSIONS_MAY_USE}"),
        ("max_bs / 2",
         f"shape[1]: unsupported syntax 'max_bs / 2' in expression 'max_bs / 2': {EXPRESSIONS_MAY_USE}"),
        ("max_bs > 2", "shape[1] must be int, but 'max_bs > 2' is bool"),
    ],
    ids=["unknown-name", "import", "attribute", "power", "true-division", "bool"],
)
def test_bad_expression_in_a_shape(extent, expected):
    assert spec_error(make_slot_yaml(shape=["max_bs", extent])) == [f"spec.yaml:4: slot 'x': {expected}"]


def test_bad_expression_in_a_pad_value():
    text = make_slot_yaml(padding="fill_sentinel", pad_value="fill_valu")
    assert spec_error(text) == ["spec.yaml:8: slot 'x': pad_value: unknown name 'fill_valu' in expression 'fill_valu'"]


@pytest.mark.parametrize(
    "params, cond, expected",
    [
        ({"width": {"type": "int", "default": 2}}, "width",
         "spec.yaml:10: slot 'x': enabled_if must be bool, but 'width' is int"),
        ({}, 1, "spec.yaml:8: slot 'x': bad value for 'enabled_if': input should be a valid boolean (got 1)"),
        ({"use": {"type": "bool", "default": True}}, "use + 1",
         "spec.yaml:10: slot 'x': enabled_if: 'use + 1' in expression 'use + 1': cannot apply '+' to bool and int"),
    ],
    ids=["int-param", "int-literal", "arithmetic-on-bool"],
)
def test_enabled_if_must_be_bool(params, cond, expected):
    assert spec_error(make_slot_yaml(params=params, enabled_if=cond)) == [expected]


def test_enabled_if_bool_expression_is_valid():
    text = make_slot_yaml(params={"n": {"type": "int", "default": 2}}, enabled_if="n > 1 and not false")
    assert parse(text).slots[0].enabled_if == "n > 1 and not false"


# --- params and presets ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "param, expected",
    [
        ({"type": "int", "default": 1.5}, "default of param 'p' must be an int, got 1.5"),
        ({"type": "int", "default": True}, "default of param 'p' must be an int, got True"),
        ({"type": "bool", "default": 1}, "default of param 'p' must be true or false, got 1"),
        ({"type": "str", "default": 3}, "default of param 'p' must be a string, got 3"),
        ({"type": "dtype", "default": "in64"},
         "default of param 'p' must be a torch dtype name, got 'in64'; did you mean 'int64'?"),
        ({"type": "int", "default": "q"}, "default of param 'p' must be int, but 'q' is bool"),
        ({"type": "int", "default": "q * 2"},
         "default of param 'p': 'q * 2' in expression 'q * 2': cannot apply '*' to bool and int"),
    ],
    ids=["int-float", "int-bool", "bool-int", "str-int", "dtype", "expression", "expression-operator"],
)
def test_param_default_of_the_wrong_type(param, expected):
    text = make_slot_yaml(params={"p": param, "q": {"type": "bool", "default": False}})
    assert spec_error(text) == [f"spec.yaml:3: {expected}"]


def test_param_default_expression_over_other_params_is_valid():
    text = make_slot_yaml(params={"a": {"type": "int", "default": 2}, "b": {"type": "int", "default": "a * 3"}},
                          shape=["max_bs", "b"])
    spec = parse(text)
    assert gs.resolve_params(spec) == {"a": 2, "b": 6}


def test_param_defaults_that_form_a_cycle():
    text = make_slot_yaml(params={"a": {"type": "int", "default": "b + 1"}, "b": {"type": "int", "default": "a * 2"}})
    assert spec_error(text) == ["spec.yaml:3: param defaults form a cycle: a -> b -> a"]


def test_param_default_naming_itself_is_a_cycle():
    text = make_slot_yaml(params={"a": {"type": "int", "default": "a + 1"}})
    assert spec_error(text) == ["spec.yaml:3: param defaults form a cycle: a -> a"]


def test_runtime_param_must_be_numeric_or_bool():
    text = make_slot_yaml(params={"d": {"type": "dtype", "default": "int64", "runtime": True}})
    assert spec_error(text) == ["spec.yaml:3: runtime param 'd' must be int, float or bool"]


def test_param_name_that_yaml_reads_as_a_bool_or_number():
    text = """\
        name: t
        params:
          on: {type: bool, default: true}
          3: {type: int, default: 1}
        slots:
          - name: x
            shape: [max_bs]
            dtype: int64
            axis: bs
            padding: zero
        """
    hint = "is not a string: YAML reads unquoted on/off/yes/no/true/false and numbers as such; quote it"
    assert spec_error(text) == [f"spec.yaml:3: key True {hint}", f"spec.yaml:4: key 3 {hint}"]


def test_param_name_may_not_shadow_a_capacity():
    text = make_slot_yaml(params={"max_bs": {"type": "int", "default": 2}})
    assert spec_error(text) == [
        "spec.yaml:3: param name 'max_bs' must be an identifier other than max_bs, max_num_tokens, true and false"
    ]


PRESET_SPEC = """\
    name: t
    params:
      width: {{type: int, default: 2}}
    presets:
      eager:
        {line6}
    slots:
      - name: x
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
    """


@pytest.mark.parametrize(
    "line6, expected",
    [
        ("widht: 4", "spec.yaml:6: preset 'eager' sets unknown param 'widht'; did you mean 'width'?"),
        ("height: 4", "spec.yaml:6: preset 'eager' sets unknown param 'height'"),
        ("width: yes", "spec.yaml:6: preset 'eager': param 'width' is int, got bool True"),
        ("width: '4'", "spec.yaml:6: preset 'eager': param 'width' is int, got str '4'"),
    ],
    ids=["unknown-hint", "unknown", "bool", "str"],
)
def test_bad_preset(line6, expected):
    assert spec_error(PRESET_SPEC.format(line6=line6)) == [expected]


# --- structured slots and hooks ------------------------------------------------------------------


def test_dotted_name_needs_a_source():
    assert spec_error(make_slot_yaml(name="spec_info.ids")) == [
        "spec.yaml:3: slot 'spec_info.ids': a dotted (structured) slot needs a 'source' hook to read its value, "
        "e.g. source: dotted_field"
    ]


def test_dotted_name_with_a_source_is_valid():
    assert parse(make_slot_yaml(name="spec_info.ids", source="dotted_field")).slots[0].is_structured


def test_slot_name_must_be_an_identifier():
    assert spec_error(make_slot_yaml(name="input-ids")) == [
        "spec.yaml:3: slot 'input-ids': slot names are identifiers, or dotted identifiers for structured slots"
    ]


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"post_fill": "no_such_module_xyz:fn"},
         "cannot import module 'no_such_module_xyz' for hook 'no_such_module_xyz:fn': no module named "
         f"'no_such_module_xyz' in this Python environment ({sys.executable}); install it (and what it imports) "
         "into this environment -- for a pre-commit hook, list it under additional_dependencies or use a `repo: "
         "local` hook -- or check hooks here without importing them (no --import-hooks, import_hooks = false)"),
        ({"post_fill": "hooks_for_tests:post_fill_fit"},
         "module 'hooks_for_tests' has no attribute 'post_fill_fit' (hook 'hooks_for_tests:post_fill_fit'); "
         "did you mean 'post_fill_fits'?"),
        ({"post_fill": "hooks_for_tests:NOT_A_FUNCTION"}, "hook 'hooks_for_tests:NOT_A_FUNCTION' is not callable"),
        ({"post_fill": "hooks_for_tests:post_fill_too_few"},
         "post_fill hook 'hooks_for_tests:post_fill_too_few' has signature (buffer), but post_fill hooks are "
         "called as (buffer, fb, ctx)"),
        ({"post_fill": "hooks_for_tests:source_fits"},
         "post_fill hook 'hooks_for_tests:source_fits' has signature (fb, ctx), but post_fill hooks are "
         "called as (buffer, fb, ctx)"),
        ({"pre_capture": "hooks_for_tests:post_fill_fits"},
         "pre_capture hook 'hooks_for_tests:post_fill_fits' has signature (buffer, fb, ctx), but pre_capture "
         "hooks are called as (buffer, ctx)"),
    ],
    ids=["bad-module", "bad-attribute", "not-callable", "too-few-args", "source-as-post_fill", "post_fill-as-pre"],
)
def test_import_hook_that_cannot_be_used(keys, expected):
    with pytest.raises(gs.SpecError) as info:
        gs.parse_spec(make_slot_yaml(**keys), path="spec.yaml", import_hooks=True)
    assert str(info.value).splitlines() == [f"spec.yaml:8: slot 'x': {expected}"]


def test_import_hooks_are_not_imported_unless_asked():
    """Without import_hooks only the form of a `module:function` reference is checked."""
    assert parse(make_slot_yaml(post_fill="no_such_module_xyz:fn")).slots[0].post_fill == "no_such_module_xyz:fn"


def test_import_hooks_that_fit_are_valid():
    spec = gs.parse_spec(make_slot_yaml(post_fill="hooks_for_tests:post_fill_fits",
                                        pre_capture="hooks_for_tests:pre_capture_fits"),
                         path="spec.yaml", import_hooks=True)
    assert spec.slots[0].post_fill == "hooks_for_tests:post_fill_fits"


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"source": "count_non_padded_tokens"},
         "built-in hook 'count_non_padded_tokens' is a post_fill hook and cannot be used as source"),
        ({"post_fill": "dotted_field"},
         "built-in hook 'dotted_field' is a source hook and cannot be used as post_fill"),
        ({"pre_capture": "global_num_tokens"},
         "built-in hook 'global_num_tokens' is a post_fill hook and cannot be used as pre_capture"),
    ],
)
def test_builtin_hook_used_as_the_wrong_kind(keys, expected):
    assert spec_error(make_slot_yaml(**keys)) == [f"spec.yaml:8: slot 'x': {expected}"]


def test_source_hook_with_copy_from_fb_false():
    assert spec_error(make_slot_yaml(source="hooks_for_tests:source_fits", copy_from_fb=False)) == [
        "spec.yaml:8: slot 'x': a source hook only feeds the copy, and copy_from_fb is false; remove one"
    ]


def test_an_unknown_plain_hook_name_is_left_to_build_time():
    """A plain name may be a user hook passed to build_registry: parsing accepts it."""
    assert parse(make_slot_yaml(post_fill="my_hook")).slots[0].post_fill == "my_hook"


# --- runtime params --------------------------------------------------------------------------------

RUNTIME = {"fill": {"type": "int", "default": 2, "runtime": True}}


def test_runtime_param_in_a_shape():
    assert spec_error(make_slot_yaml(params=RUNTIME, shape=["max_bs", "fill"])) == [
        "spec.yaml:6: slot 'x': shape[1] uses runtime param 'fill': runtime params are passed at fill time, "
        "so only pad values may use them"
    ]


def test_runtime_param_in_enabled_if():
    text = make_slot_yaml(params={"use": {"type": "bool", "default": True, "runtime": True}}, enabled_if="use")
    assert spec_error(text) == [
        "spec.yaml:10: slot 'x': enabled_if uses runtime param 'use': runtime params are passed at fill time, "
        "so only pad values may use them"
    ]


def test_runtime_param_in_a_pad_value_is_valid():
    spec = parse(make_slot_yaml(params=RUNTIME, padding="fill_sentinel", pad_value="fill + 1"))
    assert spec.params["fill"].runtime


# --- all at once, and the format --------------------------------------------------------------------


def test_every_problem_in_a_file_is_reported_each_on_its_own_line():
    text = """\
        name: t
        params:
          width: {type: int, default: 1.5}
        slots:
          - name: a
            shape: [max_bs]
            dtype: int64
            axis: bs
            paddng: zero
          - name: b
            shape: [max_bs]
            dtype: in64
            axis: bs
            padding: fill_sentinel
          - name: c
            shape: [4]
            dtype: int64
            axis: none
            padding: zero
          - name: d
            shape: [max_num_tokens]
            dtype: int64
            axis: tokens
            padding: keep_pad
            index: true
        """
    assert spec_error(text) == [
        "spec.yaml:3: default of param 'width' must be an int, got 1.5",
        "spec.yaml:9: slot 'a': unknown key 'paddng'; did you mean 'padding'?",
        "spec.yaml:10: slot 'b': padding 'fill_sentinel' needs a 'pad_value'",
        "spec.yaml:12: slot 'b': unknown dtype 'in64': use a torch dtype name (int64, int32, bool, float32, "
        "bfloat16, …) or a dtype param; did you mean 'int64'?",
        "spec.yaml:19: slot 'c': axis 'none' is never sliced, so padding 'zero' would never reset anything; "
        "use keep_pad, or fill_once to initialise the buffer",
        "spec.yaml:25: slot 'd': index slots must use padding 'zero' (got 'keep_pad'): "
        "a stale or sentinel tail would index out of the pool",
    ]


def test_issue_format_is_file_line_slot_message():
    with pytest.raises(gs.SpecError) as info:
        parse(make_slot_yaml(axis="tokenz"), source="specs/my.yaml")
    err = info.value
    assert isinstance(err, ValueError)
    (issue,) = err.issues
    assert (issue.file, issue.line, issue.slot) == ("specs/my.yaml", 6, "x")
    assert issue.message == "'tokenz' is not a valid axis (one of: bs, tokens, none); did you mean 'tokens'?"
    assert str(issue) == f"specs/my.yaml:6: slot 'x': {issue.message}"
    assert str(err) == str(issue)


def test_issue_without_slot_or_line():
    assert str(gs.SpecIssue("f.yaml", None, "broken")) == "f.yaml: broken"
    assert str(gs.SpecIssue("f.yaml", 3, "broken")) == "f.yaml:3: broken"


def test_load_spec_of_a_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(gs.SpecError) as info:
        gs.load_spec(missing)
    assert str(info.value).startswith(f"{missing}: no such spec file; shipped specs are: ")


def test_load_spec_from_a_path_names_that_file_in_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text(make_slot_yaml(padding="zeros"))
    with pytest.raises(gs.SpecError) as info:
        gs.load_spec(tmp_path / "mine.yaml")
    assert str(info.value).startswith("mine.yaml:7: slot 'x': 'zeros' is not a valid padding")


@pytest.mark.parametrize("name", gs.shipped_spec_names())
def test_every_shipped_spec_loads_clean_under_defaults_and_presets(name):
    spec = gs.load_spec(name)
    assert spec.name == name
    for preset in [None, *spec.presets]:
        reg = build(spec, max_bs=4, max_num_tokens=8, preset=preset, impl="interpreted", device="cpu")
        assert reg.slot_names()


def test_shipped_specs_include_decode_and_prefill():
    assert {"decode", "prefill"} <= set(gs.shipped_spec_names())


# --- at build time: gs.build_registry -------------------------------------------------------------

BUILD_SPEC = """\
    name: t
    params:
      width: {type: int, default: 2}
      use_y: {type: bool, default: false}
      idx_dtype: {type: dtype, default: int64}
    presets:
      wide: {width: 4}
    slots:
      - name: x
        shape: [max_bs, width]
        dtype: idx_dtype
        axis: bs
        padding: zero
      - name: y
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
        enabled_if: use_y
    """


@pytest.fixture
def build_spec():
    return parse(BUILD_SPEC)


def test_build_with_an_unknown_param_suggests_the_close_one(build_spec):
    assert build_error(build_spec, params={"widht": 3}) == ["spec.yaml: unknown param 'widht'; did you mean 'width'?"]


def test_build_reports_every_bad_param(build_spec):
    assert build_error(build_spec, params={"colour": 3, "width": "3"}) == [
        "spec.yaml: unknown param 'colour'",
        "spec.yaml:3: param 'width' is int, got str '3'",
    ]


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"width": 3.0}, "spec.yaml:3: param 'width' is int, got float 3.0"),
        ({"width": True}, "spec.yaml:3: param 'width' is int, got bool True"),
        ({"use_y": 1}, "spec.yaml:4: param 'use_y' is bool, got int 1"),
        ({"idx_dtype": "int46x"},
         "spec.yaml:5: param 'idx_dtype' is a dtype: pass torch.int64 or 'int64', got 'int46x'"),
        ({"idx_dtype": 3}, "spec.yaml:5: param 'idx_dtype' is a dtype: pass torch.int64 or 'int64', got 3"),
    ],
    ids=["int-float", "int-bool", "bool-int", "dtype-str", "dtype-int"],
)
def test_build_with_a_param_of_the_wrong_type(build_spec, params, expected):
    assert build_error(build_spec, params=params) == [expected]


@pytest.mark.parametrize("value", [torch.int32, "int32", "torch.int32"])
def test_dtype_param_accepts_a_torch_dtype_or_its_name(build_spec, value):
    reg = gs.build_registry(build_spec, max_bs=4, max_num_tokens=8, params={"idx_dtype": value}, impl="interpreted",
                            device="cpu")
    assert reg.slot("x").buffer.dtype == torch.int32
    assert reg.params["idx_dtype"] is torch.int32


def test_build_with_an_unknown_preset(build_spec):
    assert build_error(build_spec, preset="wid") == [
        "spec.yaml: unknown preset 'wid' (presets: wide); did you mean 'wide'?"]


def test_preset_then_explicit_params_win_over_defaults(build_spec):
    assert (build(build_spec, max_bs=4, max_num_tokens=8, preset="wide", impl="interpreted", device="cpu")
            .slot("x").buffer.shape == (4, 4))
    reg = build(build_spec, max_bs=4, max_num_tokens=8, preset="wide", params={"width": 5}, impl="interpreted",
                device="cpu")
    assert reg.slot("x").buffer.shape == (4, 5)


@pytest.mark.parametrize("width", [0, -3])
def test_build_with_a_param_making_an_extent_non_positive(build_spec, width):
    assert build_error(build_spec, params={"width": width}) == [
        f"spec.yaml:10: slot 'x': shape[1] = 'width' evaluates to {width}; extents must be positive"
    ]


def test_build_with_non_positive_capacities_is_a_value_error(build_spec):
    with pytest.raises(ValueError, match=r"^max_bs and max_num_tokens must be >= 1, got 0 and 8$"):
        gs.build_registry(build_spec, max_bs=0, max_num_tokens=8, impl="interpreted", device="cpu")


HOOK_SPEC = make_slot_yaml(post_fill="my_post_fill")


def test_build_with_an_unknown_user_hook_suggests_the_close_one():
    assert build_error(parse(HOOK_SPEC), hooks={"my_postfill": lambda buffer, fb, ctx: None}) == [
        "spec.yaml:8: slot 'x': unknown post_fill hook 'my_post_fill': pass it in "
        "build_registry(hooks={'my_post_fill': fn}), use a built-in post_fill hook, or write "
        "'package.module:function'; did you mean 'my_postfill'?"
    ]


def test_build_with_a_user_hook_of_the_wrong_signature():
    assert build_error(parse(HOOK_SPEC), hooks={"my_post_fill": lambda buffer: None}) == [
        "spec.yaml:8: slot 'x': post_fill hook 'my_post_fill' has signature (buffer), but post_fill hooks "
        "are called as (buffer, fb, ctx)"
    ]


def test_hook_of_a_disabled_slot_need_not_exist():
    text = make_slot_yaml(params={"use": {"type": "bool", "default": False}}, enabled_if="use", post_fill="missing")
    reg = gs.build_registry(parse(text), max_bs=4, max_num_tokens=8, impl="interpreted", device="cpu")
    assert not reg.has_slot("x")
