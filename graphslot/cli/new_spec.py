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

This module is the command (its arguments, the plan, the writes, what it prints); the
text edit of pyproject.toml is :mod:`graphslot.cli.pyproject_edit`, the atomic writes
and the lock :mod:`graphslot.spec.files`. Torch-free.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import yaml

from .._version import __version__
from ..spec.errors import SpecError, did_you_mean, one_of, shorten
from ..spec.files import LockTimeout, create_file, display_path, locked_file, write_atomic
from ..spec.loading import SHIPPED_DIR, parse_spec, shipped_spec_names
from ..spec.names import IDENTIFIER_CHARS, is_identifier
from ..spec.project import TABLE, ProjectConfig, find_pyproject, parse_pyproject
from .pyproject_edit import CannotEdit, pyproject_with_entry, toml_string
from ..spec.pyproject_text import PYPROJECT, ProjectConfigError, lines_with_offsets, read_pyproject
from .common import Command

HELP = """Start a spec of your own from a shipped one and list it in pyproject.toml.

Copies the shipped spec (--from decode or prefill; comments kept, one line added
saying where it came from) to PATH, a new .yaml/.yml file inside the project, and
appends PATH (relative to pyproject.toml) to [tool.graphslot] specs, so `graphslot
validate` checks it. The project is the directory of the pyproject.toml found from
the current directory; without one, a minimal pyproject.toml is created here.
pyproject.toml is edited as text, keeping its layout and comments, and only when the
result reads as the same document plus the new path; otherwise it is left alone and
the line to add by hand is shown. Never overwrites a file, never writes outside the
project. Prints the next steps, with an [[tool.graphslot.outputs]] entry to add.
"""

PROG = "graphslot new-spec"
SPEC_SUFFIXES = (".yaml", ".yml")
MODELINE = "# yaml-language-server:"
SCHEMA_FILE = "graphslot.schema.json"
# Longest a run waits for another to finish editing pyproject.toml.
LOCK_WAIT_S = 30.0
# Longest untrusted value a message shows.
SHOWN = 200


class NewSpecError(Exception):
    """Why the command stops; ``str()`` is one line (printed after ``graphslot new-spec: error:``)."""


# --- arguments -------------------------------------------------------------------------


def shipped_spec_arg(text: str) -> str:
    """``--from``: a shipped spec's name; a wrong one gets a "did you mean"."""
    names = shipped_spec_names()
    if text in names:
        return text
    raise argparse.ArgumentTypeError(f"no shipped spec {shorten(text, SHOWN)}{did_you_mean(text, names)} "
                                     f"(shipped specs: {one_of(names)})")


def spec_name_arg(text: str) -> str:
    """``--name``: the new spec's ``name:``, an identifier (generated module names use it)."""
    if not is_identifier(text):
        raise argparse.ArgumentTypeError(f"{shorten(text, SHOWN)} is not an identifier (letters, digits, '_'; not "
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


def _name_comment(line: str) -> Optional[str]:
    """For a top-level ``name: identifier`` line (``line`` without its newline), the
    comment after the name with the spaces before it ("" when none); else None."""
    if not line.startswith("name:") or "\r" in line:
        return None
    value = line[5:].lstrip(" \t")
    after = value.lstrip(IDENTIFIER_CHARS)
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
    lines = [(offset, line, comment) for offset, line in lines_with_offsets(text)
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
        parsed = parse_spec(text, path=label)
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
    shown = shorten(raw, SHOWN)
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
        raise NewSpecError(f"cannot create {shown}: {display_path(ancestor, cwd)} is not a directory")
    lexical = Path(os.path.normpath(joined))
    if root in lexical.parents and lexical.resolve() == resolved:
        entry = lexical.relative_to(root).as_posix()  # as typed, when that is the same file
    else:
        entry = resolved.relative_to(root).as_posix()
    if any(not c.isprintable() for c in entry):
        raise NewSpecError(f"the spec's path {shorten(entry, SHOWN)} contains control characters")
    return resolved, entry


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
    plan.config = config
    plan.old_pyproject = data
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
    text = spec_text(source, name, display_path(path, cwd))
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
        raise NewSpecError(f"{display_path(parent, plan.cwd)} changed while graphslot was writing; nothing written")
    try:
        create_file(plan.spec_path, plan.spec_text)
    except FileExistsError:
        raise NewSpecError(f"{shorten(display_path(plan.spec_path, plan.cwd), SHOWN)} already exists; refusing to "
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
        write_atomic(path, plan.new_pyproject, mode=stat.S_IMODE(os.stat(path).st_mode))  # keeps its mode
    return None


def register(plan: Plan) -> Optional[str]:
    """Write pyproject.toml as planned; why it was not written, or None (with
    ``plan.already_listed`` when, re-read, it listed the spec already)."""
    if plan.register_problem is not None:
        return plan.register_problem
    try:
        if not plan.pyproject_exists:
            try:
                create_file(plan.pyproject, plan.new_pyproject)
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
    module = base
    n = 2
    while module in taken:
        module = f"{base}_{n}"
        n = n + 1
    return module


def next_steps(plan: Plan) -> List[str]:
    shown = display_path(plan.spec_path, plan.cwd)
    lines = ["", "next:", f"  1. edit {shown} (the format: slot_specs/README.md in the graphslot package)"]
    schema = plan.spec_path.parent / SCHEMA_FILE
    if f"$schema={SCHEMA_FILE}" in plan.spec_text.partition("\n")[0] and not os.path.lexists(schema):
        lines.append(f"     for completion in your editor: graphslot schema --output {display_path(schema, plan.cwd)}")
    lines += ["  2. graphslot validate",
              f"  3. to generate its code, add an output to {display_path(plan.pyproject, plan.cwd)} "
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
    shown = display_path(plan.spec_path, plan.cwd)
    pyproject = display_path(plan.pyproject, plan.cwd)
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
        print(f"{PROG}: error: {shown} was created, but {pyproject} was left unchanged ({problem}); "
              f"add the path by hand under {TABLE}: {hand_edit_line(plan)}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``graphslot new-spec``: every failure is one ``graphslot new-spec: error:`` line
    per problem on stderr and exit 1, never a traceback."""
    try:
        return new_spec(args.source, args.destination, args.name, Path.cwd())
    except NewSpecError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
    except ProjectConfigError as exc:  # what `graphslot validate` says, one line per problem
        for issue in exc.issues:
            print(f"{PROG}: error: {issue}", file=sys.stderr)
    except OSError as exc:
        where = f"{shorten(os.fsdecode(exc.filename), SHOWN, quote=False)}: " if exc.filename else ""
        print(f"{PROG}: error: {where}{exc.strerror or exc}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - never a traceback
        print(f"{PROG}: error: internal error: {type(exc).__name__}: {shorten(str(exc), SHOWN, quote=False)}",
              file=sys.stderr)
    return 1


COMMAND = Command("new-spec", HELP, add_arguments, run)
