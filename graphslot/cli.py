"""The ``graphslot`` command line.

A subcommand is one function registered with ``@subcommand("name")``: it receives its
own argparse parser (whose help is the function's docstring), adds its arguments and
returns the function that runs it, ``args -> exit status``. ``main`` builds the parser
from the registry, so adding a command touches nothing else. A runner may raise
``SpecError`` or ``ProjectConfigError``: ``main`` prints it, without a traceback, and
exits 1; argparse usage errors exit 2.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from . import __version__
from .api import build_registry
from .framework.errors import SpecError, SpecIssue
from .framework.hooks import BUILTIN_HOOKS, HOOK_SIGNATURES, is_import_reference
from .framework.loading import load_spec, shipped_spec_names, spec_path
from .framework.model import RegistrySpec
from .framework.resolve import resolve_params
from .framework.schema import schema_text
from .project import ProjectConfigError, load_project_config

Runner = Callable[[argparse.Namespace], int]
Setup = Callable[[argparse.ArgumentParser], Runner]
SUBCOMMANDS: Dict[str, Setup] = {}


def subcommand(name: str) -> Callable[[Setup], Setup]:
    def register(setup: Setup) -> Setup:
        SUBCOMMANDS[name] = setup
        return setup

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphslot", description="Declarative static input buffers for CUDA-graph runners.")
    parser.add_argument("--version", action="version", version=f"graphslot {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, setup in SUBCOMMANDS.items():
        doc = inspect.getdoc(setup) or ""
        sub = commands.add_parser(name, help=doc.split("\n")[0], description=doc,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(run=setup(sub))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: a status, not an exit
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return args.run(args)
    except SpecError as exc:
        print(exc, file=sys.stderr)
    except (ProjectConfigError, OSError) as exc:
        print(f"graphslot {args.command}: error: {exc}", file=sys.stderr)
    return 1


def display_path(path: Path) -> str:
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


# --- validate ------------------------------------------------------------------------


def default_targets() -> List[Tuple[Any, Optional[Path]]]:
    """The shipped specs, then the project's; each with the pyproject that listed it."""
    config = load_project_config(Path.cwd())
    targets: List[Tuple[Any, Optional[Path]]] = [(name, None) for name in shipped_spec_names()]
    seen = {spec_path(name).resolve() for name in shipped_spec_names()}
    for path in config.specs:
        if path not in seen:
            seen.add(path)
            targets.append((path, config.path))
    return targets


def check_target(target: Any, listed_in: Optional[Path]) -> Tuple[Optional[RegistrySpec], List[SpecIssue]]:
    if listed_in is not None and not Path(target).is_file():
        where = f"listed in {display_path(listed_in)} [tool.graphslot] specs"
        return None, [SpecIssue(display_path(target), None, f"no such spec file ({where})")]
    try:
        return load_spec(target), []
    except SpecError as exc:
        return None, exc.issues
    except (OSError, UnicodeDecodeError) as exc:
        return None, [SpecIssue(str(target), None, f"cannot read: {exc}")]


@subcommand("validate")
def setup_validate(parser: argparse.ArgumentParser) -> Runner:
    """Check spec files; print every problem as file:line: message.

    Without SPEC: the shipped specs and the files listed under [tool.graphslot] specs in
    the project's pyproject.toml (paths relative to it). Exit status 0 when every spec is
    clean, 1 otherwise.
    """
    parser.add_argument("specs", nargs="*", metavar="SPEC", help="a shipped spec name or a YAML file")

    def run(args: argparse.Namespace) -> int:
        targets = [(spec, None) for spec in args.specs] or default_targets()
        failed = errors = 0
        for target, listed_in in targets:
            spec, issues = check_target(target, listed_in)
            if spec is not None:
                print(f"ok  {spec.source} ({len(spec.slots)} slots)")
            for issue in issues:
                print(issue)
            failed, errors = failed + bool(issues), errors + len(issues)
        if failed:
            print(f"{errors} error(s) in {failed} of {len(targets)} spec file(s)", file=sys.stderr)
        return 1 if failed else 0

    return run


# --- show ----------------------------------------------------------------------------


def param_arg(text: str) -> Tuple[str, Any]:
    """``NAME=VALUE`` with VALUE read as a YAML scalar (4, int32, true)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"cannot read the value of {text!r} as a YAML scalar") from None
    if isinstance(parsed, (list, dict)):
        raise argparse.ArgumentTypeError(f"the value of {text!r} must be a scalar (a number, true/false or a name)")
    return name.strip(), parsed


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).removeprefix("torch.")


def stand_in_hooks(spec: RegistrySpec) -> Dict[str, Callable]:
    """Stand-ins for hooks an engine passes to build_registry(hooks=...): `show` only
    allocates, and the engine's hooks are not available from the command line."""
    def unused(*args):
        return None

    refs = {getattr(slot, kind) for slot in spec.slots for kind in HOOK_SIGNATURES}
    return {ref: unused for ref in refs if ref and ref not in BUILTIN_HOOKS and not is_import_reference(ref)}


def show_rows(registry) -> List[List[str]]:
    rows = []
    for slot in registry.all_slots():
        r = slot.spec
        padding = registry.spec.slot_spec(r.name).padding or "-"
        if r.pad_value is not None and r.fills_at_allocation:
            padding += f" ({format_value(r.pad_value)})"
        axis = r.axis + (f" (dim {r.slice_dim})" if r.slice_dim else "")
        device = "cpu (host)" if r.host else str(registry.device)
        nbytes = str(slot.buffer.numel() * slot.buffer.element_size()) if slot.enabled else "-"
        rows.append([r.name, str(list(r.shape)), format_value(r.dtype), axis, padding, device, nbytes,
                     "yes" if r.enabled else "no"])
    return rows


def format_table(header: List[str], rows: List[List[str]], right: Sequence[int] = ()) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@subcommand("show")
def setup_show(parser: argparse.ArgumentParser) -> Runner:
    """Print the buffers a spec allocates for a param set.

    Builds the registry as an engine would (interpreted, on the CPU) and prints each
    slot's resolved shape, dtype, axis, padding, device and size; disabled slots are
    listed with their shape and no bytes.
    """
    parser.add_argument("spec", metavar="SPEC", help="a shipped spec name or a YAML file")
    parser.add_argument("--param", action="append", type=param_arg, default=[], metavar="NAME=VALUE",
                        help="set a param; VALUE is a YAML scalar (4, int32, true); repeatable")
    parser.add_argument("--preset", metavar="NAME", help="start from one of the spec's presets")
    parser.add_argument("--max-bs", type=positive_int, default=256, metavar="N", help="batch capacity (default 256)")
    parser.add_argument("--max-num-tokens", type=positive_int, default=256, metavar="N", help="token capacity (default 256)")

    def run(args: argparse.Namespace) -> int:
        spec = load_spec(args.spec)
        overrides = dict(args.param)
        registry = build_registry(spec, args.max_bs, args.max_num_tokens, device="cpu", params=overrides,
                                  mode="interpreted", preset=args.preset, hooks=stand_in_hooks(spec))
        defaults = resolve_params(spec)
        changed = [f"{k}={format_value(v)}" for k, v in registry.params.items() if v != defaults[k]]
        print(f"{spec.name} ({spec.source}): max_bs={args.max_bs} max_num_tokens={args.max_num_tokens}"
              + (f" preset={args.preset}" if args.preset else ""))
        print(f"params: {', '.join(changed) or 'defaults'}")
        print()
        header = ["slot", "shape", "dtype", "axis", "padding", "device", "bytes", "enabled"]
        print(format_table(header, show_rows(registry), right=(6,)))
        print()
        print(f"total: {registry.nbytes} bytes ({human_bytes(registry.nbytes)}) in "
              f"{len(registry.active)} of {len(registry.all_slots())} slots enabled")
        return 0

    return run


# --- schema --------------------------------------------------------------------------


@subcommand("schema")
def setup_schema(parser: argparse.ArgumentParser) -> Runner:
    """Print the JSON Schema of the spec format, or write it with --output.

    The shipped copy is graphslot/slot_specs/graphslot.schema.json; editors with the
    YAML language server use it through the spec files' first-line comment.
    """
    parser.add_argument("--output", "-o", type=Path, metavar="PATH", help="write the schema to PATH")

    def run(args: argparse.Namespace) -> int:
        if args.output is None:
            sys.stdout.write(schema_text())
        else:
            args.output.write_text(schema_text(), encoding="utf-8")
            print(f"wrote {args.output}")
        return 0

    return run


# --- generate ------------------------------------------------------------------------


@subcommand("generate")
def setup_generate(parser: argparse.ArgumentParser) -> Runner:
    """Write the generated fill_from/extract modules declared in pyproject.toml.

    Reads [tool.graphslot] output_dir and [[tool.graphslot.outputs]] (module, spec,
    optional preset and params) of the project's pyproject.toml. Files are written
    atomically and only when they change; generated files no output declares are
    removed. With --check nothing is written: exit 1 when an output is stale, missing or
    orphaned, with a unified diff and the command that fixes it.
    """
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when outputs are out of date")

    def run(args: argparse.Namespace) -> int:
        from .codegen.aot import ConfigError, generate

        config = load_project_config(Path.cwd())
        if not config.raw.get("outputs"):
            where = display_path(config.path) if config.path else "pyproject.toml (none found)"
            print(f"graphslot generate: error: {where} declares no [[tool.graphslot.outputs]]; see README "
                  "'Generating code ahead of time'", file=sys.stderr)
            return 1
        try:
            report = generate(config.root, config.raw, check=args.check)
        except ConfigError as exc:
            print(f"graphslot generate: error: {display_path(config.path)}: {exc}", file=sys.stderr)
            return 1
        if args.check:
            for diff in report.diffs:
                sys.stdout.write(diff)
            for problem in report.problems:
                print(problem)
            if report.problems:
                print(f"{len(report.problems)} generated file(s) out of date; run `graphslot generate` "
                      "and commit the result", file=sys.stderr)
                return 1
            print(f"ok  {len(report.unchanged)} generated file(s) up to date")
            return 0
        for path in report.written:
            print(f"wrote    {display_path(path)}")
        for path in report.removed:
            print(f"removed  {display_path(path)}")
        print(f"{len(report.unchanged)} unchanged")
        return 0

    return run


# --- bench ---------------------------------------------------------------------------


@subcommand("bench")
def setup_bench(parser: argparse.ArgumentParser) -> Runner:
    """Time fill_from + extract: generated vs interpreted vs hand-written.

    Shipped decode spec, max_bs 256, raw/padded 3/4, 30/32, 200/256, all measured in one
    run; also counts the mutating ATen ops of one padded fill (on a GPU, kernel
    launches). Exit 1 when a target is missed.
    """
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--iters", type=positive_int, default=2000, help="calls per sample (default 2000)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="samples; the median is kept (default 7)")

    def run(args: argparse.Namespace) -> int:
        import json

        from .bench import format_report, run_bench

        result = run_bench(args.iters, args.repeats)
        print(json.dumps(result, indent=2) if args.json else format_report(result))
        return 0 if result["targets_met"] else 1

    return run

# --- demo ----------------------------------------------------------------------------


@subcommand("demo")
def setup_demo(parser: argparse.ArgumentParser) -> Runner:
    """Run the reference model through the graph runners and check it against eager.

    --mode decode (default): builds the tiny paged-KV model, generates the decode
    registry code, captures the decode sizes, runs a continuous-batching decode whose
    batch size changes step to step, and compares every step's logits with eager.

    --mode prefill: captures the breakable and the piecewise prefill runners per token
    bucket, runs seeded prefill batches of 1..max-bs requests with mixed prompt lengths
    (some continuing a cached prefix), and compares every batch's logits with eager.

    Exact (torch.equal) on the CPU tape, allclose on CUDA (reference/numerics.py says
    when exactness is a fair ask). Exit 1 when any step or batch differs.
    """
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                        help="what to run (default decode)")
    parser.add_argument("--registry", choices=("generated", "interpreted"), default="generated",
                        help="registry code (default generated)")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                        help="graph backend (auto: cuda on a GPU machine, else the cpu tape)")
    parser.add_argument("--steps", type=positive_int, default=300, help="decode: scheduler steps (default 300)")
    parser.add_argument("--batches", type=positive_int, default=50, help="prefill: batches (default 50)")
    parser.add_argument("--runner", choices=("all", "breakable", "piecewise"), default="all",
                        help="prefill: runner(s) to run (default: both)")
    parser.add_argument("--max-bs", type=positive_int, default=None,
                        help="largest batch size: captured (decode, default 16) or per prefill batch "
                             "(prefill, default 8)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")

    def run(args: argparse.Namespace) -> int:
        import json

        if args.mode == "prefill":
            from .demo_prefill import format_prefill_table, run_prefill_demo

            try:
                result = run_prefill_demo(batches=args.batches, backend=args.backend, mode=args.registry,
                                          max_bs=args.max_bs or 8,
                                          runners=None if args.runner == "all" else [args.runner],
                                          progress=not args.json)
            except (RuntimeError, ValueError) as exc:
                print(f"graphslot demo: error: {exc}", file=sys.stderr)
                return 1
            print(json.dumps(result, indent=2) if args.json else format_prefill_table(result))
            return 0 if result["mismatching_batches"] == 0 else 1

        from .demo import format_demo_table, run_demo

        result = run_demo(steps=args.steps, backend=args.backend, mode=args.registry, max_bs=args.max_bs or 16,
                          progress=not args.json)
        print(json.dumps(result, indent=2) if args.json else format_demo_table(result))
        return 0 if result["mismatching_steps"] == 0 else 1

    return run

if __name__ == "__main__":
    sys.exit(main())
