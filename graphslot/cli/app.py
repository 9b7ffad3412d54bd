"""The ``graphslot`` command line: assembles the commands and runs one.

Each command is one module exposing ``COMMAND`` (:class:`~.common.Command`: name, help,
arguments, run); :data:`COMMANDS` lists them, and that list is the only registration.
The command modules import no torch (the ones that need it import it when they run), so
building the parser is as light as ``graphslot validate``. A command may raise
``SpecError`` or ``ProjectConfigError``: :func:`main` prints it, without a traceback,
and exits 1; argparse usage errors exit 2 (a command finding one calls
``parser.error``). A command that reads untrusted specs never ends in a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional, Sequence

from .. import __version__
from ..spec.errors import SpecError, shorten
from ..spec.project import ProjectConfigError
from . import bench, demo, generate, new_spec, plan_sizes, schema, show, validate, verify
from .common import Command

#: Every command, in the order ``graphslot --help`` lists them.
COMMANDS: Dict[str, Command] = {module.COMMAND.name: module.COMMAND for module in (
    validate, show, schema, generate, bench, demo, verify, new_spec, plan_sizes)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphslot",
                                     description="Declarative static input buffers for CUDA-graph runners.")
    parser.add_argument("--version", action="version", version=f"graphslot {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        # No abbreviations: a prefix of a flag (a removed `--mode`, say) would silently be another (`--model`).
        sub = subparsers.add_parser(command.name, help=command.summary, description=command.help,
                                    formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        command.add_arguments(sub)
        sub.set_defaults(parser=sub)
    return parser


def exit_status(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: a status, not an exit
        return exit_status(exc)
    command = COMMANDS[args.command]
    try:
        return command.run(args, args.parser)
    except SystemExit as exc:  # a usage error a command found (parser.error)
        return exit_status(exc)
    except SpecError as exc:
        print(exc, file=sys.stderr)
    except BrokenPipeError:  # `graphslot show decode | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except ModuleNotFoundError as exc:  # the runtime without torch: dtypes.TORCH_MISSING
        if exc.name != "torch":
            raise
        print(f"graphslot {args.command}: error: {exc.msg}", file=sys.stderr)
    except (ProjectConfigError, OSError) as exc:
        print(f"graphslot {args.command}: error: {exc}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the spec-reading commands never end in a traceback
        if not command.reads_specs:
            raise
        print(f"graphslot {args.command}: error: {type(exc).__name__}: {shorten(str(exc), 200, quote=False)}",
              file=sys.stderr)
    return 1
