"""A project's graphslot settings: the ``[tool.graphslot]`` table of its pyproject.toml.

::

    [tool.graphslot]
    specs = ["specs/decode.yaml", "specs/prefill.yaml"]   # relative to pyproject.toml
    output_dir = "mypkg/generated"                        # for `graphslot generate`
    import_hooks = false                                  # may specs name importable hooks?

    [[tool.graphslot.outputs]]
    module = "decode_default"
    spec = "specs/decode.yaml"
    preset = "eager"                                      # optional
    params = { dp_size = 2 }                              # optional

pyproject.toml arrives in pull requests like spec files do, so the table is validated
as strictly: an unknown key or a value of the wrong type is an error naming
``pyproject.toml:LINE``, and every string it holds is treated as untrusted text. How the
file is read, parsed and scanned for lines (linear in its length, bounded):
:mod:`.pyproject_text`; how ``graphslot new-spec`` edits it: :mod:`.pyproject_edit`.
"""

from __future__ import annotations

import keyword
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Dict, List, Mapping, Optional, Union

from .errors import SpecIssue, did_you_mean, one_of, shorten
from .files import display_path
from .names import is_identifier
from .pyproject_text import (MAX_KEY_PARTS, MAX_PYPROJECT_BYTES, PYPROJECT, Locator, ProjectConfigError, line_key,
                             long_key_line, pyproject_label, read_pyproject, read_toml, table_header)

# Re-exported: what the rest of graphslot imports from here.
__all__ = ["MAX_KEY_PARTS", "MAX_PYPROJECT_BYTES", "OUTPUTS", "PYPROJECT", "TABLE", "Locator", "OutputConfig",
           "ProjectConfig", "ProjectConfigError", "display_path", "find_pyproject", "line_key", "load_project_config",
           "long_key_line", "output_dir_escape", "parse_pyproject", "path_escape", "read_pyproject", "table_header",
           "validate_table"]

TABLE = "[tool.graphslot]"
OUTPUTS = "[[tool.graphslot.outputs]]"
TABLE_KEYS = ("specs", "output_dir", "outputs", "import_hooks")
OUTPUT_KEYS = ("module", "spec", "preset", "params")
#: Longest untrusted value an error shows.
SHOWN = 60


@dataclass(frozen=True)
class OutputConfig:
    """One ``[[tool.graphslot.outputs]]`` entry, validated."""

    module: str
    spec: str
    preset: Optional[str] = None
    params: Mapping[str, Any] = field(default_factory=dict)
    line: Optional[int] = None  # of its header in pyproject.toml, when found


@dataclass(frozen=True)
class ProjectConfig:
    root: Path  # the directory of pyproject.toml (the start directory when there is none)
    specs: List[Path] = field(default_factory=list)  # absolute
    raw: Dict[str, Any] = field(default_factory=dict)  # the whole [tool.graphslot] table
    path: Optional[Path] = None  # the pyproject.toml read, if any
    output_dir: Optional[str] = None  # relative to root, as written
    outputs: List[OutputConfig] = field(default_factory=list)
    import_hooks: bool = False


def find_pyproject(start_dir: Union[str, Path]) -> Optional[Path]:
    """The nearest pyproject.toml in ``start_dir`` or a parent, so a command run from a
    subdirectory of the project sees the same settings."""
    start = Path(start_dir).resolve()
    for directory in (start, *start.parents):
        candidate = directory / PYPROJECT
        if candidate.is_file():
            return candidate
    return None


# --- validation --------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """Names there must be ASCII identifiers: a look-alike letter shows as its escape."""
    return shorten(value, SHOWN, ascii_only=True)


def module_name_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be a generated module's name (None when it can)."""
    if not isinstance(name, str):
        return f"must be a string, got {_type_name(name)}"
    if not is_identifier(name):
        return f"{_shown(name)} must be a Python identifier (letters, digits, _)"
    if keyword.iskeyword(name):
        return f"{_shown(name)} is a Python keyword"
    if name.startswith("__") and name.endswith("__"):
        return f"{_shown(name)} is a dunder name (such as __init__), which graphslot does not generate"
    return None


def output_dir_problem(value: Any) -> Optional[str]:
    """Why ``value`` cannot be ``output_dir`` before looking at the disk (None when it can)."""
    if not isinstance(value, str):
        return f"must be a path (a string), got {_type_name(value)}"
    if not value.strip():
        return "must not be empty"
    if "\x00" in value or any(not c.isprintable() for c in value):
        return f"{_shown(value)} contains control characters"
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute() or PureWindowsPath(value).drive:
        return f"{_shown(value)} is absolute; it must be relative to the directory of pyproject.toml"
    return None


def path_escape(root: Path, value: str, what: str) -> Optional[str]:
    """Why ``value`` (relative to ``root``) does not name ``what`` ("a directory", "a
    file") inside the project, symbolic links followed (None when it does): nothing is
    read or written outside the project a pyproject.toml belongs to."""
    root = root.resolve()
    out = (root / value).resolve()
    if out == root or root not in out.parents:
        return (f"{_shown(value)} resolves to {out}, outside the project ({root}); it must name {what} inside "
                "the directory of pyproject.toml")
    return None


def output_dir_escape(root: Path, output_dir: str) -> Optional[str]:
    """Why ``output_dir`` (relative to ``root``) is not a directory inside the project,
    symbolic links followed (None when it is)."""
    return path_escape(root, output_dir, "a directory")


def _spec_problem(root: Optional[Path], spec: str) -> Optional[str]:
    """Why a ``specs`` entry cannot be read: absolute, or (with the project's ``root``)
    outside the project."""
    return output_dir_problem(spec) or (path_escape(root, spec, "a file") if root is not None else None)


class _Checker:
    def __init__(self, path: Optional[Path], text: str):
        self.file = pyproject_label(path)
        self.where = Locator(text)
        self.issues: List[SpecIssue] = []

    def error(self, line: Optional[int], message: str) -> None:
        self.issues.append(SpecIssue(self.file, line, message))


def _scope_hint(key: Any, keys: tuple, owner: str, where: str) -> str:
    """Why a key of the other table landed here: in TOML a table runs from its header to
    the next one, so a line written below ``[[tool.graphslot.outputs]]`` belongs to that
    entry whatever its indentation."""
    if key not in keys:
        return ""
    return (f"; '{key}' is a key of {owner}: in TOML a key belongs to the "
            f"table of the last header above it (indentation does not matter), so move `{key} = ...` {where}")


def _check_params(check: _Checker, line: Optional[int], where: str, params: Any) -> Dict[str, Any]:
    if not isinstance(params, dict):
        check.error(line, f"{where} params must be a table such as {{ dp_size = 2 }}, got {_type_name(params)}")
        return {}
    for key, value in params.items():
        if not is_identifier(key):
            check.error(line, f"{where} params: {_shown(key)} is not a param name")
        elif isinstance(value, str) and any(not c.isprintable() for c in value):
            check.error(line, f"{where} params: {key} = {_shown(value)} contains control characters")
        elif not isinstance(value, (bool, int, float, str)):
            check.error(line, f"{where} params: {key} must be a scalar (boolean, number or string), "
                              f"got {_type_name(value)}")
    return dict(params)


def _check_outputs(check: _Checker, outputs: Any) -> List[OutputConfig]:
    if not isinstance(outputs, list):
        check.error(check.where.table("outputs"), f"{TABLE} outputs must be an array of tables "
                                                   f"({OUTPUTS} entries), got {_type_name(outputs)}")
        return []
    result = []
    for i, entry in enumerate(outputs):
        where = f"{OUTPUTS} entry {i + 1}"
        header = check.where.output(i)
        if not isinstance(entry, dict):
            check.error(header, f"{where} must be a table, got {_type_name(entry)}")
            continue
        bad = False
        for key in entry:
            if key not in OUTPUT_KEYS:
                hint = did_you_mean(key, OUTPUT_KEYS)
                check.error(check.where.output(i, key), f"{where}: unknown key {_shown(key)}{hint} (allowed: "
                            f"{one_of(OUTPUT_KEYS)})" + ("" if hint else _scope_hint(
                                key, TABLE_KEYS, TABLE, f"above the first {OUTPUTS} header, under {TABLE}")))
                bad = True
        missing = [k for k in ("module", "spec") if k not in entry]
        if missing:
            check.error(header, f"{where}: needs 'module' and 'spec' keys (missing: {', '.join(missing)})")
            continue
        problem = module_name_problem(entry["module"])
        if problem:
            check.error(check.where.output(i, "module"), f"{where}: module {problem}")
            bad = True
        for key in ("spec", "preset"):
            value = entry.get(key)
            if value is None and key == "preset":
                continue
            if not isinstance(value, str) or not value.strip():
                check.error(check.where.output(i, key), f"{where}: {key} must be a non-empty string, "
                                                        f"got {_type_name(value)}")
                bad = True
            elif any(not c.isprintable() for c in value):
                check.error(check.where.output(i, key), f"{where}: {key} {_shown(value)} contains control "
                                                        "characters")
                bad = True
        before = len(check.issues)
        params = _check_params(check, check.where.output(i, "params"), where, entry.get("params", {}))
        if bad or len(check.issues) > before:
            continue
        result.append(OutputConfig(entry["module"], entry["spec"], entry.get("preset"), params, header))
    uses = Counter(o.module for o in result)
    for name in sorted(n for n, count in uses.items() if count > 1):
        line = next(o.line for o in result if o.module == name)
        check.error(line, f"{TABLE} outputs: module name used twice: {name}")
    return result


def validate_table(table: Any, text: str = "", path: Optional[Path] = None) -> Dict[str, Any]:
    """Check a ``[tool.graphslot]`` table; its validated fields, or a ProjectConfigError
    listing every problem (``text``, the file's text, gives the lines)."""
    check = _Checker(path, text)
    if not isinstance(table, dict):
        check.error(None, f"{TABLE} must be a table, got {_type_name(table)}")
        raise ProjectConfigError(check.issues)
    for key in table:
        if key not in TABLE_KEYS:
            hint = did_you_mean(key, TABLE_KEYS)
            check.error(check.where.table(key) or check.where.table(), f"{TABLE}: unknown key {_shown(key)}{hint} "
                        f"(allowed: {one_of(TABLE_KEYS)})" + ("" if hint else _scope_hint(
                            key, OUTPUT_KEYS, OUTPUTS, f"into a {OUTPUTS} entry (one per generated module)")))
    specs = table.get("specs", [])
    if not isinstance(specs, list) or not all(isinstance(s, str) and s.strip() for s in specs):
        check.error(check.where.table("specs"), f"{TABLE} specs must be a list of paths (strings), "
                                                f"got {_shown(specs)}")
        specs = []
    elif any(not c.isprintable() for s in specs for c in s):
        check.error(check.where.table("specs"), f"{TABLE} specs: a path contains control characters")
        specs = []
    else:
        for spec in specs:
            problem = _spec_problem(None if path is None else path.parent, spec)
            if problem:
                check.error(check.where.table("specs"), f"{TABLE} specs: {problem}")
    output_dir = table.get("output_dir")
    if output_dir is not None:
        problem = output_dir_problem(output_dir)
        if problem:
            check.error(check.where.table("output_dir"), f"{TABLE} output_dir {problem}")
            output_dir = None
    import_hooks = table.get("import_hooks", False)
    if not isinstance(import_hooks, bool):
        check.error(check.where.table("import_hooks"), f"{TABLE} import_hooks must be true or false, "
                                                       f"got {_type_name(import_hooks)}")
        import_hooks = False
    outputs = _check_outputs(check, table.get("outputs", []))
    if check.issues:
        raise ProjectConfigError(check.issues)
    return {"specs": specs, "output_dir": output_dir, "outputs": outputs, "import_hooks": import_hooks}


# --- reading -----------------------------------------------------------------------------

def parse_pyproject(path: Path, data: bytes) -> ProjectConfig:
    """The settings in ``data``, the bytes of the pyproject.toml at ``path``."""
    text, document = read_toml(path, data)

    def error(line: Optional[int], message: str) -> ProjectConfigError:
        return ProjectConfigError([SpecIssue(pyproject_label(path), line, message)])

    tool = document.get("tool", {})
    if not isinstance(tool, dict):
        raise error(None, "[tool] must be a table")
    if "graphslot" not in tool:
        return ProjectConfig(root=path.parent, path=path)
    fields = validate_table(tool["graphslot"], text, path)
    root = path.parent
    if fields["output_dir"] is not None:
        problem = output_dir_escape(root, fields["output_dir"])
        if problem:
            raise error(Locator(text).table("output_dir"), f"{TABLE} output_dir {problem}")
    return ProjectConfig(root=root, specs=[(root / s).resolve() for s in fields["specs"]],
                         raw=dict(tool["graphslot"]), path=path, output_dir=fields["output_dir"],
                         outputs=fields["outputs"], import_hooks=fields["import_hooks"])


def load_project_config(start_dir: Union[str, Path] = ".") -> ProjectConfig:
    """The settings of the project around ``start_dir``; empty without a pyproject or table."""
    path = find_pyproject(start_dir)
    if path is None:
        return ProjectConfig(root=Path(start_dir).resolve())
    return parse_pyproject(path, read_pyproject(path))
