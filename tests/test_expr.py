"""The expression language of slot specs, as a specification."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphslot.spec.errors import ExprError
from graphslot.spec.expr import (
    ALLOWED,
    TYPES,
    Expr,
    python_type_name,
)

TYPES_OF_PARAMS = {
    "max_bs": "int",
    "num_tokens_per_bs": "int",
    "scale": "float",
    "is_multimodal": "bool",
    "backend": "str",
    "index_dtype": "dtype",
    "out_dtype": "dtype",
}


def error_of(text: str, call=lambda e: None) -> str:
    with pytest.raises(ExprError) as info:
        call(Expr.parse(text))
    return str(info.value)


# -- parsing ------------------------------------------------------------------


def test_parse_keeps_text_and_free_names():
    e = Expr.parse("max(max_bs, 4) * n if enabled and true else min(a, false + 0)")
    assert e.text == "max(max_bs, 4) * n if enabled and true else min(a, false + 0)"
    # max/min are functions and true/false are bools: neither is a free name.
    assert e.names == frozenset({"max_bs", "n", "enabled", "a"})
    assert Expr.parse("8").names == frozenset()


def test_expr_is_a_value_by_text():
    assert Expr.parse("max_bs * 2") == Expr.parse("max_bs * 2")
    assert Expr.parse("max_bs * 2") != Expr.parse("max_bs*2")
    assert len({Expr.parse("a"), Expr.parse("a"), Expr.parse("b")}) == 2
    assert repr(Expr.parse("max_bs * 2")) == "Expr('max_bs * 2')"


def test_surrounding_spaces_are_allowed():
    assert Expr.parse("  max_bs + 1 ").evaluate({"max_bs": 1}) == 2


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("max_bs * 2 ** x", "2 ** x"),
        ("max_bs / 2", "max_bs / 2"),
        ("config.max_bs", "config.max_bs"),
        ("torch.int64", "torch.int64"),
        ("sizes[0] + 1", "sizes[0]"),
        ("(lambda: 1)", "lambda: 1"),
        ("round(scale)", "round(scale)"),
        ("max_bs.bit_length()", "max_bs.bit_length()"),
        ("[x for x in sizes]", "[x for x in sizes]"),
        ('f"{max_bs}"', 'f"{max_bs}"'),
        ("None", "None"),
        ("(1, 2)", "(1, 2)"),
        ("a is b", "a is b"),
        ("a in b", "a in b"),
        ("a & b", "a & b"),
        ("~a", "~a"),
        ("1j", "1j"),
        ("b'x' == b'x'", "b'x'"),
        ("(n := 3)", "n := 3"),
    ],
)
def test_unsupported_syntax_is_rejected_at_parse_quoting_the_fragment(text, fragment):
    message = f"unsupported syntax '{fragment}' in expression '{text}': expressions may use {ALLOWED}"
    assert error_of(text) == message


def test_allowed_message_lists_the_language():
    assert error_of("max_bs * 2 ** x") == (
        "unsupported syntax '2 ** x' in expression 'max_bs * 2 ** x': expressions may use names, "
        "int/float/bool literals, + - * // %, comparisons, and/or/not, 'a if c else b', max(), min()"
    )


@pytest.mark.parametrize("text", ["max(a)", "min()", "max(a, b, key=c)", "min(*sizes, 1)"])
def test_max_min_take_two_or_more_positional_arguments(text):
    fn = text[:3]
    assert error_of(text) == (
        f"unsupported syntax '{text}' in expression '{text}': {fn}() takes two or more positional arguments"
    )


@pytest.mark.parametrize(
    "text, reason",
    [("max_bs *", "invalid syntax"), ("", "invalid syntax"), ("(max_bs + 1", "'(' was never closed")],
)
def test_python_syntax_error(text, reason):
    assert error_of(text) == f"invalid expression '{text}': {reason}"


def test_non_string_is_not_an_expression():
    with pytest.raises(ExprError, match="expression must be a string, got int 3"):
        Expr.parse(3)


# -- static types ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8", "int"),
        ("0.5", "float"),
        ("True", "bool"),
        ("true", "bool"),
        ("'flashinfer'", "str"),
        ("index_dtype", "dtype"),
        ("max_bs * num_tokens_per_bs", "int"),
        ("max_bs // 2 + max_bs % 3 - 1", "int"),
        ("max_bs * scale", "float"),
        ("max_bs // scale", "float"),
        ("-max_bs", "int"),
        ("+scale", "float"),
        ("max_bs > 0", "bool"),
        ("0 < max_bs <= 256", "bool"),
        ("max_bs == scale", "bool"),
        ("backend == 'flashinfer'", "bool"),
        ("index_dtype != out_dtype", "bool"),
        ("is_multimodal == false", "bool"),
        ("not is_multimodal and max_bs > 1 or false", "bool"),
        ("max_bs if is_multimodal else 1", "int"),
        ("max_bs if is_multimodal else 0.5", "float"),
        ("backend if is_multimodal else 'x'", "str"),
        ("index_dtype if is_multimodal else out_dtype", "dtype"),
        ("max(max_bs, 4)", "int"),
        ("min(max_bs, scale, 2)", "float"),
    ],
)
def test_infer_type(text, expected):
    assert Expr.parse(text).infer_type(TYPES_OF_PARAMS) == expected


def test_unknown_name_suggests_a_close_one():
    def infer(e):
        return e.infer_type(TYPES_OF_PARAMS)

    assert error_of("max_bz * 2", infer) == (
        "unknown name 'max_bz' in expression 'max_bz * 2'; did you mean 'max_bs'?"
    )
    assert error_of("zzz + 1", infer) == "unknown name 'zzz' in expression 'zzz + 1'"


def test_type_error_quotes_the_fragment_and_the_expression():
    assert error_of("is_multimodal + 1", lambda e: e.infer_type(TYPES_OF_PARAMS)) == (
        "'is_multimodal + 1' in expression 'is_multimodal + 1': cannot apply '+' to bool and int"
    )
    assert error_of("max_bs * (2 - true)", lambda e: e.infer_type(TYPES_OF_PARAMS)) == (
        "'2 - true' in expression 'max_bs * (2 - true)': cannot apply '-' to int and bool"
    )


# Each message is "'<text>' in expression '<text>': <reason>".
@pytest.mark.parametrize(
    "text, reason",
    [
        ("backend % 2", "cannot apply '%' to str and int"),
        ("max_bs // true", "cannot apply '//' to int and bool"),
        ("-is_multimodal", "cannot apply unary '-' to bool"),
        ("not max_bs", "cannot apply 'not' to int"),
        ("max_bs and true", "cannot apply 'and' to int"),
        ("false or 1", "cannot apply 'or' to int"),
        ("backend < 'z'", "cannot compare str and str with '<'"),
        ("index_dtype == 1", "cannot compare dtype and int with '=='"),
        ("is_multimodal == 1", "cannot compare bool and int with '=='"),
        ("1 if max_bs else 2", "condition must be bool, got int"),
        ("max_bs if is_multimodal else backend", "branches have different types int and str"),
        ("index_dtype if true else 1.5", "branches have different types dtype and float"),
        ("max(max_bs, true)", "max() needs int or float arguments, got bool"),
        ("min(backend, 1)", "min() needs int or float arguments, got str"),
    ],
)
def test_type_errors(text, reason):
    message = error_of(text, lambda e: e.infer_type(TYPES_OF_PARAMS))
    assert message == f"'{text}' in expression '{text}': {reason}"


# -- evaluation -------------------------------------------------------------------

ENV = {"max_bs": 160, "n": 3, "scale": 0.5, "on": True, "off": False, "backend": "flashinfer"}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("max_bs + n", 163),
        ("max_bs - n", 157),
        ("max_bs * n", 480),
        ("max_bs * scale", 80.0),
        ("max_bs // n", 53),
        ("-7 // 2", -4),  # floor division, as in Python
        ("max_bs % n", 1),
        ("-7 % 3", 2),
        ("7.5 // 2", 3.0),
        ("-n", -3),
        ("+n", 3),
        ("not on", False),
        ("max_bs == 160", True),
        ("max_bs != 160", False),
        ("n < 3", False),
        ("n <= 3", True),
        ("n > 3", False),
        ("n >= 3", True),
        ("1 < n < 4 <= max_bs", True),
        ("1 < n > 4", False),
        ("backend == 'flashinfer'", True),
        ("backend != 'triton'", True),
        ("on and off", False),
        ("on and true", True),
        ("off or on", True),
        ("off or false", False),
        ("max_bs if on else n", 160),
        ("max_bs if off else n", 3),
        ("max(n, max_bs, 7)", 160),
        ("min(n, max_bs, 7)", 3),
        ("max(n, scale)", 3),
        ("true", True),
        ("false", False),
        ("(max_bs + 1) * 2", 322),
    ],
)
def test_evaluate(text, expected):
    result = Expr.parse(text).evaluate(ENV)
    assert result == expected and type(result) is type(expected)


def test_dtypes_compare_with_equality():
    env = {"index_dtype": torch.int32, "out_dtype": torch.int32, "other": torch.int64}
    assert Expr.parse("index_dtype == out_dtype").evaluate(env) is True
    assert Expr.parse("index_dtype != other").evaluate(env) is True
    assert Expr.parse("index_dtype if true else other").evaluate(env) is torch.int32


def test_and_or_and_conditional_short_circuit():
    # The right side would divide by zero or is not even defined.
    assert Expr.parse("n != 0 and 10 // n > 1").evaluate({"n": 0}) is False
    assert Expr.parse("n == 0 or 10 // n > 1").evaluate({"n": 0}) is True
    assert Expr.parse("1 if n == 0 else 10 // n").evaluate({"n": 0}) == 1
    assert Expr.parse("1 if true else undefined_name").evaluate({}) == 1


@pytest.mark.parametrize("text", ["max_bs // n", "max_bs % n", "scale // 0.0", "1 + max_bs % (n - n)"])
def test_division_by_zero(text):
    env = {"max_bs": 8, "n": 0, "scale": 1.5} if "(n - n)" not in text else {"max_bs": 8, "n": 2}
    assert error_of(text, lambda e: e.evaluate(env)) == f"division by zero in expression '{text}'"


def test_evaluate_unknown_name():
    assert error_of("max_bz * 2", lambda e: e.evaluate({"max_bs": 1})) == (
        "unknown name 'max_bz' in expression 'max_bz * 2'; did you mean 'max_bs'?"
    )


def test_evaluate_checks_types_of_values():
    assert error_of("on + 1", lambda e: e.evaluate(ENV)) == (
        "'on + 1' in expression 'on + 1': cannot apply '+' to bool and int"
    )
    assert error_of("1 if n else 2", lambda e: e.evaluate(ENV)) == (
        "'1 if n else 2' in expression '1 if n else 2': condition must be bool, got int"
    )
    assert error_of("x + 1", lambda e: e.evaluate({"x": [1]})) == (
        "'x' in expression 'x + 1': value [1] has type list, not one of int, float, bool, str, dtype"
    )


# -- to_python --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, env, keep, expected",
    [
        # Spec examples.
        ("dp_size if gather else 1", {"dp_size": 4, "gather": True}, {"max_bs"}, "4"),
        ("max_bs * num_tokens_per_bs", {"num_tokens_per_bs": 2}, {"max_bs"}, "max_bs * 2"),
        # Nothing kept: the repr of the value.
        ("max_bs * 2", {"max_bs": 8}, (), "16"),
        ("scale * 2", {"scale": 0.25}, (), "0.5"),
        ("on and n > 1", {"on": True, "n": 2}, (), "True"),
        ("backend", {"backend": "triton"}, (), "'triton'"),
        ("index_dtype", {"index_dtype": torch.int64}, (), "torch.int64"),
        ("d if true else e", {"d": torch.bfloat16, "e": torch.int32}, (), "torch.bfloat16"),
        # A kept name wins over its value in env.
        ("max_bs + 1", {"max_bs": 8}, {"max_bs"}, "max_bs + 1"),
        # Constant sub-expressions fold.
        ("(max_bs + 1) * (n + 1)", {"n": 2}, {"max_bs"}, "(max_bs + 1) * 3"),
        ("n * max_num_tokens", {"n": 3}, {"max_num_tokens"}, "3 * max_num_tokens"),
        ("max(max_bs, 2 * 2)", {}, {"max_bs"}, "max(max_bs, 4)"),
        ("min(max_bs, n + 1, cap)", {"n": 1, "cap": 64}, {"max_bs"}, "min(max_bs, 2, 64)"),
        # Parentheses only where needed.
        ("max_bs - (n - 1)", {"n": 1}, {"max_bs"}, "max_bs - 0"),
        ("max_bs - (a - b)", {}, {"max_bs", "a", "b"}, "max_bs - (a - b)"),
        ("(max_bs - a) - b", {}, {"max_bs", "a", "b"}, "max_bs - a - b"),
        ("max_bs * (a // b)", {}, {"max_bs", "a", "b"}, "max_bs * (a // b)"),
        ("max_bs + a * b", {}, {"max_bs", "a", "b"}, "max_bs + a * b"),
        ("-(max_bs + 1)", {}, {"max_bs"}, "-(max_bs + 1)"),
        ("-max_bs * n", {"n": -2}, {"max_bs"}, "-max_bs * -2"),
        ("max_bs - n", {"n": -2}, {"max_bs"}, "max_bs - -2"),
        ("(max_bs < 8) == on", {"on": True}, {"max_bs"}, "(max_bs < 8) == True"),
        ("not (on and max_bs > 1)", {}, {"max_bs", "on"}, "not (on and max_bs > 1)"),
        ("(a or b) and c", {}, {"a", "b", "c"}, "(a or b) and c"),
        ("a or b and c", {}, {"a", "b", "c"}, "a or b and c"),
        ("(a if c else b) + 1", {}, {"a", "b", "c"}, "(a if c else b) + 1"),
        ("a if (c if d else e) else b", {}, {"a", "b", "c", "d", "e"}, "a if (c if d else e) else b"),
        ("a if c else b if d else e", {}, {"a", "b", "c", "d", "e"}, "a if c else b if d else e"),
        ("max(a if c else b, 2)", {}, {"a", "b", "c"}, "max(a if c else b, 2)"),
        # A constant condition picks its branch; constant and/or operands fold away.
        ("max_bs * 2 if gather else max_bs", {"gather": False}, {"max_bs"}, "max_bs"),
        ("max_bs * k if gather else 1", {"gather": True, "k": 2}, {"max_bs"}, "max_bs * 2"),
        ("gather and max_bs > 1", {"gather": True}, {"max_bs"}, "max_bs > 1"),
        ("gather and max_bs > 1", {"gather": False}, {"max_bs"}, "False"),
        ("max_bs > 1 or gather", {"gather": True}, {"max_bs"}, "max_bs > 1 or True"),
        ("max_bs > 1 or gather", {"gather": False}, {"max_bs"}, "max_bs > 1"),
        # Division by zero in a branch that may not be taken is left to the generated code.
        ("max_bs if max_bs > 0 else 1 // n", {"n": 0}, {"max_bs"}, "max_bs if max_bs > 0 else 1 // 0"),
        # Floats and dtypes as literals.
        ("max_bs * scale", {"scale": 1e20}, {"max_bs"}, "max_bs * 1e+20"),
        ("max_bs * 1e999", {}, {"max_bs"}, "max_bs * float('inf')"),
        ("d if max_bs > 1 else e", {"d": torch.int64, "e": torch.float16}, {"max_bs"},
         "torch.int64 if max_bs > 1 else torch.float16"),
    ],
)
def test_to_python(text, env, keep, expected):
    assert Expr.parse(text).to_python(env, keep) == expected


def test_to_python_reports_errors_of_what_it_folds():
    assert error_of("max_bz * 2", lambda e: e.to_python({"max_bs": 1})) == (
        "unknown name 'max_bz' in expression 'max_bz * 2'; did you mean 'max_bs'?"
    )
    assert error_of("a + (on + 1)", lambda e: e.to_python({"on": True}, keep={"a"})) == (
        "'on + 1' in expression 'a + (on + 1)': cannot apply '+' to bool and int"
    )
    assert error_of("n // 0", lambda e: e.to_python({"n": 1})) == "division by zero in expression 'n // 0'"


NAMES = ("a", "b", "c")


def _binary(ints):
    ops = st.sampled_from(["+", "-", "*", "//", "%"])
    return st.tuples(ints, ops, ints).map(lambda t: f"({t[0]} {t[1]} {t[2]})")


def _condition(ints):
    compare = st.tuples(ints, st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), ints).map(" ".join)
    return st.one_of(
        compare,
        st.sampled_from(["true", "false"]),
        st.tuples(compare, st.sampled_from(["and", "or"]), compare).map(lambda t: f"({' '.join(t)})"),
        compare.map(lambda c: f"(not {c})"),
    )


# Random int-valued expressions, fully parenthesised so the tree is exactly the one drawn.
_ints = st.recursive(
    st.sampled_from(NAMES) | st.integers(-3, 5).map(str),
    lambda inner: st.one_of(
        _binary(inner),
        _binary(inner),  # twice: binary operators are the common case in real specs
        inner.map(lambda x: f"(-{x})"),
        st.tuples(st.sampled_from(["max", "min"]), inner, inner).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(inner, _condition(inner), inner).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    text=_ints,
    values=st.fixed_dictionaries({name: st.integers(-4, 4) for name in NAMES}),
    keep=st.sets(st.sampled_from(NAMES)),
)
def test_to_python_computes_what_evaluate_computes(text, values, keep):
    expr = Expr.parse(text)
    try:
        expected = expr.evaluate(values)
    except ExprError as e:
        assert "division by zero" in str(e)
        expected = ZeroDivisionError
    partial = {k: v for k, v in values.items() if k not in keep}
    try:
        code = expr.to_python(partial, keep)
    except ExprError as e:
        assert expected is ZeroDivisionError and "division by zero" in str(e)
        return
    assert Expr.parse(code).names <= keep  # the output is itself in the language
    try:
        got = eval(code, {"__builtins__": {}, "max": max, "min": min}, {k: values[k] for k in keep})
    except ZeroDivisionError:
        got = ZeroDivisionError
    assert got == expected, code
    assert expr.to_python(partial, keep) == code  # deterministic


# -- helpers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, name",
    [(True, "bool"), (False, "bool"), (0, "int"), (1.5, "float"), ("x", "str"), (torch.int64, "dtype"),
     (None, None), ([1], None), (torch.tensor(1), None)],
)
def test_python_type_name(value, name):
    assert python_type_name(value) == name
    assert name is None or name in TYPES


def test_to_python_mapping_keep_renames_kept_names():
    expr = Expr.parse("max(device, 2) * scale")
    assert expr.to_python({"scale": 3}, keep={"device": "rt_device"}) == "max(rt_device, 2) * 3"


# -- limits on untrusted text -------------------------------------------------------


def _expr_error(text, env=None):
    with pytest.raises(ExprError) as info:
        expr = Expr.parse(text)
        expr.evaluate(env or {})
    return str(info.value)


def test_expression_length_limit():
    text = "1+" * 500 + "1"
    assert _expr_error(text) == (f"expression '{text[:79]}…' is 1001 characters long; at most 1000 are allowed")


def test_expression_depth_limit():
    text = "-" * 60 + "1"
    assert _expr_error(text) == (f"expression '{text}' nests deeper than 50 levels (a sum of n terms nests n deep)")
    assert Expr.parse("+".join(["1"] * 49)).evaluate({}) == 49


@pytest.mark.parametrize("text, env, message", [
    ("x * x", {"x": 2**32}, "'x * x' in expression 'x * x': integer overflow: the value has 65 bits, beyond the "
                            "signed 64-bit range (|value| < 2**63)"),
    ("x", {"x": 2**63}, "'x' in expression 'x': integer overflow: the value has 64 bits, beyond the signed "
                        "64-bit range (|value| < 2**63)"),
    ("-x - 2", {"x": 2**63 - 1}, "'-x - 2' in expression '-x - 2': integer overflow: the value has 64 bits, "
                                 "beyond the signed 64-bit range (|value| < 2**63)"),
    ("9223372036854775808", {}, "'9223372036854775808' in expression '9223372036854775808': integer overflow: "
                                "the value has 64 bits, beyond the signed 64-bit range (|value| < 2**63)"),
    ("x // 0", {"x": 1}, "division by zero in expression 'x // 0'"),
    ("x % (x - 1)", {"x": 1}, "division by zero in expression 'x % (x - 1)'"),
])
def test_evaluation_is_bounded(text, env, message):
    assert _expr_error(text, env) == message


def test_the_bound_is_the_magnitude():
    """|value| < 2**63: every int64 but -2**63, so negating a value never overflows."""
    assert Expr.parse("x - 1 + 1").evaluate({"x": 2**63 - 1}) == 2**63 - 1
    assert Expr.parse("-x").evaluate({"x": 2**63 - 1}) == -(2**63 - 1)
    assert "integer overflow" in _expr_error("-x - 1", {"x": 2**63 - 1})
