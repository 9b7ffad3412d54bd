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
``pyproject.toml:LINE`` (found by scanning the text: tomllib reports no locations),
and every string it holds is treated as untrusted text.
"""

from __future__ import annotations

import keyword
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from .errors import SpecIssue, did_you_mean, one_of

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib  # type: ignore[no-redef]

PYPROJECT = "pyproject.toml"
TABLE = "[tool.graphslot]"
OUTPUTS = "[[tool.graphslot.outputs]]"
TABLE_KEYS = ("specs", "output_dir", "outputs", "import_hooks")
OUTPUT_KEYS = ("module", "spec", "preset", "params")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ProjectConfigError(ValueError):
    """pyproject.toml cannot be read, or its ``[tool.graphslot]`` table is malformed.

    ``str(err)`` is one ``pyproject.toml:LINE: message`` line per problem (the line
    left out where it cannot be found); ``issues`` holds them as :class:`SpecIssue`.
    """

    def __init__(self, issues: Union[str, Sequence[SpecIssue]]):
        if isinstance(issues, str):
            issues = [SpecIssue(PYPROJECT, None, issues)]
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


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


def display_path(path: Optional[Path]) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    if path is None:
        return PYPROJECT
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)
    return str(path) if relative.startswith("..") else relative


# --- locations ---------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]*?)\s*\]\]?\s*(#.*)?$")


def _header_name(line: str) -> Optional[str]:
    match = _HEADER.match(line)
    if not match:
        return None
    return re.sub(r"\s*\.\s*", ".", match.group(1)).replace('"', "").replace("'", "")


class Locator:
    """Line numbers of keys in the text of a pyproject.toml, found by scanning it.

    Only the common layouts are understood (``[tool.graphslot]`` and
    ``[[tool.graphslot.outputs]]`` headers, ``key = ...`` lines under them); anything
    else gives ``None`` and the error names the file alone.
    """

    def __init__(self, text: str):
        self.lines = text.splitlines()

    def _sections(self, name: str) -> List[int]:
        return [i for i, line in enumerate(self.lines) if _header_name(line) == name]

    def _key_in(self, start: Optional[int], key: str) -> Optional[int]:
        if start is None:
            return None
        pattern = re.compile(r"^\s*(?:" + re.escape(key) + r"|\"" + re.escape(key) + r"\"|'" + re.escape(key)
                             + r"')\s*=")
        for i in range(start + 1, len(self.lines)):
            if _header_name(self.lines[i]) is not None:
                break
            if pattern.match(self.lines[i]):
                return i + 1
        return None

    def table(self, key: Optional[str] = None) -> Optional[int]:
        sections = self._sections("tool.graphslot")
        start = sections[0] if sections else None
        if key is None:
            return None if start is None else start + 1
        return self._key_in(start, key)

    def output(self, index: int, key: Optional[str] = None) -> Optional[int]:
        sections = self._sections("tool.graphslot.outputs")
        if index >= len(sections):
            return self.table("outputs") if key is None else None
        if key is None:
            return sections[index] + 1
        return self._key_in(sections[index], key) or sections[index] + 1


# --- validation --------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """An untrusted value, for a message: repr'd (one line, escapes shown) and short."""
    text = ascii(value)
    return text if len(text) <= 60 else text[:57] + "..."


def module_name_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be a generated module's name (None when it can)."""
    if not isinstance(name, str):
        return f"must be a string, got {_type_name(name)}"
    if not _IDENTIFIER.fullmatch(name):
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


def output_dir_escape(root: Path, output_dir: str) -> Optional[str]:
    """Why ``output_dir`` (relative to ``root``) is not a directory inside the project,
    symbolic links followed (None when it is)."""
    root = root.resolve()
    out = (root / output_dir).resolve()
    if out == root or root not in out.parents:
        return (f"{_shown(output_dir)} resolves to {out}, outside the project ({root}); it must name a "
                "directory inside the directory of pyproject.toml")
    return None


class _Checker:
    def __init__(self, path: Optional[Path], text: str):
        self.file = display_path(path)
        self.where = Locator(text)
        self.issues: List[SpecIssue] = []

    def error(self, line: Optional[int], message: str) -> None:
        self.issues.append(SpecIssue(self.file, line, message))


def _check_params(check: _Checker, line: Optional[int], where: str, params: Any) -> Dict[str, Any]:
    if not isinstance(params, dict):
        check.error(line, f"{where} params must be a table such as {{ dp_size = 2 }}, got {_type_name(params)}")
        return {}
    for key, value in params.items():
        if not _IDENTIFIER.fullmatch(key):
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
                check.error(check.where.output(i, key), f"{where}: unknown key {_shown(key)}"
                            f"{did_you_mean(key, OUTPUT_KEYS)} (allowed: {one_of(OUTPUT_KEYS)})")
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
    names = [o.module for o in result]
    for name in sorted({n for n in names if names.count(n) > 1}):
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
            check.error(check.where.table(key) or check.where.table(), f"{TABLE}: unknown key {_shown(key)}"
                        f"{did_you_mean(key, TABLE_KEYS)} (allowed: {one_of(TABLE_KEYS)})")
    specs = table.get("specs", [])
    if not isinstance(specs, list) or not all(isinstance(s, str) and s.strip() for s in specs):
        check.error(check.where.table("specs"), f"{TABLE} specs must be a list of paths (strings), "
                                                f"got {_shown(specs)}")
        specs = []
    elif any(not c.isprintable() for s in specs for c in s):
        check.error(check.where.table("specs"), f"{TABLE} specs: a path contains control characters")
        specs = []
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


def load_project_config(start_dir: Union[str, Path] = ".") -> ProjectConfig:
    """The settings of the project around ``start_dir``; empty without a pyproject or table."""
    path = find_pyproject(start_dir)
    if path is None:
        return ProjectConfig(root=Path(start_dir).resolve())
    file = display_path(path)
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise ProjectConfigError([SpecIssue(file, None, f"cannot read: {exc.strerror or exc}")]) from None
    try:
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw_bytes[: exc.start].count(b"\n") + 1
        raise ProjectConfigError([SpecIssue(file, line, "is not valid UTF-8")]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"\(at line (\d+)", str(exc))
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise ProjectConfigError([SpecIssue(file, int(match.group(1)) if match else None,
                                            f"not valid TOML: {message}")]) from None
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise ProjectConfigError([SpecIssue(file, None, "[tool] must be a table")])
    if "graphslot" not in tool:
        return ProjectConfig(root=path.parent, path=path)
    fields = validate_table(tool["graphslot"], text, path)
    root = path.parent
    if fields["output_dir"] is not None:
        problem = output_dir_escape(root, fields["output_dir"])
        if problem:
            raise ProjectConfigError([SpecIssue(file, Locator(text).table("output_dir"),
                                                f"{TABLE} output_dir {problem}")])
    return ProjectConfig(root=root, specs=[(root / s).resolve() for s in fields["specs"]],
                         raw=dict(tool["graphslot"]), path=path, output_dir=fields["output_dir"],
                         outputs=fields["outputs"], import_hooks=fields["import_hooks"])
