"""Hostile spec files: bounded time and memory, and one exact `file:line: message` each.

Spec files arrive in pull requests and CI runs graphslot on them, so every case here is
untrusted input: YAML in, exact error out, within BUDGET_S seconds and BUDGET_MB of
Python allocations (tracemalloc) and of process peak growth (ru_maxrss), both through
the Python API and through the command line (``graphslot.cli.main`` in process).
"""

from __future__ import annotations

import gc
import resource
import signal
import sys
import textwrap
import threading
import time
import tracemalloc
from contextlib import contextmanager

import pytest

import graphslot as gs
from graphslot.cli import main
from graphslot.spec import checks, expr, yaml_loader

# The largest case (30,000 slots) takes about 1 s on an idle 2-core machine and 2.4 s with the
# cores shared; an input that made the loader quadratic would take minutes.
BUDGET_S = 5.0
BUDGET_MB = 200
SLOT = textwrap.dedent("""\
    slots:
      - name: x
        shape: [max_bs]
        dtype: int64
        axis: bs
        padding: zero
    """)
SPEC = "name: t\n" + SLOT  # line 1 name, 2 slots, 3 - name, 4 shape, 5 dtype, 6 axis, 7 padding


def _maxrss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB elsewhere


def measured(fn):
    """``fn()``, asserted to take less than BUDGET_S and BUDGET_MB.

    Time is measured on a plain run; memory on a second run under tracemalloc (which
    slows Python down several times), plus the growth of the process's peak RSS over
    both (buffers torch would allocate are invisible to tracemalloc).
    """
    rss_before = _maxrss_mb()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert elapsed < BUDGET_S, f"took {elapsed:.2f} s (budget {BUDGET_S} s)"
    assert peak < BUDGET_MB, f"allocated {peak:.0f} MB (budget {BUDGET_MB} MB)"
    assert _maxrss_mb() - rss_before < BUDGET_MB, "the process grew beyond the budget"
    return result


# Complexity tests time an operation at size n and 4n and bound the ratio: linear is 4x
# (less with fixed costs), a quadratic 16x, so RATIO_BOUND leaves a loaded machine room.
# Each attempt takes the best of REPEATS runs per size, the sizes interleaved so that a
# burst of load elsewhere slows both alike, with the garbage collector off; the ratio must
# hold in one of ATTEMPTS (a superlinear operation fails them all). A run past HANG_S
# fails at once: a superlinear scan of a few hundred KB runs for hours.
RATIO_BOUND = 8.0
REPEATS = 3
ATTEMPTS = 3
HANG_S = 20.0


class _Hang(Exception):
    pass


@contextmanager
def _deadline(seconds: float):
    """Raise _Hang after ``seconds`` (SIGALRM: the main thread of a POSIX process; the
    regex engine and pure-Python parsers check for signals, so they are interrupted)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def hang(signum, frame):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed(fn) -> float:
    gc.collect()
    gc.disable()
    try:
        with _deadline(HANG_S):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
    except _Hang:
        pytest.fail(f"one run took over {HANG_S} s: superlinear")
    finally:
        gc.enable()


def assert_linear(run, make, n: int, loops: int = 1) -> None:
    """``run(make(size))`` at sizes n and 4n: the larger takes under RATIO_BOUND times as
    long. ``loops`` runs per timing lengthen a short operation without growing its input
    (a large input adds cache misses that make even a linear scan look superlinear)."""
    small, large = make(n), make(4 * n)

    def repeat(value):
        for _ in range(loops):
            run(value)

    ratios = []
    for _ in range(ATTEMPTS):
        times = [(timed(lambda: repeat(small)), timed(lambda: repeat(large))) for _ in range(REPEATS)]
        t_small, t_large = min(t for t, _ in times), min(t for _, t in times)
        ratios.append(f"{t_small * 1000:.1f} ms -> {t_large * 1000:.1f} ms ({t_large / t_small:.1f}x)")
        if t_large < RATIO_BOUND * t_small:
            return
    pytest.fail(f"size {n} -> {4 * n}: {'; '.join(ratios)}; linear is 4x")


def errors(text: str, **kwargs) -> list:
    def run():
        with pytest.raises(gs.SpecError) as info:
            gs.parse_spec(text, path="spec.yaml", **kwargs)
        return str(info.value).splitlines()
    return measured(run)


def parses(text: str, **kwargs) -> gs.RegistrySpec:
    return measured(lambda: gs.parse_spec(text, path="spec.yaml", **kwargs))


def with_slot(**changes) -> str:
    """SPEC with slot lines replaced (``padding="fill_sentinel\\n    pad_value: -1"``)."""
    text = SPEC
    for key, value in changes.items():
        old = {"name": "name: x", "shape": "shape: [max_bs]", "dtype": "dtype: int64", "axis": "axis: bs",
               "padding": "padding: zero"}[key]
        text = text.replace(old, f"{old.split(':')[0]}: {value}", 1)
    return text


def cli(capsys, *argv):
    """(status, stdout lines, stderr lines) of ``graphslot ARGV``, within the budget."""
    runs = []

    def run():
        status = main(list(argv))
        runs.append((status, *capsys.readouterr()))
        return runs[-1]

    status, out, err = measured(run)
    assert runs[1] == runs[0]  # the traced run said the same
    assert "Traceback" not in out + err
    return status, out.splitlines(), err.splitlines()


# A billion-laughs document: 9 levels of 9 aliases each (9**9 strings once expanded).
ALIAS_BOMB = ('name: t\na: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
              + "".join(f"{n}: &{n} [" + ",".join([f"*{p}"] * 9) + "]\n"
                        for p, n in zip("abcdefghi", "bcdefghij"))
              + "padding_to_1k: '" + "x" * 420 + "'\n" + SLOT)
DEEP = "name: t\nslots: " + "[" * 5000 + "]" * 5000 + "\n"
SQUARING = ("name: t\nparams:\n  p0: {type: int, default: 3}\n"
            + "".join(f"  p{i}: {{type: int, default: 'p{i - 1} * p{i - 1}'}}\n" for i in range(1, 40)) + SLOT)


def test_the_hostile_inputs_are_as_described():
    assert 900 < len(ALIAS_BOMB.encode()) < 1100 and len(SQUARING.encode()) < 2000


# --- YAML ------------------------------------------------------------------------------


def test_alias_bomb_is_refused_at_its_first_anchor():
    assert errors(ALIAS_BOMB) == [
        "spec.yaml:2: YAML anchors (&name) are not allowed in a spec: write the value out where it is used"]


def test_nesting_depth_is_bounded():
    assert errors(DEEP) == ["spec.yaml:2: YAML nesting deeper than 32 levels: a spec needs only a few"]
    block = "name: t\n" + "".join("  " * i + f"k{i}:\n" for i in range(100)) + SLOT
    assert errors(block) == ["spec.yaml:34: YAML nesting deeper than 32 levels: a spec needs only a few"]


@pytest.mark.parametrize("line, message", [
    ("name: !!python/name:os.system t",
     "spec.yaml:1: YAML tags ('tag:yaml.org,2002:python/name:os.system') are not allowed in a spec"),
    ("name: !!python/object/apply:os.system [echo]",
     "spec.yaml:1: YAML tags ('tag:yaml.org,2002:python/object/apply:os.system') are not allowed in a spec"),
    ("name: !!str t", "spec.yaml:1: YAML tags ('tag:yaml.org,2002:str') are not allowed in a spec"),
    ("name: !custom t", "spec.yaml:1: YAML tags ('!custom') are not allowed in a spec"),
], ids=["python-name", "python-object", "str", "local"])
def test_tags_are_refused(line, message):
    assert errors(line + "\n" + SLOT) == [message]


def test_merge_keys_are_refused():
    assert errors("name: t\n<<: {description: d}\n" + SLOT) == [
        "spec.yaml:2: YAML merge keys (<<) are not allowed in a spec: write the keys out"]


def test_complex_keys_are_refused():
    assert errors("name: t\n? [a, b]\n: 1\n" + SLOT) == [
        "spec.yaml:2: mapping keys must be plain scalars, not a list or a mapping (? [a, b]: …)"]


def test_integers_beyond_64_bits_are_refused():
    assert errors(with_slot(shape="[max_bs, 9223372036854775808]")) == [
        "spec.yaml:4: integer '9223372036854775808' is out of range: spec integers must lie strictly between "
        "-2**63 and 2**63"]
    assert errors(with_slot(shape="[max_bs, " + "9" * 5000 + "]")) == [
        "spec.yaml:4: cannot read the value '" + "9" * 78 + "…: Exceeds the limit (4300 digits) for integer "
        "string conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit"]


def test_one_document_only():
    assert errors(SPEC + "---\nname: u\n") == [
        "spec.yaml:8: a spec is one YAML document; remove the second one ('---')"]


def test_nul_byte_and_control_characters():
    assert errors("name: t\x00\n" + SLOT) == [
        "spec.yaml:1: YAML syntax error: control characters are not allowed (character #x0000)"]
    assert errors("name: t\ndescription: a\x07b\n" + SLOT) == [
        "spec.yaml:2: YAML syntax error: control characters are not allowed (character #x0007)"]


def test_too_many_values():
    many = "name: t\n" + SLOT + "".join(f"  - {{name: s{i}, shape: [max_bs], dtype: int64, axis: bs, "
                                        f"padding: zero}}\n" for i in range(30000))
    # the line of the 250001st value (each key, scalar, list and mapping counts one)
    assert errors(many) == ["spec.yaml:20839: more than 250000 YAML values: a spec holds a few hundred"]


def test_too_many_slots_params_presets():
    slots = "".join(f"  - {{name: s{i}, shape: [max_bs], dtype: int64, axis: bs, padding: zero}}\n"
                    for i in range(4097))
    params = "".join(f"  p{i}: {{type: int, default: 1}}\n" for i in range(1025))
    presets = "".join(f"  e{i}: {{}}\n" for i in range(33))
    text = f"name: t\nparams:\n{params}presets:\n{presets}slots:\n{slots}"
    assert errors(text) == [
        "spec.yaml:2: too many params: 1025 (at most 1024)",
        "spec.yaml:1028: too many presets: 33 (at most 32)",
        "spec.yaml:1062: too many slots: 4097 (at most 4096)",
    ]


def test_a_10_mb_spec_validates_in_linear_time():
    def spec(slots: int) -> str:
        return "name: t\nslots:\n" + "".join(
            f"  - name: s{i}\n    shape: [max_bs, 4]\n    dtype: int64\n    axis: bs\n    padding: zero\n"
            f"    description: {'d' * 2400}\n" for i in range(slots))

    assert len(spec(4096)) > 10_000_000
    assert len(gs.parse_spec(spec(4096), path="spec.yaml").slots) == 4096
    assert_linear(lambda text: gs.parse_spec(text, path="spec.yaml"), spec, 1024)


# --- expressions -----------------------------------------------------------------------


def test_expression_depth_is_bounded():
    terms = "+".join(["1"] * 500)
    assert errors(with_slot(shape=f'[max_bs, "{terms}"]')) == [
        f"spec.yaml:4: slot 'x': shape[1]: expression '{terms[:79]}…' nests deeper than 50 levels "
        "(a sum of n terms nests n deep)"]


def test_expression_length_is_bounded():
    long = "1 + " * 300 + "1"
    assert errors(with_slot(shape=f'[max_bs, "{long}"]')) == [
        f"spec.yaml:4: slot 'x': shape[1]: expression '{long[:79]}…' is 1201 characters long; "
        "at most 1000 are allowed"]


def test_squaring_param_chain_overflows_instead_of_running_forever():
    assert errors(SQUARING) == [
        "spec.yaml:9: param 'p6': 'p5 * p5' in expression 'p5 * p5': integer overflow: the value has 102 bits, "
        "beyond the signed 64-bit range (|value| < 2**63)"]


def test_integer_overflow_in_a_shape():
    assert errors(with_slot(shape='[max_bs, "9223372036854775807 + 1"]')) == [
        "spec.yaml:4: slot 'x': shape[1]: '9223372036854775807 + 1' in expression '9223372036854775807 + 1': "
        "integer overflow: the value has 64 bits, beyond the signed 64-bit range (|value| < 2**63)"]


def test_long_param_default_chains_are_refused():
    params = "  p0: {type: int, default: 1}\n" + "".join(
        f"  p{i}: {{type: int, default: 'p{i - 1}'}}\n" for i in range(99, 0, -1))
    assert errors(f"name: t\nparams:\n{params}{SLOT}") == [
        "spec.yaml:4: param 'p99': its default depends on a chain of more than 64 param defaults; a default may "
        "name a param whose default names another, but not that deeply"]


def test_division_by_zero_in_shape_and_pad_value():
    params = "name: t\nparams:\n  d: {type: int, default: 0}\n"
    assert errors(params + with_slot(shape='[max_bs, "8 // d"]').split("\n", 1)[1]) == [
        "spec.yaml:6: slot 'x': shape[1]: division by zero in expression '8 // d'"]
    assert errors(params + with_slot(padding='fill_sentinel\n    pad_value: "1 // d"').split("\n", 1)[1]) == [
        "spec.yaml:10: slot 'x': pad_value: division by zero in expression '1 // d'"]
    assert errors(with_slot(shape='[max_bs, "max_bs // (max_bs - 256)"]')) == [
        "spec.yaml:4: slot 'x': shape at max_bs=256, max_num_tokens=256: division by zero in expression "
        "'max_bs // (max_bs - 256)'"]


# --- bytes declared ----------------------------------------------------------------------


def test_total_bytes_are_capped_at_the_validation_capacities():
    huge = with_slot(shape="[max_bs, 1000000000000]")
    assert errors(huge) == [
        "spec.yaml:2: the enabled slots take 2048000000000000 bytes at max_bs=256, max_num_tokens=256, more "
        "than the limit of 4294967296 bytes (largest: slot 'x', 2048000000000000 bytes); raise it with "
        "`graphslot validate --max-bytes N` or load_spec(..., max_bytes=N)"]
    assert parses(huge, max_bytes=2048000000000000).slots[0].shape == ("max_bs", 1000000000000)
    assert checks.DEFAULT_MAX_BYTES == 4 << 30
    assert errors(SPEC, max_bytes=2047) == [
        "spec.yaml:2: the enabled slots take 2048 bytes at max_bs=256, max_num_tokens=256, more than the limit "
        "of 2047 bytes (largest: slot 'x', 2048 bytes); raise it with `graphslot validate --max-bytes N` or "
        "load_spec(..., max_bytes=N)"]


def test_total_bytes_under_a_preset():
    text = ("name: t\nparams:\n  n: {type: int, default: 1}\npresets:\n  big: {n: 100000000000}\n"
            + with_slot(shape='[max_bs, n]').split("\n", 1)[1])
    assert errors(text) == [
        "spec.yaml:6: the enabled slots take 204800000000000 bytes at max_bs=256, max_num_tokens=256 with preset "
        "'big', more than the limit of 4294967296 bytes (largest: slot 'x', 204800000000000 bytes); raise it "
        "with `graphslot validate --max-bytes N` or load_spec(..., max_bytes=N)"]


def test_rank_is_bounded():
    assert errors(with_slot(shape="[max_bs" + ", 1" * 16 + "]")) == [
        "spec.yaml:4: slot 'x': shape has 17 dimensions; at most 16 are allowed"]


# --- pad values fit their dtype exactly ---------------------------------------------------


@pytest.mark.parametrize("dtype, value, message", [
    ("uint8", "-1", "pad_value -1 (int) does not fit dtype uint8"),
    ("uint8", "256", "pad_value 256 (int) does not fit dtype uint8"),
    ("int32", "4294967296", "pad_value 4294967296 (int) does not fit dtype int32"),
    ("int64", "1.5", "pad_value 1.5 (float) does not fit dtype int64"),
    ("int64", ".inf", "pad_value inf (float) does not fit dtype int64"),
    ("int32", "true", "pad_value True (bool) does not fit dtype int32"),
    ("bool", "2", "pad_value 2 (int) does not fit dtype bool"),
    ("bool", "1.0", "pad_value 1.0 (float) does not fit dtype bool"),
    ("float16", "1.0e+6", "pad_value 1000000.0 (float) does not fit dtype float16"),
])
def test_pad_value_that_does_not_fit(dtype, value, message):
    text = with_slot(dtype=dtype, padding=f"fill_sentinel\n    pad_value: {value}")
    assert errors(text) == [f"spec.yaml:8: slot 'x': {message}"]


@pytest.mark.parametrize("dtype, value", [
    ("uint8", "255"), ("int32", "-2147483648"), ("int64", "2.0"), ("bool", "1"), ("bool", "false"),
    ("float16", "-.inf"), ("float32", "-1"), ("bfloat16", "1.0e+30"),
])
def test_pad_value_that_fits(dtype, value):
    parses(with_slot(dtype=dtype, padding=f"fill_sentinel\n    pad_value: {value}"))


def test_evaluated_pad_value_must_fit():
    text = ("name: t\nparams:\n  fill: {type: int, default: -1, runtime: true}\n"
            + with_slot(dtype="uint8", padding="fill_sentinel\n    pad_value: fill").split("\n", 1)[1])
    assert errors(text) == ["spec.yaml:10: slot 'x': pad_value -1 (int) does not fit dtype uint8"]


def test_runtime_pad_value_that_does_not_fit_is_refused_by_build_and_show(capsys, tmp_path):
    text = ("name: t\nparams:\n  fill: {type: int, default: 1, runtime: true}\n"
            + with_slot(dtype="int32", padding="fill_sentinel\n    pad_value: fill").split("\n", 1)[1])
    spec = parses(text)
    with pytest.raises(gs.SpecError) as info:
        gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl="interpreted", params={"fill": 2**40}, device="cpu")
    assert str(info.value) == "spec.yaml:10: slot 'x': pad_value 1099511627776 does not fit dtype int32"
    (tmp_path / "p.yaml").write_text(text)
    status, out, err = cli(capsys, "show", str(tmp_path / "p.yaml"), "--param", "fill=-3000000000")
    assert status == 1 and out == []
    assert err == [f"{tmp_path / 'p.yaml'}:10: slot 'x': pad_value -3000000000 does not fit dtype int32"]


# --- names --------------------------------------------------------------------------------


def test_names_are_matched_in_full():
    text = "name: t\nslots:\n  - name: |\n      x\n    shape: [max_bs]\n    dtype: int64\n    axis: bs\n" \
           "    padding: zero\n"
    assert errors(text) == [
        "spec.yaml:3: slot 'x\\n': slot names are identifiers, or dotted identifiers for structured slots"]
    params = 'name: t\nparams:\n  "p\\n": {type: int, default: 1}\n' + SLOT
    assert errors(params) == [
        "spec.yaml:3: param name 'p\\n' must be an identifier other than max_bs, max_num_tokens, true and false"]


@pytest.mark.parametrize("name, message", [
    ("batch_size", "slot name 'batch_size' is reserved: extract sets it on the view to the padded batch size"),
    ("__class__", "slot names may not start with '__': extract sets the slot's attribute on the view, and "
                  "'__class__' or '__dict__' would replace the view's type or storage (and generated code keeps "
                  "'__' names for itself)"),
    ("__dict__", "slot names may not start with '__': extract sets the slot's attribute on the view, and "
                 "'__class__' or '__dict__' would replace the view's type or storage (and generated code keeps "
                 "'__' names for itself)"),
    ("__gs_hook", "slot names may not start with '__': extract sets the slot's attribute on the view, and "
                  "'__class__' or '__dict__' would replace the view's type or storage (and generated code keeps "
                  "'__' names for itself)"),
])
def test_reserved_slot_names(name, message):
    assert errors(with_slot(name=name)) == [f"spec.yaml:3: slot '{name}': {message}"]


def test_python_keywords_stay_valid_slot_names():
    assert parses(with_slot(name="class")).slots[0].name == "class"


def test_spec_name_is_an_identifier():
    message = ("must be an identifier (letters, digits, '_'; not starting with a digit): generated module names "
               "are made from it")
    assert errors(SPEC.replace("name: t", "name: my spec", 1)) == [f"spec.yaml:1: spec name 'my spec' {message}"]
    assert errors(SPEC.replace("name: t", 'name: "t\\n"', 1)) == [f"spec.yaml:1: spec name 't\\n' {message}"]


def test_control_characters_in_texts():
    text = ("name: t\ndescription: \"ok\\n\\ttab, then \\e[2J\"\nparams:\n"
            "  mode: {type: str, default: \"a\\x07\", description: \"\\u202e\"}\n"
            "presets:\n  e: {mode: \"x\\ty\"}\n" + SLOT)
    assert errors(text) == [
        "spec.yaml:2: description contains the control character U+001B; only newlines and tabs are allowed",
        "spec.yaml:4: description contains the control character U+202E; only newlines and tabs are allowed",
        "spec.yaml:4: default of param 'mode' contains the control character U+0007",
        "spec.yaml:6: preset 'e': the value of param 'mode' contains the control character U+0009",
    ]
    assert parses(SPEC.replace("name: t", 'name: t\ndescription: "two\\nlines\\tand a tab"', 1))


def test_dunder_param_names():
    assert errors("name: t\nparams:\n  __p: {type: int, default: 1}\n" + SLOT) == [
        "spec.yaml:3: param name '__p' may not start with '__': generated code keeps '__' names for itself"]


# --- hooks --------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", [":x", "..foo:x", "pkg.:x", "pkg:", "a b:c", "pkg:x:y", "pkg:x\n"])
def test_malformed_hook_references(ref):
    import json
    assert errors(SPEC + f"    post_fill: {json.dumps(ref)}\n") == [
        f"spec.yaml:8: slot 'x': malformed hook reference {ref!r}: write 'package.module:function' "
        "(a dotted module path of identifiers, ':', a function name)"]


def test_plain_hook_names_are_identifiers():
    assert errors(SPEC + "    post_fill: my-hook\n") == [
        "spec.yaml:8: slot 'x': hook name 'my-hook' is not an identifier (dots allowed): name a built-in hook or a "
        "build_registry(hooks=...) key, or write 'package.module:function'"]


@pytest.fixture
def hook_module(tmp_path, monkeypatch):
    """A module that records being imported, next to a spec naming it."""
    marker = tmp_path / "imported"
    (tmp_path / "evil_hooks_mod.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "def post_fill(buffer, fb, ctx):\n    pass\n")
    (tmp_path / "boom_hooks_mod.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "s.yaml").write_text(SPEC + "    post_fill: evil_hooks_mod:post_fill\n")
    (tmp_path / "b.yaml").write_text(SPEC + "    post_fill: boom_hooks_mod:post_fill\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("evil_hooks_mod", "boom_hooks_mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return marker


def test_validate_does_not_import_hooks_unless_asked(capsys, hook_module):
    status, out, _ = cli(capsys, "validate", "s.yaml")
    assert status == 0 and out == ["ok  s.yaml (1 slots; 1 hook import not checked: pass --import-hooks)"]
    assert not hook_module.exists()
    status, out, _ = cli(capsys, "show", "s.yaml")
    assert status == 0 and out[-1] == "note: 1 hook import not checked: pass --import-hooks"
    assert not hook_module.exists()
    status, out, _ = cli(capsys, "validate", "--import-hooks", "s.yaml")
    assert status == 0 and out == ["ok  s.yaml (1 slots)"]
    assert hook_module.read_text() == "ran"


def test_import_hooks_from_pyproject(capsys, hook_module, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.graphslot]\nimport_hooks = true\n")
    status, out, _ = cli(capsys, "validate", "s.yaml")
    assert status == 0 and out == ["ok  s.yaml (1 slots)"] and hook_module.exists()


def test_a_hook_module_that_fails_to_import(capsys, hook_module):
    status, out, _ = cli(capsys, "validate", "--import-hooks", "b.yaml", "s.yaml")
    assert status == 1
    assert out == ["b.yaml:8: slot 'x': importing hook 'boom_hooks_mod:post_fill' failed: RuntimeError: "
                   "boom at import", "ok  s.yaml (1 slots)"]


def test_build_registry_still_resolves_import_hooks(hook_module):
    spec = gs.load_spec("s.yaml")
    assert not hook_module.exists()
    gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl="interpreted", device="cpu")
    assert hook_module.exists()


# --- long values ------------------------------------------------------------------------------


def test_long_values_are_cut_in_messages():
    items = ", ".join(['"aaaaaaaa"'] * 40)
    assert errors(with_slot(dtype=f"[{items}]")) == [
        "spec.yaml:5: slot 'x': bad value for 'dtype': input should be a valid string (got ['aaaaaaaa', "
        "'aaaaaaaa', 'aaaaaaaa', 'aaaaaaaa', 'aaaaaaaa', 'aaaaaaaa', 'aaaaa…)"]
    assert errors(SPEC + "    " + "k" * 400 + ": 1\n") == [
        "spec.yaml:8: slot 'x': unknown key '" + "k" * 79 + "…'; allowed keys: name, shape, dtype, axis, "
        "slice_dim, device, padding, pad_value, index, optional, enabled_if, copy_from_fb, post_fill, source, "
        "pre_capture, adopt, extra_rows, reset_to, staged, description"]


def test_a_wrongly_typed_value_makes_short_lines():
    nested = "[" + ", ".join("{" + ", ".join(f"k{j}: [{'v' * 20}]" for j in range(3)) + "}" for _ in range(8)) + "]"
    assert len(nested) > 400
    assert errors(with_slot(axis=nested)) == [
        "spec.yaml:6: slot 'x': '[{'k0': ['vvvvvvvvvvvvvvvvvvvv'], 'k1': ['vvvvvvvvvvvvvvvvvvvv'], 'k2': ['vvvvv…' "
        "is not a valid axis (one of: bs, tokens, none)"]
    assert errors(with_slot(name=nested)) == [
        "spec.yaml:3: bad value for 'name': input should be a valid string (got [{'k0': ['vvvvvvvvvvvvvvvvvvvv'], "
        "'k1': ['vvvvvvvvvvvvvvvvvvvv'], 'k2': ['vvvvv…)"]


# --- the command line -------------------------------------------------------------------------


@pytest.fixture
def hostile_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB)
    (tmp_path / "deep.yaml").write_text(DEEP)
    (tmp_path / "square.yaml").write_text(SQUARING)
    (tmp_path / "latin1.yaml").write_bytes(b"name: t\ndescription: caf\xe9\n" + SLOT.encode())
    (tmp_path / "nul.yaml").write_bytes(b"name: t\n\x00\n" + SLOT.encode())
    (tmp_path / "good.yaml").write_text(SPEC)
    return tmp_path


@pytest.mark.parametrize("name, line", [
    ("bomb", "bomb.yaml:2: YAML anchors (&name) are not allowed in a spec: write the value out where it is used"),
    ("deep", "deep.yaml:2: YAML nesting deeper than 32 levels: a spec needs only a few"),
    ("square", "square.yaml:9: param 'p6': 'p5 * p5' in expression 'p5 * p5': integer overflow: the value has "
               "102 bits, beyond the signed 64-bit range (|value| < 2**63)"),
    ("latin1", "latin1.yaml:2: not UTF-8: byte 0xe9 at offset 24 cannot be decoded"),
    ("nul", "nul.yaml:2: YAML syntax error: control characters are not allowed (character #x0000)"),
])
def test_validate_and_show_on_hostile_files(capsys, hostile_dir, name, line):
    status, out, err = cli(capsys, "validate", f"{name}.yaml")
    assert status == 1 and out == [line] and err == ["1 error(s) in 1 of 1 spec file(s)"]
    status, out, err = cli(capsys, "show", f"{name}.yaml")
    assert status == 1 and out == [] and err == [line]


def test_validate_reports_every_file_after_a_bad_one(capsys, hostile_dir):
    status, out, err = cli(capsys, "validate", "latin1.yaml", "nul.yaml", "bomb.yaml", "good.yaml", "missing.yaml")
    assert status == 1
    assert out == [
        "latin1.yaml:2: not UTF-8: byte 0xe9 at offset 24 cannot be decoded",
        "nul.yaml:2: YAML syntax error: control characters are not allowed (character #x0000)",
        "bomb.yaml:2: YAML anchors (&name) are not allowed in a spec: write the value out where it is used",
        "ok  good.yaml (1 slots)",
        "missing.yaml: no such spec file; shipped specs are: decode, prefill, vllm",
    ]
    assert err == ["4 error(s) in 4 of 5 spec file(s)"]


def test_show_computes_sizes_without_allocating(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "big.yaml").write_text(with_slot(shape="[200000000]", axis="none", padding="keep_pad"))
    status, out, _ = cli(capsys, "show", "big.yaml")
    assert status == 0 and out[-1] == "total: 1600000000 bytes (1.5 GiB) in 1 of 1 slots enabled"
    (tmp_path / "huge.yaml").write_text(with_slot(shape="[1000000000000]", axis="none", padding="keep_pad"))
    status, out, err = cli(capsys, "show", "huge.yaml")
    assert status == 1 and err == [
        "huge.yaml:2: the enabled slots take 8000000000000 bytes at max_bs=256, max_num_tokens=256, more than the "
        "limit of 4294967296 bytes (largest: slot 'x', 8000000000000 bytes); raise it with `graphslot validate "
        "--max-bytes N` or load_spec(..., max_bytes=N)"]
    status, out, _ = cli(capsys, "show", "huge.yaml", "--max-bytes", "8000000000000")
    assert status == 0 and out[-1] == "total: 8000000000000 bytes (7.3 TiB) in 1 of 1 slots enabled"


def test_validate_max_bytes(capsys, hostile_dir):
    status, out, _ = cli(capsys, "validate", "--max-bytes", "2047", "good.yaml")
    assert status == 1 and out == [
        "good.yaml:2: the enabled slots take 2048 bytes at max_bs=256, max_num_tokens=256, more than the limit of "
        "2047 bytes (largest: slot 'x', 2048 bytes); raise it with `graphslot validate --max-bytes N` or "
        "load_spec(..., max_bytes=N)"]


def test_show_is_linear_in_the_number_of_slots(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def spec_file(slots: int) -> str:
        slot_lines = "".join(f"  - {{name: s{i}, shape: [max_bs, 4], dtype: int64, axis: bs, padding: zero}}\n"
                             for i in range(slots))
        (tmp_path / f"many{slots}.yaml").write_text("name: t\nslots:\n" + slot_lines)
        return f"many{slots}.yaml"

    def show(path: str) -> None:
        assert main(["show", path]) == 0
        capsys.readouterr()

    assert main(["show", spec_file(4096)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "total: 33554432 bytes (32.0 MiB) in 4096 of 4096 slots enabled"
    assert_linear(show, spec_file, 256)


def test_show_division_by_zero_from_a_param(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.yaml").write_text("name: t\nparams:\n  d: {type: int, default: 1}\n"
                                     + with_slot(shape='[max_bs, "8 // d"]').split("\n", 1)[1])
    status, out, err = cli(capsys, "show", "d.yaml", "--param", "d=0")
    assert status == 1 and err == ["d.yaml:5: slot 'x': division by zero in expression '8 // d'"]
    status, out, err = cli(capsys, "show", "d.yaml", "--param", "d=9223372036854775808")
    assert status == 1 and err == [
        "d.yaml:5: slot 'x': 'd' in expression '8 // d': integer overflow: the value has 64 bits, beyond the "
        "signed 64-bit range (|value| < 2**63)"]


def test_show_rejects_huge_capacities(capsys):
    status, _, err = cli(capsys, "show", "decode", "--max-bs", "9" * 30)
    assert status == 2 and err[-1].endswith("argument --max-bs: expected a positive integer, got "
                                            "'999999999999999999999999999999'")


def test_schema_output_errors_are_one_line(capsys, tmp_path):
    status, out, err = cli(capsys, "schema", "--output", str(tmp_path / "no" / "such" / "dir.json"))
    assert status == 1 and err == [f"{tmp_path / 'no' / 'such' / 'dir.json'}: cannot write: No such file or directory"]


def test_limits_are_module_level_settings():
    assert (yaml_loader.MAX_YAML_DEPTH, yaml_loader.MAX_YAML_NODES, yaml_loader.INT_LIMIT) == (32, 250_000, 2**63)
    assert (expr.MAX_EXPR_LENGTH, expr.MAX_EXPR_DEPTH, expr.INT_LIMIT) == (1000, 50, 2**63)
    assert (checks.MAX_PARAM_CHAIN, checks.MAX_RANK, checks.VALIDATION_CAPACITIES) == (
        64, 16, {"max_bs": 256, "max_num_tokens": 256})


# --- pyproject.toml ----------------------------------------------------------------------------
# pyproject.toml arrives in pull requests like the specs, and every command scans its text
# for the lines of table headers and keys. Each hostile line sits in a multi-line string
# (valid TOML, so the scans see it): 4 KB and 16 KB (the old table-header scan took two
# minutes on a 4 KB line, and longer than the test allows on 16 KB).

PYPROJECT = '''[project]
name = "victim"
description = {quote}
{line}
{quote}

[tool.graphslot]
specs = ["t.yaml"]
output_dir = "gen"

[[tool.graphslot.outputs]]
module = "t_default"
spec = "t.yaml"
'''
HOSTILE_LINES = {
    "open bracket": lambda n: "[" + " " * n,
    "open double bracket": lambda n: "[[" + " " * n,
    "bracket spaces bracket text": lambda n: "[" + " " * n + "]x",
    "header then spaces and text": lambda n: "[a]" + " " * n + "x",
    "header of spaced dots": lambda n: "[a" + " ." * (n // 2),
    "spaces around a key": lambda n: " " * (n // 2) + "specs" + " " * (n // 2) + "x",
    "a key after every comma": lambda n: ",a." * (n // 3),
    "a quoted key after every brace": lambda n: "{'a'." * (n // 5),
    "quotes": lambda n: "'" * n,
}


@pytest.fixture
def pyproject_dirs(tmp_path, monkeypatch):
    """``make(text)`` -> a new project directory holding pyproject.toml ``text`` and t.yaml."""
    def make(text: str):
        directory = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        directory.mkdir()
        (directory / "pyproject.toml").write_text(text)
        (directory / "t.yaml").write_text(SPEC)
        return directory
    return make


def hostile_pyproject(shape: str, n: int) -> str:
    line = HOSTILE_LINES[shape](n)
    return PYPROJECT.format(line=line, quote='"""' if "'" in line else "'''")


def run_in(capsys, monkeypatch, directory, argv, status: int) -> None:
    monkeypatch.chdir(directory)
    assert main(argv) == status
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err


@pytest.mark.parametrize("shape", HOSTILE_LINES)
@pytest.mark.parametrize("argv, status", [(["validate"], 0), (["generate", "--check"], 1)])
def test_pyproject_scans_are_linear(capsys, monkeypatch, pyproject_dirs, shape, argv, status):
    assert_linear(lambda d: run_in(capsys, monkeypatch, d, argv, status),
                  lambda n: pyproject_dirs(hostile_pyproject(shape, n)), 4096, loops=3)
    monkeypatch.chdir(pyproject_dirs(hostile_pyproject(shape, 16384)))
    assert main(argv) == status
    out, err = capsys.readouterr()
    if argv == ["validate"]:
        assert out == "ok  t.yaml (1 slots)\n"
    else:
        assert err.splitlines()[-1] == ("out of date: 1 of 1 generated module(s), the package __init__.py; run "
                                        "`graphslot generate` and commit the result")


def unknown_keys(n: int) -> str:
    return "".join(f"unknown{i} = 1\n" for i in range(n))  # one error line each


def outputs(n: int) -> str:
    return "".join(f'\n[[tool.graphslot.outputs]]\nmodule = "m{i}"\nspec = "t.yaml"\n' for i in range(n))


@pytest.mark.parametrize("entries, status", [(unknown_keys, 1), (outputs, 0)])
def test_pyproject_errors_and_entries_are_linear(capsys, monkeypatch, pyproject_dirs, entries, status):
    def make(n: int):
        return pyproject_dirs('[tool.graphslot]\nspecs = ["t.yaml"]\noutput_dir = "gen"\n' + entries(n))

    monkeypatch.chdir(make(3))
    assert main(["validate"]) == status
    out, err = capsys.readouterr()
    assert (out + err).splitlines() == (
        ["graphslot validate: error: " * (i == 0) + f"pyproject.toml:{4 + i}: [tool.graphslot]: unknown key "
         f"'unknown{i}' (allowed: import_hooks, output_dir, outputs, specs)" for i in range(3)]
        if status else ["ok  t.yaml (1 slots)"])
    assert_linear(lambda d: run_in(capsys, monkeypatch, d, ["validate"], status), make, 1000)


def test_modules_named_twice_are_found_in_linear_time(capsys, monkeypatch, pyproject_dirs):
    def make(n: int):  # every module name on two entries
        return pyproject_dirs('[tool.graphslot]\nspecs = ["t.yaml"]\noutput_dir = "gen"\n' + "".join(
            f'\n[[tool.graphslot.outputs]]\nmodule = "m{i // 2}"\nspec = "t.yaml"\n' for i in range(n)))

    monkeypatch.chdir(make(4))
    assert main(["validate"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "graphslot validate: error: pyproject.toml:5: [tool.graphslot] outputs: module name used twice: m0",
        "pyproject.toml:13: [tool.graphslot] outputs: module name used twice: m1"]
    assert_linear(lambda d: run_in(capsys, monkeypatch, d, ["validate"], 1), make, 4000)


@pytest.mark.parametrize("shape", HOSTILE_LINES)
def test_new_specs_pyproject_editor_is_linear(shape):
    from graphslot.cli.pyproject_edit import pyproject_with_entry

    def edit(text: str) -> None:
        assert pyproject_with_entry(text, "specs/new.yaml").count('"specs/new.yaml"') == 1

    assert_linear(edit, lambda n: hostile_pyproject(shape, n), 4096, loops=10)


def test_a_long_dotted_key_is_refused_in_linear_time(capsys, monkeypatch, pyproject_dirs):
    # tomllib takes time and memory quadratic in the parts of a key: 80 000 parts, a
    # 160 KB line, exhausted the memory of the machine.
    def make(parts: int):
        return pyproject_dirs('[project]\nname = "x"\n' + ".".join(["a"] * parts) + " = 1\n")

    assert_linear(lambda d: run_in(capsys, monkeypatch, d, ["validate"], 1), make, 2000)
    monkeypatch.chdir(make(129))
    assert main(["validate"]) == 1
    assert capsys.readouterr().err == (
        "graphslot validate: error: pyproject.toml:3: a dotted key of more than 128 parts: TOML parsers take time "
        "and memory quadratic in them, so graphslot does not read the file\n")
