"""Generated modules are already formatted: ``ruff format`` leaves them as they are.

An engine that runs a formatter over its tree (a pre-commit hook) would otherwise
rewrite the committed modules, ``graphslot generate --check`` would call them stale, and
``graphslot generate`` would write them back: a loop. So every module graphslot writes
is a fixed point of ``ruff format`` with its default settings (88 columns, double
quotes, magic trailing commas), and ``ruff check`` with the default rule set (E4, E7,
E9, F: no import after a statement, no unused local) finds nothing in it. Checked with
ruff itself on the committed modules, on the shipped specs under the param sets the
differential tests use, on a spec made to reach every layout the generator has (names
up to 44 characters, optional and mixed-dtype copies, hooks, host slots, wide tails),
and on random specs. (The generator lays out the statements it makes as ruff does, it
is no formatter: a name of some 50 characters gets lines ruff would split further.)
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List

import pytest
from hypothesis import HealthCheck, given, settings

import graphslot as gs
from graphslot.codegen.generator import render_module
from graphslot.codegen.layout import normalise, py_str

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


FMT_OFF = "\n# fmt: off\n"


def laid_out(text: str) -> str:
    """The module without its ``# fmt: off``: what ruff format at its defaults must leave
    as it is (with it, ruff leaves any module alone)."""
    assert text.count(FMT_OFF) == 1, "a generated module says # fmt: off once, after its docstring"
    return text.replace(FMT_OFF, "\n", 1)


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
        (folder / name.replace("-", "_")).write_text(laid_out(text), encoding="utf-8")
    return folder


@pytest.mark.parametrize("width", [79, 100, 120])
def test_a_formatter_at_another_width_leaves_the_committed_modules_alone(width, tmp_path):
    """Engines format at 79, 100 or 120 columns: ``# fmt: off`` keeps ruff (and black)
    off the module, so ``generate --check`` stays clean in their tree."""
    for path in COMMITTED:
        shutil.copy(path, tmp_path / path.name)
    result = ruff("format", "--line-length", str(width), "--diff", str(tmp_path))
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_ruff_format_leaves_every_generated_module_as_it_is(modules):
    result = ruff("format", "--diff", str(modules))
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_ruff_check_finds_nothing_in_generated_modules(modules):
    result = ruff("check", "--select", "E4,E7,E9,F", "--output-format", "concise", str(modules))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_committed_modules_keep_to_88_columns():
    for path in COMMITTED:
        long = [(i + 1, line) for i, line in enumerate(path.read_text("utf-8").splitlines()) if len(line) > 88]
        assert not long, (path.name, long)


def test_the_features_spec_reaches_every_layout():
    """The hand-made spec above is only worth checking if it makes the generator split
    calls, subscripts and conditions: it does."""
    text = _modules()["features.py"]
    layouts = {
        "a call, arguments hugged": "pad_dev_int64_tokens_zero = torch.full(\n        (max_num_tokens,), 0,",
        "a call, one argument a line": "    ctx = __gs_context(\n                raw_bs,\n",
        "a display in a call": "make_view = __gs_ViewMaker(\n        (\n",
        "a subscript split": "buffers[\n",
        "a value in parentheses": " = (\n",
        "a chain of calls": ").copy_(",
        "a condition in parentheses": "if (\n",
        "a parenthesized operand split": "and (\n",
        "a nested one": "or (\n",
        "a comparison split": "\n            is not None\n        ):",
    }
    missing = [what for what, piece in layouts.items() if piece not in text]
    assert not missing, missing
    assert """"mode": 'it\\'s "quoted"',""" in text and '"tiny": 1e-05' in text
    assert "else:\n                    # another dtype or layout" in text  # the typed fallback
    assert ".copy_(" in text and "__gs_check.hook_source(" in text
    assert max(len(line) for line in text.splitlines()) <= 100  # 88 but where one name runs on


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_ruff_format_leaves_modules_of_random_specs_as_they_are(case):
    spec = gs.parse_spec(case.text, "random.yaml")
    try:
        text = render_module(spec, gs.resolve_params(spec, case.params))
    except gs.SpecError:
        return  # a param set the spec refuses: nothing is generated
    result = ruff("format", "-", stdin=laid_out(text))
    assert result.returncode == 0 and result.stdout == laid_out(text), result.stderr
    check = ruff("check", "--select", "E4,E7,E9,F", "--output-format", "concise", "-", stdin=text)
    assert check.returncode == 0, check.stdout


# --- literals in ruff's spelling --------------------------------------------------------------


@pytest.mark.parametrize("text", ["plain", "it's", 'say "hi"', "both ' and \"", "'' \"", "\"\" '", "back\\slash",
                                  "line\nbreak", "tab\there", "\x00\x7f\u2028\u202e", "ünïcode", ""])
def test_string_literals_are_exact_and_in_ruffs_quotes(text):
    literal = py_str(text)
    assert ast.literal_eval(literal) == text and "\n" not in literal and literal.isprintable()
    assert literal[0] == ("'" if text.count('"') > text.count("'") else '"')
    formatted = ruff("format", "-", stdin=f"x = {literal}\n")
    assert formatted.stdout == f"x = {literal}\n"


@pytest.mark.parametrize("source, expected", [
    ("float('-inf')", 'float("-inf")'), ("1e+308", "1e308"), ("1e-05", "1e-05"), ("'a' if x == 'b' else 2",
                                                                                 '"a" if x == "b" else 2'),
    ("max(rt_fill, 2) - 70", "max(rt_fill, 2) - 70"),
])
def test_expressions_get_ruffs_quotes_and_numbers(source, expected):
    assert normalise(source) == expected
    assert ruff("format", "-", stdin=f"x = {expected}\n").stdout == f"x = {expected}\n"
