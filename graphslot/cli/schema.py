"""``graphslot schema``: the JSON Schema of the spec format. Torch-free."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..spec.files import write_atomic
from ..spec.schema import schema_text
from .common import Command

HELP = """Print the JSON Schema of the spec format, or write it with --output.

The shipped copy is graphslot/slot_specs/graphslot.schema.json; editors with the
YAML language server use it through the spec files' first-line comment.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", type=Path, metavar="PATH", help="write the schema to PATH")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.output is None:
        sys.stdout.write(schema_text())
        return 0
    try:
        write_atomic(args.output, schema_text())
    except OSError as exc:
        print(f"{args.output}: cannot write: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


COMMAND = Command("schema", HELP, add_arguments, run, reads_specs=True)
