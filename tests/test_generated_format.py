"""Generated modules stay as graphslot writes them in a formatted tree.

An engine that runs a formatter over its tree (a pre-commit hook) would otherwise
rewrite the committed modules, ``graphslot generate --check`` would call them stale, and
``graphslot generate`` would write them back: a loop. So every module graphslot writes
says ``# fmt: off`` after its docstring, and ``ruff format`` at any width leaves it as it
is; ``ruff check`` with the default rule set (E4, E7, E9, F: no import after a
statement, no unused local) finds nothing in it. The layout itself is plain
(graphslot/codegen/layout.py): one line when a statement fits 88 columns, else one item
per line with a trailing comma (a call's arguments first on one line of their own).
Checked with ruff on the committed modules, on the shipped specs under the param sets
the differential tests use, on a spec with long names and every kind of slot, and on
random specs.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import List

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import graphslot as gs
from graphslot.api import build
from graphslot.codegen.generator import render_module
from graphslot.codegen.layout import Chain, assign, call, condition, list_of, normalise, py_str

from test_codegen_differential import SHIPPED, cases

REPO = Path(__file__).resolve().parent.parent
COMMITTED = sorted(p for p in (REPO / "graphslot" / "generated").glob("*.py") if p.name != "__init__.py")


def _ruff() -> List[str]:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    if shutil.which("ruff"):
        return [shutil.which("ruff")]
    pytest.skip("ruff is not installed (pip install -e '.[test]' brings it): the formatting of generated "
                "modules cannot be checked")


def ruff(*args: str, stdin: str = None) -> subprocess.CompletedProcess:
    """ruff with its default settings whatever configuration surrounds the files."""
    return subprocess.run(_ruff() + list(args[:1]) + ["--isolated"] + list(args[1:]), input=stdin,
                          capture_output=True, text=True, timeout=120)


LONG = "a_thirty_character_slot_name_x"  # + "_strided": 38 characters
FEATURES = textwrap.dedent(f"""
    name: features
    params:
      fill: {{type: int, default: 3, runtime: true}}
      mode: {{type: str, default: "it's \\"quoted\\""}}
      tiny: {{type: float, default: 1.0e-5}}
    slots:
      - {{name: {LONG}, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: zero}}
      - {{name: {LONG}_mask, shape: [max_num_tokens], dtype: bool, axis: tokens, padding: zero,
         optional: true}}
      - {{name: {LONG}_rows, shape: [3, max_num_tokens], dtype: int32, axis: tokens, slice_dim: 1,
         padding: zero, optional: true}}
      - {{name: {LONG}_lens, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel,
         pad_value: "fill + 1"}}
      - {{name: {LONG}_host, shape: [max_bs], dtype: int32, axis: bs, device: cpu, padding: fill_sentinel,
         pad_value: fill, optional: true}}
      - {{name: {LONG}_embeds, shape: [max_num_tokens, 4], dtype: float32, axis: tokens, padding: fill_sentinel,
         pad_value: -.inf, copy_from_fb: false}}
      - {{name: {LONG}_strided, shape: [2, max_bs, 2], dtype: int64, axis: bs, slice_dim: 1, padding: zero}}
      - {{name: outer.{LONG}, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: zero,
         source: dotted_field, post_fill: hooks_for_tests:stamp}}
      - {{name: class, shape: [4], dtype: int32, axis: none}}
      - {{name: an_optional_uint8_slot_named_with_44_letters, shape: [max_num_tokens], dtype: uint8,
         axis: tokens, padding: zero, optional: true}}
      - {{name: {LONG}_count, shape: [1], dtype: int32, axis: none, copy_from_fb: false,
         post_fill: global_num_tokens}}
""")


def _modules() -> dict:
    """name -> text of every module the format tests check."""
    texts = {p.name: p.read_text(encoding="utf-8") for p in COMMITTED}
    for case, (name, params, preset) in SHIPPED.items():
        spec = gs.load_spec(name)
        texts[f"{case}.py"] = render_module(spec, gs.resolve_params(spec, params, preset), f"{name}.yaml")
    spec = gs.parse_spec(FEATURES, "features.yaml")
    texts["features.py"] = render_module(spec, gs.resolve_params(spec))
    return texts


@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("generated")
    for name, text in _modules().items():
        assert text.count("\n# fmt: off\n") == 1, "a generated module says # fmt: off once, after its docstring"
        (folder / name.replace("-", "_")).write_text(text, encoding="utf-8")
    return folder


@pytest.mark.parametrize("width", [79, 88, 100, 120])
def test_a_formatter_at_any_width_leaves_generated_modules_alone(width, modules):
    """Engines format at 79, 88, 100 or 120 columns: ``# fmt: off`` keeps ruff (and
    black) off the module, so ``generate --check`` stays clean in their tree."""
    result = ruff("format", "--line-length", str(width), "--diff", str(modules))
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_ruff_check_finds_nothing_in_generated_modules(modules):
    result = ruff("check", "--select", "E4,E7,E9,F", "--output-format", "concise", str(modules))
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_modules_keep_to_88_columns():
    """Every module of the shipped specs; the features spec's names run past 88 columns
    in a few lines only (its longest name is 44 characters)."""
    for name, text in _modules().items():
        longest = max(len(line) for line in text.splitlines())
        assert longest <= (100 if name == "features.py" else 88), (name, longest)


ARGS = tuple(f"argument_number_{i}" for i in range(5))


@pytest.mark.parametrize("lines, expected", [
    (assign("x", call("f", "a", "b"), 4), ["    x = f(a, b)"]),  # fits: one line
    (assign("x", call("f", *ARGS[:4]), 8),  # too long: the items on a line of their own
     ["        x = f(", "            " + ", ".join(ARGS[:4]), "        )"]),
    (assign("x", call("f", *ARGS), 4),  # still too long: one item a line, trailing comma
     ["    x = f(", *(f"        {a}," for a in ARGS), "    )"]),
    (assign("x", list_of(["a"]), 0), ["x = [", "    a,", "]"]),  # grows with the spec: one a line
    (assign("x", "y" * 90, 0), ["x = (", "    " + "y" * 90, ")"]),  # a value too long: parenthesized
    (condition("if", Chain("and", ("a", Chain("or", ("b", "c")))), 0), ["if a and (b or c):"]),
    (condition("if", Chain("and", (ARGS[0] + " is None", Chain("or", ARGS[1:]))), 0),
     ["if (", f"    {ARGS[0]} is None", "    and (", f"        {ARGS[1]}",
      *(f"        or {a}" for a in ARGS[2:]), "    )", "):"]),
])
def test_statements_are_one_line_when_they_fit_else_one_item_a_line(lines, expected):
    assert lines == expected
    ast.parse("\n".join(lines).strip() + ("\n    pass" if lines[-1].endswith(":") else ""))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_ruff_format_leaves_modules_of_random_specs_as_they_are(case):
    spec = gs.parse_spec(case.text, "random.yaml")
    try:
        text = render_module(spec, gs.resolve_params(spec, case.params))
    except gs.SpecError:
        return  # a param set the spec refuses: nothing is generated
    result = ruff("format", "--line-length", "79", "-", stdin=text)
    assert result.returncode == 0 and result.stdout == text, result.stderr
    check = ruff("check", "--select", "E4,E7,E9,F", "--output-format", "concise", "-", stdin=text)
    assert check.returncode == 0, check.stdout


# Issue 44: a random spec of this shape bound ``dt_carrier`` and never read it (ruff F841). Its device copies mix
# int32 and int64 (the tails), but the one head read from the batch is of the carrier dtype (int32), so there
# was no source to check and the views were taken unconditionally, on the CPU too.
CARRIER_HEAD_ONLY = textwrap.dedent("""
    name: carrier_head_only
    slots:
      - {name: input_ids, shape: [max_bs], dtype: int32, axis: bs, padding: zero}
      - {name: positions, shape: [max_bs], dtype: int64, axis: bs, padding: zero, source: feed_positions}
""")


def test_a_module_whose_mixed_copies_read_only_carrier_heads_has_no_unused_local():
    spec = gs.parse_spec(CARRIER_HEAD_ONLY, "carrier.yaml")
    text = render_module(spec, gs.resolve_params(spec))
    check = ruff("check", "--select", "E4,E7,E9,F", "--output-format", "concise", "-", stdin=text)
    assert check.returncode == 0, check.stdout
    assert "if dt_carrier:" in text  # the views on CUDA only, as for any mixed group


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_module_whose_mixed_copies_read_only_carrier_heads_fills_as_the_interpreter(device):
    """The typed copies on the CPU, the one-dtype views on CUDA: the interpreter's buffers either way."""
    spec = gs.parse_spec(CARRIER_HEAD_ONLY, "carrier.yaml")
    hooks = {"feed_positions": lambda fb, ctx: fb.pos}
    batch = SimpleNamespace(input_ids=torch.tensor([5, 6], dtype=torch.int32, device=device),
                            pos=torch.tensor([7, 8, 9], device=device))
    for impl in ("interpreted", "generated"):
        reg = build(spec, device=device, max_bs=4, max_num_tokens=4, hooks=hooks, impl=impl)
        for slot in reg.active:
            slot.buffer.fill_(-1)
        reg.fill_from(batch, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
        got = {name: reg.slot(name).buffer.tolist() for name in ("input_ids", "positions")}
        assert got == {"input_ids": [5, 6, 0, 0], "positions": [7, 8, 9, 0]}, impl


# --- literals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["plain", "it's", 'say "hi"', "both ' and \"", "'' \"", "\"\" '", "back\\slash",
                                  "line\nbreak", "tab\there", "\x00\x7f\u2028\u202e", "ünïcode", ""])
def test_string_literals_are_exact_one_printable_line(text):
    literal = py_str(text)
    assert ast.literal_eval(literal) == text and "\n" not in literal and literal.isprintable()
    assert literal[0] == ("'" if text.count('"') > text.count("'") else '"')


@pytest.mark.parametrize("source, expected", [
    ("float('-inf')", 'float("-inf")'), ("1e+308", "1e+308"), ("'a' if x == 'b' else 2", '"a" if x == "b" else 2'),
    ("max(rt_fill, 2) - 70", "max(rt_fill, 2) - 70"),
])
def test_expressions_get_the_modules_quotes(source, expected):
    assert normalise(source) == expected
