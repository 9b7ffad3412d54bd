"""``graphslot generate [--check]``: the generated modules declared in pyproject.toml. Torch-free."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..spec.files import display_path
from ..spec.project import ProjectConfigError, load_project_config
from .common import Command, fail

HELP = """Write the generated fill_from/extract modules declared in pyproject.toml.

Reads [tool.graphslot] output_dir and [[tool.graphslot.outputs]] (module, spec,
optional preset and params) of the project's pyproject.toml. Files are written
atomically and only when they change; generated files no output declares are
removed. Only files inside the project are written, and only files graphslot
generated (an existing hand-written file at an output's path is an error). With
--check nothing is written: exit 1 when an output is stale, missing or orphaned,
with a unified diff and the command that fixes it. Orphaned: a file graphslot
generated (it carries the banner) that no output produces any more, in output_dir
or anywhere else in the project (an output_dir renamed: the old one's modules).

Exit status 0 when everything is (now) up to date, 1 when --check finds something
out of date or a spec or pyproject.toml has errors, 2 when there is nothing to
generate (no pyproject.toml, or it declares no outputs), as `graphslot validate`
exits 2 when there is nothing to validate.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when outputs are out of date")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .aot import PACKAGE_INIT_NAME, GenerateReport, generate

    # An invalid [tool.graphslot] table, an output_dir outside the project or an
    # existing file graphslot did not generate: ProjectConfigError, printed here as
    # `file:line: message` lines (exit 1). Spec problems (SpecError, the refused
    # generated code included) are printed the same way by main.
    try:
        config = load_project_config(Path.cwd())
        if not config.outputs:
            where = display_path(config.path) if config.path else "pyproject.toml (none found)"
            return fail("generate", f"nothing to generate: {where} declares no [[tool.graphslot.outputs]]; see "
                                    "docs/generate.md", status=2)
        text = config.path.read_text(encoding="utf-8")  # for the lines of errors in it
        report = generate(config.root, config.raw, check=args.check, text=text)
    except ProjectConfigError as exc:  # one `pyproject.toml:LINE: message` line per problem
        print(exc, file=sys.stderr)
        return 1
    modules = GenerateReport.modules
    total = f"{len(config.outputs)} generated module(s)"
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.check:
        for diff in report.diffs:
            sys.stdout.write(diff)
        for problem in report.problems:
            print(problem)
        if report.problems:
            parts = [f"{len(modules(report.outdated))} of {total}"]
            if len(modules(report.outdated)) < len(report.outdated):
                parts.append(f"the package {PACKAGE_INIT_NAME}")
            if report.orphaned:
                parts.append(f"{len(report.orphaned)} orphaned file(s)")
            print(f"out of date: {', '.join(parts)}; run `graphslot generate` and commit the result",
                  file=sys.stderr)
            return 1
        print(f"ok  {total} up to date")
        return 0
    for path in report.written:
        print(f"wrote    {display_path(path)}")
    for path in report.removed:
        print(f"removed  {display_path(path)}")
    print(f"{total}: {len(modules(report.written))} written, {len(modules(report.unchanged))} unchanged")
    return 0


COMMAND = Command("generate", HELP, add_arguments, run)
