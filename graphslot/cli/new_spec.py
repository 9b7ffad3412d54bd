"""``graphslot new-spec --from decode specs/decode.yaml``: start a spec of your own from
a shipped one and list it under ``[tool.graphslot] specs`` in the project's pyproject.toml.

The shipped spec's text is copied byte for byte (comments included) after one comment
line naming where it came from; ``--name`` rewrites its ``name:`` line, and the result
is re-read to check that nothing else changed. The project root is the directory of the
pyproject.toml found from the current directory (the current directory when there is
none, and a minimal pyproject.toml is created there).

Safety, as for ``graphslot generate``: nothing is written outside the project root
(symbolic links followed), no existing file is overwritten, every write is atomic
(a temporary file, then a rename or a hard link), new files get the umask's mode and
pyproject.toml keeps its own. There is no TOML writer, so pyproject.toml is edited as
text, minimally (the user's layout and comments are kept), and the edit is accepted
only when the edited text parses to the old document plus the new path at the end of
``specs``; otherwise pyproject.toml is left alone and the user is shown the line to add.
The edit holds an exclusive lock on pyproject.toml from reading it to replacing it and
is planned again on what it holds then, so concurrent runs each land their entry.

Everything here is torch-free and plain functions; ``graphslot.cli.app`` registers the
command.
"""

from __future__ import annotations

import argparse
import copy
import os
import stat
import string
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import yaml

from .._version import __version__
from ..spec.checks import is_identifier
from ..spec.errors import SpecError, did_you_mean, one_of, shorten
from ..spec.loading import SHIPPED_DIR, parse_spec, shipped_spec_names
from ..spec.project import (PYPROJECT, TABLE, ProjectConfig, ProjectConfigError, find_pyproject, line_key,
                                 parse_pyproject, read_pyproject, table_header, validate_table)

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

COMMAND = "graphslot new-spec"
SPEC_SUFFIXES = (".yaml", ".yml")
MODELINE = "# yaml-language-server:"
SCHEMA_FILE = "graphslot.schema.json"
# Longest a run waits for another to finish editing pyproject.toml.
LOCK_WAIT_S = 30.0


class NewSpecError(Exception):
    """Why the command stops; ``str()`` is one line (printed after ``graphslot new-spec: error:``)."""


class CannotEdit(Exception):
    """pyproject.toml cannot be edited safely; ``str()`` says why (one line)."""


def _shown(value: str) -> str:
    """An untrusted string for a message: quoted, control characters escaped, short."""
    return shorten(value, 200)


def _display(path: Path, cwd: Path) -> str:
    """``path`` relative to ``cwd`` when inside it (what the user would type), else absolute."""
    try:
        relative = os.path.relpath(path, cwd)
    except ValueError:  # another drive
        return str(path)
    return str(path) if relative.startswith("..") else relative


# --- arguments -------------------------------------------------------------------------


def shipped_spec_arg(text: str) -> str:
    """``--from``: a shipped spec's name; a wrong one gets a "did you mean"."""
    names = shipped_spec_names()
    if text in names:
        return text
    raise argparse.ArgumentTypeError(f"no shipped spec {_shown(text)}{did_you_mean(text, names)} "
                                     f"(shipped specs: {one_of(names)})")


def spec_name_arg(text: str) -> str:
    """``--name``: the new spec's ``name:``, an identifier (generated module names use it)."""
    if not is_identifier(text):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not an identifier (letters, digits, '_'; not "
                                         "starting with a digit): generated module names are made from it")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True, type=shipped_spec_arg, metavar="SHIPPED",
                        help=f"the shipped spec to start from ({one_of(shipped_spec_names())})")
    parser.add_argument("--name", type=spec_name_arg, metavar="NAME",
                        help="set the new spec's name: (default: keep the shipped spec's name)")
    parser.add_argument("destination", metavar="PATH",
                        help="the new spec file (.yaml or .yml), inside the project; it must not exist")


# --- the spec text ---------------------------------------------------------------------


def shipped_text(source: str) -> str:
    """The shipped spec's text, exactly as shipped."""
    return (SHIPPED_DIR / f"{source}.yaml").read_bytes().decode("utf-8")


def provenance_line(source: str) -> str:
    return f"# Started from the shipped '{source}' spec of graphslot {__version__} (graphslot new-spec).\n"


def with_provenance(text: str, source: str) -> str:
    """``text`` with the provenance comment inserted: after a leading yaml-language-server
    modeline (which stays the first line), else first."""
    first, sep, rest = text.partition("\n")
    if first.startswith(MODELINE) and sep:
        return first + sep + provenance_line(source) + rest
    return provenance_line(source) + text


_IDENTIFIER_CHARS = string.ascii_letters + string.digits + "_"


def _name_comment(line: str) -> Optional[str]:
    """For a top-level ``name: identifier`` line (``line`` without its newline), the
    comment after the name with the spaces before it ("" when none); else None."""
    if not line.startswith("name:") or "\r" in line:
        return None
    value = line[5:].lstrip(" \t")
    after = value.lstrip(_IDENTIFIER_CHARS)
    name = value[:len(value) - len(after)]
    if len(value) == len(line) - 5 or not name or name[0].isdigit():
        return None
    rest = after.lstrip(" \t")
    if not rest:
        return ""
    return after if rest.startswith("#") and rest != after else None


def renamed(text: str, name: str) -> str:
    """``text`` with its top-level ``name:`` set to ``name``: the one ``name: identifier``
    line at column 0 is rewritten, and the result must read as the same mapping with
    only ``name`` changed (NewSpecError otherwise)."""
    lines = [(offset, line, comment) for offset, line in _lines(text)
             if (comment := _name_comment(line)) is not None]
    if len(lines) != 1:
        raise NewSpecError("cannot set the spec's name safely (no single 'name: ...' line); "
                           "leave out --name and edit the name: line by hand")
    value = name
    if yaml.safe_load(f"v: {name}") != {"v": name}:  # yes, no, on, null, true...: quote them
        value = f"'{name}'"
    offset, line, comment = lines[0]
    new = text[:offset] + f"name: {value}{comment}" + text[offset + len(line):]
    expected = yaml.safe_load(text)
    if isinstance(expected, dict):
        expected["name"] = name
    if not isinstance(expected, dict) or yaml.safe_load(new) != expected:
        raise NewSpecError("cannot set the spec's name safely; leave out --name and edit the name: line by hand")
    return new


def spec_text(source: str, name: Optional[str], label: str) -> str:
    """The new spec's text, checked as ``graphslot validate`` checks it."""
    text = with_provenance(shipped_text(source), source)
    if name is not None:
        text = renamed(text, name)
    try:
        parsed = parse_spec(text, source=label)
    except SpecError as exc:  # a shipped spec always validates: only a broken install gets here
        raise NewSpecError(f"the new spec would not validate: {exc.issues[0]}") from None
    if name is not None and parsed.name != name:
        raise NewSpecError("cannot set the spec's name safely; leave out --name and edit the name: line by hand")
    return text


# --- the destination -------------------------------------------------------------------


def destination(raw: str, root: Path, cwd: Path, has_pyproject: bool) -> Tuple[Path, str]:
    """``(path, entry)``: where the spec goes (absolute, symbolic links resolved) and its
    ``specs`` entry (relative to ``root``, POSIX). NewSpecError unless it is a new
    .yaml/.yml file inside ``root``."""
    shown = _shown(raw)
    if not raw.strip():
        raise NewSpecError("the spec's path is empty")
    if any(not c.isprintable() for c in raw):
        raise NewSpecError(f"the spec's path {shown} contains control characters")
    given = Path(raw)
    if given.suffix.lower() not in SPEC_SUFFIXES:
        raise NewSpecError(f"{shown}: a spec file's name must end in .yaml or .yml")
    root = root.resolve()
    joined = cwd / given
    resolved = joined.resolve()
    if root not in resolved.parents:
        where = ("the directory of pyproject.toml" if has_pyproject
                 else "the current directory: no pyproject.toml was found")
        raise NewSpecError(f"{shown} resolves to {resolved}, outside the project {root} ({where}); "
                           "the spec must go inside it")
    if os.path.lexists(joined) or os.path.lexists(resolved):
        raise NewSpecError(f"{shown} already exists; refusing to overwrite it (choose another path, or move "
                           "the file away first)")
    ancestor = resolved.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NewSpecError(f"cannot create {shown}: {_display(ancestor, cwd)} is not a directory")
    lexical = Path(os.path.normpath(joined))
    if root in lexical.parents and lexical.resolve() == resolved:
        entry = lexical.relative_to(root).as_posix()  # as typed, when that is the same file
    else:
        entry = resolved.relative_to(root).as_posix()
    if any(not c.isprintable() for c in entry):
        raise NewSpecError(f"the spec's path {_shown(entry)} contains control characters")
    return resolved, entry


# --- pyproject.toml, edited as text -----------------------------------------------------


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (control characters were refused before)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lines(text: str) -> List[Tuple[int, str]]:
    """``(offset, line)`` for every line, the line without its newline (nor a CR before it)."""
    result, offset = [], 0
    for line in text.split("\n"):
        result.append((offset, line.removesuffix("\r")))
        offset += len(line) + 1
    return result


def _indent(line: str) -> str:
    """The spaces and tabs ``line`` starts with."""
    return line[:len(line) - len(line.lstrip(" \t"))]


def _skip_blank(text: str, i: int) -> int:
    """Past whitespace, newlines and comments."""
    while i < len(text):
        if text[i] in " \t\r\n":
            i += 1
        elif text[i] == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        else:
            break
    return i


def _string_end(text: str, i: int) -> int:
    """The offset just past the TOML string starting at ``text[i]`` (a quote)."""
    quote = text[i]
    multi = text.startswith(quote * 3, i)
    j = i + (3 if multi else 1)
    while j < len(text):
        c = text[j]
        if c == "\\" and quote == '"':
            j += 2
            continue
        if c == "\n" and not multi:
            break
        if c == quote:
            if not multi:
                return j + 1
            if text.startswith(quote * 3, j):
                k = j
                while k < len(text) and text[k] == quote and k - j < 5:  # """"" ends with 2 quotes inside
                    k += 1
                return k
        j += 1
    raise CannotEdit("a string in its specs array does not end")


@dataclass
class ArrayLayout:
    open: int  # offset of [
    close: int  # offset of ]
    elements: List[Tuple[int, int]] = field(default_factory=list)  # (start, end) of each string
    comma: Optional[int] = None  # offset of a comma after the last element


def scan_array(text: str, i: int) -> ArrayLayout:
    """The layout of the array of strings starting at ``text[i]`` (``[``)."""
    layout = ArrayLayout(open=i, close=-1)
    i += 1
    while True:
        i = _skip_blank(text, i)
        if i >= len(text):
            raise CannotEdit("its specs array does not end")
        c = text[i]
        if c == "]":
            layout.close = i
            return layout
        if c == "," and layout.elements and layout.comma is None:
            layout.comma, i = i, i + 1
        elif c in "\"'" and (not layout.elements or layout.comma is not None):
            end = _string_end(text, i)
            layout.elements.append((i, end))
            layout.comma, i = None, end
        else:
            raise CannotEdit("its specs array is not a plain list of strings")


def _indent_of(text: str, pos: int) -> Optional[str]:
    """The whitespace before ``pos`` on its line, when only whitespace precedes it."""
    start = text.rfind("\n", 0, pos) + 1
    before = text[start:pos]
    return before if not before.strip() else None


def _insert_into_array(text: str, layout: ArrayLayout, item: str, key_indent: str, nl: str) -> str:
    close_line = text.rfind("\n", 0, layout.close) + 1
    multi_line = close_line > layout.open and not text[close_line:layout.close].strip()
    if multi_line:  # ] on a line of its own: the new entry goes on a new line above it
        indent = None
        for start, _ in (layout.elements[-1:] + layout.elements[:1]):
            indent = _indent_of(text, start)
            if indent is not None:
                break
        if indent is None:
            inside = [line for _, line in _lines(text[layout.open:close_line])[1:] if line.strip()]
            indent = _indent(inside[-1]) if inside else key_indent + "    "
        trailing = layout.comma is not None or not layout.elements
        new_line = indent + item + ("," if trailing else "") + nl
        text = text[:close_line] + new_line + text[close_line:]
        if layout.elements and layout.comma is None:
            end = layout.elements[-1][1]
            text = text[:end] + "," + text[end:]
        return text
    if not layout.elements:
        if text[layout.open + 1:layout.close].strip():
            raise CannotEdit("its specs array is not a plain list of strings")
        return text[:layout.open + 1] + item + text[layout.close:]
    if layout.comma is None:
        end = layout.elements[-1][1]
        return text[:end] + ", " + item + text[end:]
    return text[:layout.comma + 1] + " " + item + "," + text[layout.comma + 1:]


def add_spec_entry(text: str, entry: str) -> str:
    """``text`` (a pyproject.toml) with ``entry`` appended to ``[tool.graphslot] specs``:
    into the existing array, as a new ``specs`` key under the table's header, or as a
    new table. Only the text around the insertion changes; the result is not verified
    here (see :func:`verify_addition`). CannotEdit where the layout is not one handled."""
    nl = "\r\n" if "\r\n" in text else "\n"
    item = toml_string(entry)
    lines = _lines(text)
    headers = [(n, table_header(line)) for n, (_, line) in enumerate(lines)]
    headers = [(n, h) for n, h in headers if h is not None]
    table = [n for n, (is_array, name) in headers if name == "tool.graphslot" and not is_array]
    if not table:
        block = f"[tool.graphslot]{nl}specs = [{item}]{nl}"
        outputs = [n for n, (is_array, name) in headers if name == "tool.graphslot.outputs" and is_array]
        if outputs:  # before the first output entry and the comment lines right above it
            n = outputs[0]
            while n > 0 and lines[n - 1][1].lstrip().startswith("#"):
                n -= 1
            offset = lines[n][0]
            return text[:offset] + block + nl + text[offset:]
        if text and not text.endswith("\n"):
            text += nl
        if text.strip() and not text.endswith(nl + nl):
            text += nl
        return text + block
    start = table[0]
    end = next((n for n, _ in headers if n > start), len(lines))
    for n in range(start + 1, end):
        offset, line = lines[n]
        key = line_key(line)
        if key is not None and key[0] == "specs":
            value = offset + key[1]
            if not text.startswith("[", value):
                raise CannotEdit("its specs value is not written as an array [...]")
            layout = scan_array(text, value)
            return _insert_into_array(text, layout, item, _indent(line), nl)
    if start + 1 >= len(lines):  # the header is the last line and has no newline
        return text + nl + f"specs = [{item}]{nl}"
    offset = lines[start + 1][0]
    return text[:offset] + f"specs = [{item}]{nl}" + text[offset:]


def _parsed(text: str) -> Dict[str, Any]:
    # Floats as their text: a nan anywhere must not make two equal documents differ.
    return tomllib.loads(text, parse_float=str)


def verify_addition(old_text: str, new_text: str, entry: str) -> None:
    """CannotEdit unless ``new_text`` parses to ``old_text``'s document with ``entry``
    appended to ``[tool.graphslot] specs`` (created if need be) and nothing else."""
    try:
        new = _parsed(new_text)
    except tomllib.TOMLDecodeError:
        raise CannotEdit("its layout is not one graphslot can edit safely (the edit would not be "
                         "valid TOML)") from None
    expected = copy.deepcopy(_parsed(old_text))
    tool = expected.setdefault("tool", {})
    table = tool.setdefault("graphslot", {}) if isinstance(tool, dict) else None
    if not isinstance(table, dict):
        raise CannotEdit(f"its {TABLE} is not a table")
    specs = table.get("specs", [])
    table["specs"] = (list(specs) if isinstance(specs, list) else [specs]) + [entry]
    if new != expected:
        raise CannotEdit("its layout is not one graphslot can edit safely (the edit would change more "
                          "than the specs list)")
    validate_table(new["tool"]["graphslot"], new_text)


def pyproject_with_entry(old_text: str, entry: str) -> str:
    """The edited, verified text (CannotEdit otherwise)."""
    new_text = add_spec_entry(old_text, entry)
    verify_addition(old_text, new_text, entry)
    return new_text


# --- writing ---------------------------------------------------------------------------


def _temporary(path: Path, data: bytes, mode: int) -> str:
    """A temporary file next to ``path`` holding ``data`` with ``mode``; its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def create_file(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data`` in one step, never replacing an existing file
    (FileExistsError): readers see no file or the whole one. Mode: the umask's."""
    from ..codegen.aot import _file_mode

    tmp = _temporary(path, data, _file_mode())
    try:
        try:
            os.link(tmp, path)  # atomic, and fails when path exists
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links
            if os.path.lexists(path):
                raise FileExistsError(f"{path} exists") from None
            os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` in one rename, keeping its permission bits."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    tmp = _temporary(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class LockTimeout(Exception):
    """Another process held the lock on pyproject.toml for longer than LOCK_WAIT_S."""


@contextmanager
def locked_file(path: Path, wait_s: float) -> Iterator[None]:
    """Hold an exclusive advisory lock (``flock``) on the file ``path`` names.

    Every ``new-spec`` takes it around its read-check-replace of pyproject.toml, so
    concurrent runs edit one after another and none loses another's entry. Replacing
    the file makes a new file, so once the lock is taken ``path`` must still name the
    locked file, else the lock is taken again on the new one. LockTimeout after
    ``wait_s`` seconds. Without ``fcntl`` (Windows) nothing is locked and an edit
    relies on the re-read alone.
    """
    deadline = time.monotonic() + wait_s
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        fd = os.open(path, flags)
        try:
            while fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LockTimeout() from None
                    time.sleep(0.005)
            held, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                yield
                return
        finally:
            os.close(fd)  # releases the lock
        if time.monotonic() > deadline:
            raise LockTimeout()


# --- the command -----------------------------------------------------------------------


@dataclass
class Plan:
    """What ``new-spec`` will do, all checked before anything is written."""

    root: Path
    cwd: Path
    spec_path: Path  # absolute, resolved
    entry: str  # its [tool.graphslot] specs entry
    spec_text: str
    spec_name: str
    source: str
    config: ProjectConfig
    pyproject: Path  # the file read, or the one to create
    pyproject_exists: bool
    old_pyproject: Optional[bytes] = None
    new_pyproject: Optional[str] = None  # None: nothing to write
    already_listed: bool = False
    register_problem: Optional[str] = None  # why pyproject.toml is left alone


SYMLINK = "it is a symbolic link, and graphslot does not write through links"


def plan_edit(plan: Plan, data: bytes, config: ProjectConfig) -> None:
    """Set what :func:`register` writes when pyproject.toml holds ``data`` (b"": none),
    which reads as ``config``."""
    plan.config, plan.old_pyproject = config, data
    plan.new_pyproject = plan.register_problem = None
    plan.already_listed = any(listed == plan.spec_path for listed in config.specs)
    if plan.already_listed:
        return
    try:
        plan.new_pyproject = pyproject_with_entry(data.decode("utf-8"), plan.entry)
    except CannotEdit as exc:
        plan.register_problem = str(exc)
    except ProjectConfigError as exc:
        plan.register_problem = f"the edited table would not be valid: {exc.issues[0].message}"


def plan_new_spec(source: str, raw_destination: str, name: Optional[str], cwd: Path) -> Plan:
    """Check everything; NewSpecError or ProjectConfigError (the messages
    ``graphslot validate`` gives) when the command cannot go ahead."""
    cwd = cwd.resolve()
    pyproject = find_pyproject(cwd)
    data = b"" if pyproject is None else read_pyproject(pyproject)
    # A bad pyproject.toml: ProjectConfigError.
    config = ProjectConfig(root=cwd) if pyproject is None else parse_pyproject(pyproject, data)
    root = pyproject.parent if pyproject is not None else cwd
    path, entry = destination(raw_destination, root, cwd, pyproject is not None)
    text = spec_text(source, name, _display(path, cwd))
    plan = Plan(root=root, cwd=cwd, spec_path=path, entry=entry, spec_text=text, spec_name=name or source,
                source=source, config=config, pyproject=pyproject or root / PYPROJECT,
                pyproject_exists=pyproject is not None)
    plan_edit(plan, data, config)
    if not plan.already_listed and pyproject is not None and pyproject.is_symlink():
        plan.register_problem = SYMLINK
    return plan


def write_spec(plan: Plan) -> None:
    parent = plan.spec_path.parent
    parent.mkdir(parents=True, exist_ok=True)
    if parent.resolve() != parent or plan.root not in plan.spec_path.parents:  # swapped for a link meanwhile
        raise NewSpecError(f"{_display(parent, plan.cwd)} changed while graphslot was writing; nothing written")
    try:
        create_file(plan.spec_path, plan.spec_text.encode("utf-8"))
    except FileExistsError:
        raise NewSpecError(f"{_shown(_display(plan.spec_path, plan.cwd))} already exists; refusing to "
                           "overwrite it") from None


def _edit_locked(plan: Plan) -> Optional[str]:
    """Under the lock: re-read pyproject.toml; when it changed since it was planned
    (another run added its spec), plan the edit again on what it holds now; replace it."""
    path = plan.pyproject
    with locked_file(path, LOCK_WAIT_S):
        try:
            data = read_pyproject(path)
            if data != plan.old_pyproject:
                plan_edit(plan, data, parse_pyproject(path, data))
        except ProjectConfigError as exc:
            return f"it changed while graphslot was editing it and is no longer valid ({exc.issues[0]})"
        if plan.already_listed or plan.register_problem is not None:
            return plan.register_problem
        replace_file(path, plan.new_pyproject.encode("utf-8"))
    return None


def register(plan: Plan) -> Optional[str]:
    """Write pyproject.toml as planned; why it was not written, or None (with
    ``plan.already_listed`` when, re-read, it listed the spec already)."""
    if plan.register_problem is not None:
        return plan.register_problem
    try:
        if not plan.pyproject_exists:
            try:
                create_file(plan.pyproject, plan.new_pyproject.encode("utf-8"))
                return None
            except FileExistsError:  # another run created it meanwhile: add the entry to that one
                plan.pyproject_exists = True
        if plan.pyproject.is_symlink():
            return SYMLINK
        return _edit_locked(plan)
    except LockTimeout:
        return f"another process held its lock for over {LOCK_WAIT_S:g} s"
    except OSError as exc:
        return f"cannot write it: {exc.strerror or exc}"


def suggested_module(plan: Plan) -> str:
    taken = {output.module for output in plan.config.outputs}
    base = f"{plan.spec_name}_default"
    module, n = base, 2
    while module in taken:
        module, n = f"{base}_{n}", n + 1
    return module


def next_steps(plan: Plan) -> List[str]:
    shown = _display(plan.spec_path, plan.cwd)
    lines = ["", "next:", f"  1. edit {shown} (the format: slot_specs/README.md in the graphslot package)"]
    schema = plan.spec_path.parent / SCHEMA_FILE
    if f"$schema={SCHEMA_FILE}" in plan.spec_text.partition("\n")[0] and not os.path.lexists(schema):
        lines.append(f"     for completion in your editor: graphslot schema --output {_display(schema, plan.cwd)}")
    lines += ["  2. graphslot validate",
              f"  3. to generate its code, add an output to {_display(plan.pyproject, plan.cwd)} "
              "and run graphslot generate:",
              "",
              "       [[tool.graphslot.outputs]]",
              f"       module = {toml_string(suggested_module(plan))}",
              f"       spec = {toml_string(plan.entry)}"]
    if plan.config.output_dir is None:
        lines += ["", f"     and, under {TABLE}, where generated modules go:",
                  '       output_dir = "mypackage/generated"']
    return lines


def hand_edit_line(plan: Plan) -> str:
    specs = plan.config.raw.get("specs")
    return f"specs = [..., {toml_string(plan.entry)}]" if specs else f"specs = [{toml_string(plan.entry)}]"


def new_spec(source: str, raw_destination: str, name: Optional[str], cwd: Path) -> int:
    """The command: plan, write the spec, register it, print what was done and what next."""
    plan = plan_new_spec(source, raw_destination, name, cwd)
    write_spec(plan)
    shown = _display(plan.spec_path, plan.cwd)
    pyproject = _display(plan.pyproject, plan.cwd)
    print(f"created  {shown} (from the shipped '{source}' spec of graphslot {__version__})")
    problem = None if plan.already_listed else register(plan)
    if problem is None and plan.already_listed:
        print(f"listed   {toml_string(plan.entry)} is already in {TABLE} specs of {pyproject}; left as it is")
    elif problem is None and plan.pyproject_exists:
        print(f"added    {toml_string(plan.entry)} to {TABLE} specs in {pyproject}")
    elif problem is None:
        print(f"created  {pyproject} with {TABLE} specs = [{toml_string(plan.entry)}]")
    for line in next_steps(plan):
        print(line)
    if problem is not None:
        sys.stdout.flush()
        print(f"{COMMAND}: error: {shown} was created, but {pyproject} was left unchanged ({problem}); "
              f"add the path by hand under {TABLE}: {hand_edit_line(plan)}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """``graphslot new-spec``: every failure is one ``graphslot new-spec: error:`` line
    per problem on stderr and exit 1, never a traceback."""
    try:
        return new_spec(args.source, args.destination, args.name, Path.cwd())
    except NewSpecError as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
    except ProjectConfigError as exc:  # what `graphslot validate` says, one line per problem
        for issue in exc.issues:
            print(f"{COMMAND}: error: {issue}", file=sys.stderr)
    except OSError as exc:
        where = f"{shorten(os.fsdecode(exc.filename), 200, quote=False)}: " if exc.filename else ""
        print(f"{COMMAND}: error: {where}{exc.strerror or exc}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - never a traceback
        print(f"{COMMAND}: error: internal error: {type(exc).__name__}: {shorten(str(exc), 200, quote=False)}",
              file=sys.stderr)
    return 1
