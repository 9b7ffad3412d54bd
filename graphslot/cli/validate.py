"""``graphslot validate``: check spec files, every problem as ``file:line: message``. Torch-free."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..spec.errors import SpecError, SpecIssue, shorten
from ..spec.files import display_path
from ..spec.loading import load_spec, shipped_spec_names, shipped_spec_path
from ..spec.model import RegistrySpec
from ..spec.project import ProjectConfig, load_project_config
from .common import (Command, add_spec_reading_options, fail, hook_import_path, import_hooks_wanted,
                     unchecked_hook_imports)

HELP = """Check spec files; print every problem as file:line: message.

Without SPEC: the files listed under [tool.graphslot] specs in the project's
pyproject.toml (paths relative to it); with --shipped, graphslot's shipped specs
too. Exit status 0 when every spec is clean, 1 otherwise, 2 when there is nothing
to validate.
"""


def default_targets(config: ProjectConfig, shipped: bool = False) -> List[Tuple[Any, Optional[Path]]]:
    """The project's specs (with the pyproject that listed them), after the shipped
    specs with ``shipped``; graphslot's own pyproject lists the shipped ones."""
    shipped_paths = [shipped_spec_path(name).resolve() for name in shipped_spec_names()] if shipped else []
    targets: List[Tuple[Any, Optional[Path]]] = [(path, None) for path in shipped_paths]
    seen = set(shipped_paths)
    for path in config.specs:
        if path not in seen:
            seen.add(path)
            targets.append((path, config.path))
    return targets


def check_target(target: Any, listed_in: Optional[Path], import_hooks: bool = False,
                 max_bytes: Optional[int] = None) -> Tuple[Optional[RegistrySpec], List[SpecIssue]]:
    """Load one spec; whatever goes wrong comes back as issues, never as an exception."""
    if listed_in is not None and not Path(target).is_file():
        where = f"listed in {display_path(listed_in)} [tool.graphslot] specs"
        return None, [SpecIssue(display_path(target), None, f"no such spec file ({where})")]
    try:
        return load_spec(target, import_hooks=import_hooks, max_bytes=max_bytes), []
    except SpecError as exc:
        return None, exc.issues
    except OSError as exc:
        return None, [SpecIssue(str(target), None, f"cannot read: {shorten(str(exc), 200, quote=False)}")]
    except Exception as exc:  # noqa: BLE001 - one bad file must not hide the others
        return None, [SpecIssue(str(target), None, f"internal error while checking the spec: "
                                                   f"{type(exc).__name__}: {shorten(str(exc), 200, quote=False)}")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="*", metavar="SPEC", help="a shipped spec name or a YAML file")
    parser.add_argument("--shipped", action="store_true",
                        help="also validate the specs shipped with graphslot (" + ", ".join(shipped_spec_names()) + ")")
    add_spec_reading_options(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.specs:
        targets = default_targets(ProjectConfig(root=Path.cwd()), args.shipped)
        targets += [(spec, None) for spec in args.specs]
    else:
        config = load_project_config(Path.cwd())
        targets = default_targets(config, args.shipped)
        if not targets:
            where = (f"{display_path(config.path)} lists no [tool.graphslot] specs" if config.path
                     else "no pyproject.toml found")
            return fail("validate", f"nothing to validate ({where}): pass spec files, list them under "
                                    "[tool.graphslot] specs in pyproject.toml, or pass --shipped for the specs "
                                    "shipped with graphslot", status=2)
    import_hooks = import_hooks_wanted(args, strict=not args.specs)
    failed = errors = 0
    for target, listed_in in targets:
        with hook_import_path(import_hooks):
            spec, issues = check_target(target, listed_in, import_hooks, args.max_bytes)
        if spec is not None:
            note = ""
            unchecked = 0 if import_hooks else unchecked_hook_imports(spec)
            if unchecked:
                note = f"; {unchecked} hook import{'s' if unchecked > 1 else ''} not checked: pass --import-hooks"
            print(f"ok  {spec.path} ({len(spec.slots)} slots{note})")
        for issue in issues:
            print(issue)
        failed = failed + bool(issues)
        errors = errors + len(issues)
    if failed:
        print(f"{errors} error(s) in {failed} of {len(targets)} spec file(s)", file=sys.stderr)
    return 1 if failed else 0


COMMAND = Command("validate", HELP, add_arguments, run, reads_specs=True)
