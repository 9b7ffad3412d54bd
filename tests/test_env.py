"""Every ``GRAPHSLOT_*`` environment variable is declared in graphslot/env.py and read
through its type's one parser: the same spelling means the same thing everywhere, and a
value a variable does not accept is an error naming it and what it accepts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from graphslot import env
from graphslot.env import EnvError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphslot"
#: ``GRAPHSLOT_`` names in the package that are not environment variables.
NOT_VARIABLES = {"GRAPHSLOT_VERSION": "the version constant every generated module carries"}

BOOLS = [v for v in env.VARIABLES if v.type == "bool"]
TRUE_SPELLINGS = ["1", "true", "TRUE", "Yes", "on", " on "]
FALSE_SPELLINGS = ["0", "false", "False", "no", "OFF", " 0 "]
UNSET_SPELLINGS = ["", "   "]


def package_sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_graphslot_name_in_the_package_source_is_declared():
    found = {}
    for path in package_sources():
        for name in re.findall(r"GRAPHSLOT_[A-Z0-9_]+", path.read_text(encoding="utf-8")):
            found.setdefault(name, path.relative_to(ROOT).as_posix())
    undeclared = {name: where for name, where in found.items() if name not in env.BY_NAME and name not in NOT_VARIABLES}
    assert undeclared == {}
    assert set(env.BY_NAME) <= set(found)  # and each declared one is in the source (read somewhere)


def test_only_graphslot_env_reads_the_environment():
    readers = []
    for path in package_sources():
        if path == PACKAGE / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                    any(a.name in ("environ", "getenv") for a in node.names):
                readers.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert readers == []


def test_the_declarations():
    names = [v.name for v in env.VARIABLES]
    assert names == ["GRAPHSLOT_STRICT", "GRAPHSLOT_DEBUG", "GRAPHSLOT_EAGER_INPUT_NO_COPY",
                     "GRAPHSLOT_MAX_BUFFER_BYTES", "GRAPHSLOT_MAX_KV_BYTES", "GRAPHSLOT_SGLANG", "GRAPHSLOT_VLLM"]
    assert len(set(names)) == len(names) and all(v.meaning and v.default for v in env.VARIABLES)
    assert {v.name: v.type for v in env.VARIABLES} == {
        "GRAPHSLOT_STRICT": "bool", "GRAPHSLOT_DEBUG": "bool", "GRAPHSLOT_EAGER_INPUT_NO_COPY": "bool",
        "GRAPHSLOT_MAX_BUFFER_BYTES": "bytes", "GRAPHSLOT_MAX_KV_BYTES": "bytes", "GRAPHSLOT_SGLANG": "bool",
        "GRAPHSLOT_VLLM": "bool"}
    with pytest.raises(ValueError, match=r"^GRAPHSLOT_X: unknown type 'float' \(types: bool, bytes\)$"):
        env.Variable("GRAPHSLOT_X", "float", "0", "nothing")
    with pytest.raises(KeyError, match="GRAPHSLOT_NOPE is not a declared graphslot environment variable"):
        env.variable("GRAPHSLOT_NOPE")


@pytest.mark.parametrize("variable", BOOLS, ids=lambda v: v.name)
def test_one_boolean_parser(variable):
    for value in TRUE_SPELLINGS:
        assert variable.read({variable.name: value}) is True, value
    for value in FALSE_SPELLINGS:
        assert variable.read({variable.name: value}) is False, value
    for value in UNSET_SPELLINGS:
        assert variable.read({variable.name: value}) is None and not variable.enabled({variable.name: value})
    assert variable.read({}) is None
    for value in ("maybe", "2", "y", "enabled"):
        with pytest.raises(EnvError) as info:
            variable.read({variable.name: value})
        assert str(info.value) == f"{variable.name}={value!r} is not a boolean: use 1/true/yes/on or 0/false/no/off"


@pytest.mark.parametrize("name", ["GRAPHSLOT_MAX_BUFFER_BYTES", "GRAPHSLOT_MAX_KV_BYTES"])
def test_one_byte_count_parser(name):
    variable = env.variable(name)
    assert variable.read({name: "8589934592"}) == 8589934592 and variable.read({name: " 95 "}) == 95
    assert variable.read({name: ""}) is None and variable.read({name: "  "}) is None and variable.read({}) is None
    for value in ("0", "-1", "4GiB", "1e9", "0x10", "１２"):
        with pytest.raises(EnvError) as info:
            variable.read({name: value})
        assert str(info.value) == (f"{name}={value!r} is not a byte count: set it to a positive integer number of "
                                   "bytes (e.g. 8589934592 for 8 GiB), or unset it")


def test_a_long_value_is_shown_short():
    with pytest.raises(EnvError) as info:
        env.STRICT.read({"GRAPHSLOT_STRICT": "x" * 10_000})
    assert len(str(info.value)) < 200 and "…" in str(info.value)


# --- the readers: each variable means the same thing where it is read ----------------------


def test_graphslot_eager_input_no_copy_false_means_copy(monkeypatch):
    """It used to be on for any value but "" and "0": "false" turned no-copy on."""
    from graphslot.reference import build_reference_model
    from graphslot.reference.adapter import ReferenceDecodeAdapter
    from graphslot.runners.eager import EagerRunner, no_copy_from_env

    adapter = ReferenceDecodeAdapter(build_reference_model())
    for value, expected in [("false", False), ("off", False), ("no", False), ("true", True), ("", False)]:
        monkeypatch.setenv("GRAPHSLOT_EAGER_INPUT_NO_COPY", value)
        assert no_copy_from_env() is expected and EagerRunner(adapter).no_copy is expected, value
    monkeypatch.setenv("GRAPHSLOT_EAGER_INPUT_NO_COPY", "maybe")
    with pytest.raises(EnvError, match=r"^GRAPHSLOT_EAGER_INPUT_NO_COPY='maybe' is not a boolean"):
        EagerRunner(adapter)
    assert EagerRunner(adapter, no_copy=True).no_copy  # given: the variable is not read


def test_graphslot_debug_maybe_is_an_error(monkeypatch):
    """It used to turn the guard on for any value but ""/0/false/no/off."""
    from graphslot.runners.guard import guard_wanted

    for value, expected in [("on", True), ("1", True), ("off", False), ("", False)]:
        monkeypatch.setenv("GRAPHSLOT_DEBUG", value)
        assert guard_wanted(None) is expected, value
    monkeypatch.setenv("GRAPHSLOT_DEBUG", "maybe")
    with pytest.raises(EnvError, match=r"^GRAPHSLOT_DEBUG='maybe' is not a boolean: use 1/true/yes/on or "
                                       r"0/false/no/off$"):
        guard_wanted(None)
    assert guard_wanted(False) is False and guard_wanted(True) is True  # the config wins, unread


def test_graphslot_strict_reads_the_same_spellings(monkeypatch):
    import graphslot as gs

    for value, expected in [("YES", True), ("off", False), (" ", False)]:
        monkeypatch.setenv("GRAPHSLOT_STRICT", value)
        assert (gs.build_registry("decode", max_bs=2, max_num_tokens=2, impl="interpreted", device="cpu").strict
                is expected), value
    monkeypatch.setenv("GRAPHSLOT_STRICT", "maybe")
    with pytest.raises(EnvError, match=r"^GRAPHSLOT_STRICT='maybe' is not a boolean"):
        gs.build_registry("decode", max_bs=2, max_num_tokens=2, impl="interpreted", device="cpu")


def test_the_readme_table_is_the_declarations():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = env.markdown_table()
    assert table in readme
    assert table.count("\n") == len(env.VARIABLES) + 2
    for variable in env.VARIABLES:
        assert f"| `{variable.name}` | {variable.type} |" in table
