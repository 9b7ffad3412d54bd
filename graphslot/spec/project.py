"""A project's ``[tool.graphslot]`` table in pyproject.toml (docs/generate.md), validated as strictly as a spec:
it arrives in pull requests, so an unknown key or a wrongly typed value is an error naming ``pyproject.toml:LINE``."""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Dict, List, Mapping, Optional, Union

from .errors import SpecIssue, did_you_mean, one_of, shorten
from .names import is_identifier
from .pyproject_text import PYPROJECT, Locator, ProjectConfigError, pyproject_label, read_pyproject, read_toml

TABLE = "[tool.graphslot]"
OUTPUTS = "[[tool.graphslot.outputs]]"
TABLE_KEYS = ("specs", "output_dir", "outputs", "import_hooks")
OUTPUT_KEYS = ("module", "spec", "preset", "params")
_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array", dict: "a table"}


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
    """The nearest pyproject.toml in ``start_dir`` or a parent: a subdirectory sees the project's settings."""
    start = Path(start_dir).resolve()
    return next((d / PYPROJECT for d in (start, *start.parents) if (d / PYPROJECT).is_file()), None)


def _type_name(value: Any) -> str:
    return _TYPES.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """Names there must be ASCII identifiers: a look-alike letter shows as its escape."""
    return shorten(value, 60, ascii_only=True)


def _unprintable(text: str) -> bool:
    return any(not c.isprintable() for c in text)


def output_dir_problem(value: Any) -> Optional[str]:
    """Why ``value`` cannot be ``output_dir`` (or a ``specs`` path) before looking at the disk (None when it can)."""
    if not isinstance(value, str):
        return f"must be a path (a string), got {_type_name(value)}"
    if not value.strip():
        return "must not be empty"
    if _unprintable(value):
        return f"{_shown(value)} contains control characters"
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute() or PureWindowsPath(value).drive:
        return f"{_shown(value)} is absolute; it must be relative to the directory of pyproject.toml"
    return None


def path_escape(root: Path, value: str, what: str = "a directory") -> Optional[str]:
    """Why ``value`` (relative to ``root``) does not name ``what`` inside the project, symbolic links followed
    (None when it does): nothing is read or written outside the project a pyproject.toml belongs to."""
    root = root.resolve()
    inside = f"it must name {what} inside the directory of pyproject.toml"
    try:
        out = (root / value).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a loop, before Python 3.13
        return f"{_shown(value)} cannot be resolved (a loop of symbolic links); {inside}"
    return None if root in out.parents else f"{_shown(value)} resolves to {out}, outside the project ({root}); {inside}"


def _unknown_key(where: str, key: Any, keys: tuple, other_keys: tuple, owner: str, move: str) -> str:
    """The message for an unknown key; when it is a key of the other table, why it landed here: in TOML a table
    runs from its header to the next one, so a line below ``[[tool.graphslot.outputs]]`` belongs to that entry."""
    hint = did_you_mean(key, keys)
    message = f"{where}: unknown key {_shown(key)}{hint} (allowed: {one_of(keys)})"
    if hint or key not in other_keys:
        return message
    return (
        f"{message}; '{key}' is a key of {owner}: in TOML a key belongs to the table of the last header above it "
        f"(indentation does not matter), so move `{key} = ...` {move}"
    )


def _check_output(error, where: Locator, i: int, entry: Any) -> Optional[OutputConfig]:
    """Entry ``i`` of ``outputs``, or None after reporting its problems through ``error(line, message)``."""
    name = f"{OUTPUTS} entry {i + 1}"
    header = where.output(i)
    errors = []

    def fail(key: Optional[str], message: str) -> None:
        errors.append(message)
        error(where.output(i, key) if key else header, f"{name}{message}")

    if not isinstance(entry, dict):
        return fail(None, f" must be a table, got {_type_name(entry)}")
    for key in entry:
        if key not in OUTPUT_KEYS:
            move = f"above the first {OUTPUTS} header, under {TABLE}"
            errors.append(key)
            error(where.output(i, key), _unknown_key(name, key, OUTPUT_KEYS, TABLE_KEYS, TABLE, move))
    missing = [k for k in ("module", "spec") if k not in entry]
    if missing:
        return fail(None, f": needs 'module' and 'spec' keys (missing: {', '.join(missing)})")
    module = entry["module"]
    this = f": module {_shown(entry['module'])}"
    if not isinstance(module, str):
        fail("module", f": module must be a string, got {_type_name(module)}")
    elif not is_identifier(module):
        fail("module", f"{this} must be a Python identifier (letters, digits, _)")
    elif keyword.iskeyword(module):
        fail("module", f"{this} is a Python keyword")
    elif module.startswith("__") and module.endswith("__"):
        fail("module", f"{this} is a dunder name (such as __init__), which graphslot does not generate")
    for key in ("spec", "preset") if entry.get("preset") is not None else ("spec",):
        value = entry[key]
        if not isinstance(value, str) or not value.strip():
            fail(key, f": {key} must be a non-empty string, got {_type_name(value)}")
        elif _unprintable(value):
            fail(key, f": {key} {_shown(value)} contains control characters")
    params = entry.get("params", {})
    if not isinstance(params, dict):
        fail("params", f" params must be a table such as {{ dp_size = 2 }}, got {_type_name(params)}")
    for key, value in params.items() if isinstance(params, dict) else ():
        if not is_identifier(key):
            fail("params", f" params: {_shown(key)} is not a param name")
        elif isinstance(value, str) and _unprintable(value):
            fail("params", f" params: {key} = {_shown(value)} contains control characters")
        elif not isinstance(value, (bool, int, float, str)):
            fail("params", f" params: {key} must be a scalar (boolean, number or string), got {_type_name(value)}")
    return None if errors else OutputConfig(module, entry["spec"], entry.get("preset"), dict(params), header)


def validate_table(table: Any, text: str = "", path: Optional[Path] = None) -> Dict[str, Any]:
    """Check a ``[tool.graphslot]`` table: its validated fields, or a ProjectConfigError listing every problem
    (``text``, the file's text, gives the lines)."""
    where = Locator(text)
    issues = []

    def error(line: Optional[int], message: str) -> None:
        issues.append(SpecIssue(pyproject_label(path), line, message))

    if not isinstance(table, dict):
        error(None, f"{TABLE} must be a table, got {_type_name(table)}")
        raise ProjectConfigError(issues)
    for key in table:
        if key not in TABLE_KEYS:
            move = f"into a {OUTPUTS} entry (one per generated module)"
            error(where.table(key) or where.table(), _unknown_key(TABLE, key, TABLE_KEYS, OUTPUT_KEYS, OUTPUTS, move))
    specs = table.get("specs", [])
    if not isinstance(specs, list) or not all(isinstance(s, str) and s.strip() for s in specs):
        error(where.table("specs"), f"{TABLE} specs must be a list of paths (strings), got {_shown(specs)}")
        specs = []
    for spec in specs:
        problem = output_dir_problem(spec) or (path and path_escape(path.parent, spec, "a file"))
        if problem:
            error(where.table("specs"), f"{TABLE} specs: {problem}")
    output_dir = table.get("output_dir")
    problem = None if output_dir is None else output_dir_problem(output_dir)
    if problem:
        error(where.table("output_dir"), f"{TABLE} output_dir {problem}")
        output_dir = None
    import_hooks = table.get("import_hooks", False)
    if not isinstance(import_hooks, bool):
        got = _type_name(import_hooks)
        error(where.table("import_hooks"), f"{TABLE} import_hooks must be true or false, got {got}")
        import_hooks = False
    outputs = table.get("outputs", [])
    if not isinstance(outputs, list):
        got = _type_name(outputs)
        error(where.table("outputs"), f"{TABLE} outputs must be an array of tables ({OUTPUTS} entries), got {got}")
        outputs = []
    outputs = [o for o in (_check_output(error, where, i, e) for i, e in enumerate(outputs)) if o is not None]
    lines: Dict[str, List[Optional[int]]] = {}  # module -> the lines of its entries (a dict keeps this linear)
    for o in outputs:
        lines.setdefault(o.module, []).append(o.line)
    for name, at in sorted(lines.items()):
        if len(at) > 1:
            error(at[0], f"{TABLE} outputs: module name used twice: {name}")
    if issues:
        raise ProjectConfigError(issues)
    return {"specs": specs, "output_dir": output_dir, "outputs": outputs, "import_hooks": import_hooks}


def parse_pyproject(path: Path, data: bytes) -> ProjectConfig:
    """The settings in ``data``, the bytes of the pyproject.toml at ``path``."""
    text, document = read_toml(path, data)
    tool = document.get("tool", {})
    root = path.parent
    file = pyproject_label(path)
    if not isinstance(tool, dict):
        raise ProjectConfigError("[tool] must be a table", None, file)
    if "graphslot" not in tool:
        return ProjectConfig(root=root, path=path)
    fields = validate_table(tool["graphslot"], text, path)
    problem = fields["output_dir"] and path_escape(root, fields["output_dir"])
    if problem:
        raise ProjectConfigError(f"{TABLE} output_dir {problem}", Locator(text).table("output_dir"), file)
    specs = [(root / s).resolve() for s in fields.pop("specs")]
    return ProjectConfig(root=root, specs=specs, raw=dict(tool["graphslot"]), path=path, **fields)


def load_project_config(start_dir: Union[str, Path] = ".") -> ProjectConfig:
    """The settings of the project around ``start_dir``; empty without a pyproject or table."""
    path = find_pyproject(start_dir)
    if path is None:
        return ProjectConfig(root=Path(start_dir).resolve())
    return parse_pyproject(path, read_pyproject(path))
