"""What every command shares, defined once: how a command is declared (:class:`Command`),
argument types, the spec-reading options, tables and value formatting, and the one-line
error every failure prints. Torch-free.
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Sequence, Tuple

import yaml

from ..spec.budget import human_bytes
from ..spec.checks import DEFAULT_MAX_BYTES
from ..spec.errors import shorten
from ..spec.hooks import HOOK_SIGNATURES, is_import_reference
from ..spec.model import RegistrySpec
from ..spec.names import is_identifier
from ..spec.project import ProjectConfigError, find_pyproject, load_project_config

__all__ = ["Command", "add_spec_reading_options", "fail", "format_table", "format_value", "human_bytes",
           "hook_import_path", "import_hooks_wanted", "json_value", "metric_table", "non_negative_int", "param_arg",
           "positive_int", "seed_int", "unchecked_hook_imports"]

Run = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


@dataclass(frozen=True)
class Command:
    """One ``graphslot`` command: each command module defines ``COMMAND``, and
    :mod:`.app` lists them; nothing else registers a command.

    ``help``'s first line is the summary in ``graphslot --help``; all of it is the
    command's ``--help`` description. ``run(args, parser)`` returns the exit status and
    calls ``parser.error`` for a usage error (exit 2). ``reads_specs``: the command reads
    untrusted specs, so any failure is a message and exit 1, never a traceback.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Run
    reads_specs: bool = False

    @property
    def summary(self) -> str:
        return self.help.strip().split("\n")[0]


def fail(command: str, message: str, status: int = 1) -> int:
    """Print ``graphslot COMMAND: error: MESSAGE`` (one line) on stderr; ``status``."""
    print(f"graphslot {command}: error: {message}", file=sys.stderr)
    return status


# --- argument types ------------------------------------------------------------------------


def positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or not 1 <= int(text) < 2**63:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {shorten(text)}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {shorten(text)}")
    return int(text)


#: The largest seed ``torch.manual_seed`` takes (an unsigned 64-bit integer).
MAX_SEED = 2**64 - 1


def seed_int(text: str) -> int:
    """A seed torch and ``random`` both take: 0 to 2**64-1."""
    if not (text.isascii() and text.isdigit()) or len(text) > 20 or int(text) > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**64-1 (what torch.manual_seed takes), "
                                         f"got {shorten(text)}")
    return int(text)


def param_arg(text: str) -> Tuple[str, Any]:
    """``--param NAME=VALUE`` with VALUE read as a YAML scalar (4, int32, true)."""
    name, sep, value = text.partition("=")
    if not sep or not is_identifier(name.strip()):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {shorten(text)}")
    try:
        parsed = yaml.safe_load(value)
    except (yaml.YAMLError, ValueError):
        raise argparse.ArgumentTypeError(f"cannot read the value of {shorten(text)} as a YAML scalar") from None
    if isinstance(parsed, (list, dict)):
        raise argparse.ArgumentTypeError(f"the value of {shorten(text)} must be a scalar "
                                         "(a number, true/false or a name)")
    return name.strip(), parsed


# --- reading specs -------------------------------------------------------------------------


def add_spec_reading_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--import-hooks", action="store_true",
                        help="import 'module:function' hooks and check their signatures (runs that code; "
                             "also: import_hooks = true under [tool.graphslot]); off, only their form is checked")
    parser.add_argument("--max-bytes", type=non_negative_int, default=DEFAULT_MAX_BYTES, metavar="N",
                        help="largest total of bytes a spec may declare at max_bs = max_num_tokens = 256, "
                             f"under its defaults and every preset (default {DEFAULT_MAX_BYTES})")


def import_hooks_wanted(args: argparse.Namespace, strict: bool = True) -> bool:
    """--import-hooks, or ``import_hooks = true`` in the project's [tool.graphslot].

    ``strict=False``: an unreadable pyproject.toml means no (the safe answer) instead of
    an error, for commands that do not otherwise need the project's configuration.
    """
    if args.import_hooks:
        return True
    try:
        config = load_project_config(Path.cwd())
    except ProjectConfigError:
        if strict:
            raise
        return False
    return bool(getattr(config, "import_hooks", False))


@contextmanager
def hook_import_path(enabled: bool = True) -> Iterator[None]:
    """While hooks are imported, the project root -- the directory of the pyproject.toml
    found from the working directory (else the working directory) -- comes first on
    ``sys.path``, so ``myengine.hooks:fn`` imports as the project's own code imports it,
    whether graphslot runs as ``graphslot`` (whose script directory is ``sys.path[0]``),
    from a subdirectory or from pre-commit. ``sys.path`` is restored after."""
    if not enabled:
        yield
        return
    pyproject = find_pyproject(Path.cwd())
    root = str((pyproject.parent if pyproject else Path.cwd()).resolve())
    before = list(sys.path)
    sys.path.insert(0, root)
    try:
        yield
    finally:
        sys.path[:] = before


def unchecked_hook_imports(spec: RegistrySpec) -> int:
    """Distinct ``module:function`` hook references (imported only with --import-hooks)."""
    return len({ref for slot in spec.slots for kind in HOOK_SIGNATURES
                if (ref := getattr(slot, kind)) and is_import_reference(ref)})


# --- output --------------------------------------------------------------------------------


def format_table(header: List[str], rows: List[List[str]], right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; the columns in ``right`` right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def metric_table(rows: List[Tuple[str, str]]) -> str:
    """A two-column "metric  value" table."""
    width = max(len(r[0]) for r in rows + [("metric", "")])
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 5}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def format_value(value: Any) -> str:
    """A param or pad value as a table shows it (``true``, ``int64``, ``-1``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).removeprefix("torch.")


def json_value(value: Any) -> Any:
    """A param or pad value as JSON: numbers and booleans as they are, anything else
    (a dtype name, inf, nan) as the text the table shows."""
    if isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return None if value is None else format_value(value)
