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
and every string it holds is treated as untrusted text: the file is read up to
MAX_PYPROJECT_BYTES, every scan of its text is linear in its length, and what would make
the TOML parser superlinear (a key of more than MAX_KEY_PARTS dotted parts) or overflow
its recursion is an error with the line.
"""

from __future__ import annotations

import keyword
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

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
# Largest pyproject.toml read (a real one is a few KiB).
MAX_PYPROJECT_BYTES = 1 << 20
# Most parts a dotted key may have (``a.b.c`` has 3; see long_key_line).
MAX_KEY_PARTS = 128


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
#
# pyproject.toml is untrusted text, so every scan of it is linear in its length: string
# methods, and regular expressions whose repeated parts cannot match the same text two
# ways (overlapping quantifiers backtrack polynomially: the old header pattern took two
# minutes on a line of "[" and 4 KB of spaces).

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def table_header(line: str) -> Optional[Tuple[bool, str]]:
    """``(is_array, dotted name)`` of a table header line such as ``[tool.graphslot]`` or
    ``[[ tool . "graphslot" . outputs ]]  # comment`` (quotes dropped, spaces around dots
    removed); None for any other line. ``line`` holds no newline."""
    body = line.strip(" \t")
    if not body.startswith("["):
        return None
    is_array = body.startswith("[[")
    body = body[2 if is_array else 1:]
    close = body.find("]")
    if close < 0:
        return None
    name, rest = body[:close], body[close + 1:]
    if is_array:
        if not rest.startswith("]"):
            return None
        rest = rest[1:]
    rest = rest.lstrip(" \t")
    if rest and not rest.startswith("#"):
        return None
    name = ".".join(part.strip(" \t") for part in name.split("."))
    return is_array, name.replace('"', "").replace("'", "")


def line_key(line: str) -> Optional[Tuple[str, int]]:
    """``(key, offset of the value)`` of a ``key = value`` line whose key is one bare or
    quoted part (``specs = [...]``, ``"specs" = [...]``); None for any other line. The
    offset is past the ``=`` and the spaces after it."""
    stripped = line.lstrip(" \t")
    if stripped[:1] in ("'", '"'):
        end = stripped.find(stripped[0], 1)
        if end < 0:
            return None
        key, rest = stripped[1:end], stripped[end + 1:]
    else:
        match = _BARE_KEY.match(stripped)
        if match is None:
            return None
        key, rest = match.group(0), stripped[match.end():]
    rest = rest.lstrip(" \t")
    if not rest.startswith("="):
        return None
    return key, len(line) - len(rest[1:].lstrip(" \t"))


class Locator:
    """Line numbers of keys in the text of a pyproject.toml, found by scanning it.

    Only the common layouts are understood (``[tool.graphslot]`` and
    ``[[tool.graphslot.outputs]]`` headers, ``key = ...`` lines under them); anything
    else gives ``None`` and the error names the file alone. The text is scanned once,
    on the first question, into an index: any number of questions stays linear.
    """

    def __init__(self, text: str):
        self.text = text

    @cached_property
    def _index(self) -> Tuple[Dict[str, List[int]], Dict[int, Dict[str, int]]]:
        """(header name -> its 0-based lines, header line -> {key: 1-based line under it})."""
        sections: Dict[str, List[int]] = {}
        keys: Dict[int, Dict[str, int]] = {}
        current: Optional[Dict[str, int]] = None
        for i, line in enumerate(self.text.splitlines()):
            header = table_header(line)
            if header is not None:
                sections.setdefault(header[1], []).append(i)
                current = keys[i] = {}
            elif current is not None:
                found = line_key(line)
                if found is not None:
                    current.setdefault(found[0], i + 1)
        return sections, keys

    def _sections(self, name: str) -> List[int]:
        return self._index[0].get(name, [])

    def _key_in(self, start: Optional[int], key: str) -> Optional[int]:
        return None if start is None else self._index[1][start].get(key)

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


# --- reading -----------------------------------------------------------------------------

_SPACES = re.compile(r"[ \t]*")
_KEY_PART = re.compile(r"""[A-Za-z0-9_-]+|"[^"\\]*(?:\\.[^"\\]*)*"|'[^']*'""")  # bare, "basic", 'literal'
_KEY_STARTS = re.compile(r"[{,]")


def _key_parts(line: str, i: int) -> int:
    """The parts of the dotted key at ``line[i:]`` (0: no key there), counted up to one
    more than MAX_KEY_PARTS."""
    parts = 0
    while parts <= MAX_KEY_PARTS:
        part = _KEY_PART.match(line, _SPACES.match(line, i).end())
        if part is None:
            return parts
        parts += 1
        i = _SPACES.match(line, part.end()).end()
        if not line.startswith(".", i):
            return parts
        i += 1
    return parts


def long_key_line(text: str) -> Optional[int]:
    """The first line (1-based) where a key of more than MAX_KEY_PARTS dotted parts may
    start, else None. tomllib takes time and memory quadratic in the parts of a key (a
    160 KB line of ``a.a.a…= 1`` exhausts memory), so the text is checked before it is
    parsed: at the start of each line (after ``[`` or ``[[``) and after each ``{`` and
    ``,``, wherever TOML can have a key. A line with fewer dots holds no such key."""
    for number, line in enumerate(text.split("\n"), 1):
        if line.count(".") < MAX_KEY_PARTS:
            continue
        first = _SPACES.match(line).end()
        first += 2 if line.startswith("[[", first) else 1 if line.startswith("[", first) else 0
        starts = [first] + [m.end() for m in _KEY_STARTS.finditer(line)]
        if any(_key_parts(line, i) > MAX_KEY_PARTS for i in starts):
            return number
    return None


def _toml_error(exc: Exception) -> Tuple[Optional[int], str]:
    """(line, message) of a TOMLDecodeError, whose text ends in "(at line L, column C)"."""
    message, sep, where = str(exc).rpartition(" (at line ")
    if not sep:
        return None, str(exc)
    line = where.partition(",")[0]
    return (int(line) if line.isdigit() else None), message


def read_pyproject(path: Path) -> bytes:
    """The bytes of ``path``, at most MAX_PYPROJECT_BYTES (ProjectConfigError otherwise)."""
    file = display_path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PYPROJECT_BYTES + 1)
    except OSError as exc:
        raise ProjectConfigError([SpecIssue(file, None, f"cannot read: {exc.strerror or exc}")]) from None
    if len(data) > MAX_PYPROJECT_BYTES:
        raise ProjectConfigError([SpecIssue(file, None, f"the file is larger than {MAX_PYPROJECT_BYTES} bytes; "
                                                        "a pyproject.toml is a few KiB")])
    return data


def parse_pyproject(path: Path, data: bytes) -> ProjectConfig:
    """The settings in ``data``, the bytes of the pyproject.toml at ``path``."""
    file = display_path(path)

    def error(line: Optional[int], message: str) -> ProjectConfigError:
        return ProjectConfigError([SpecIssue(file, line, message)])

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(data.count(b"\n", 0, exc.start) + 1, "is not valid UTF-8") from None
    if text.startswith("\ufeff"):
        # YAML allows a byte-order mark (a spec may start with one); TOML does not, and
        # tomllib, which pip and build read pyproject.toml with, refuses it.
        raise error(1, "starts with a UTF-8 byte-order mark, which TOML does not allow (tomllib, and so pip, "
                       "refuse it); save it without one")
    long_key = long_key_line(text)
    if long_key is not None:
        raise error(long_key, f"a dotted key of more than {MAX_KEY_PARTS} parts: TOML parsers take time and "
                              "memory quadratic in them, so graphslot does not read the file")
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, message = _toml_error(exc)
        raise error(line, f"not valid TOML: {message}") from None
    except RecursionError:
        raise error(None, "not valid TOML: arrays or inline tables nested too deeply") from None
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
