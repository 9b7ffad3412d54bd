"""The ``graphslot`` command line.

A subcommand is one function registered with ``@subcommand("name")``: it receives its
own argparse parser (whose help is the function's docstring), adds its arguments and
returns the function that runs it, ``args -> exit status``. ``main`` builds the parser
from the registry, so adding a command touches nothing else. A runner may raise
``SpecError`` or ``ProjectConfigError``: ``main`` prints it, without a traceback, and
exits 1; argparse usage errors exit 2 (a runner finding one calls ``parser.error``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from .. import __version__
from ..spec.dtypes import import_torch
from ..spec.checks import DEFAULT_MAX_BYTES
from ..spec.errors import SpecError, SpecIssue, shorten
from ..spec.hooks import HOOK_SIGNATURES, is_import_reference
from ..spec.loading import load_spec, shipped_spec_names, spec_path
from ..spec.model import RegistrySpec
from ..spec.resolve import ResolvedSlot, resolve_params, resolve_slots
from ..spec.schema import schema_text
from ..spec.project import ProjectConfig, ProjectConfigError, display_path, load_project_config

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


def exit_status(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: a status, not an exit
        return exit_status(exc)
    try:
        return args.run(args)
    except SystemExit as exc:  # a usage error a runner found (parser.error)
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
        if args.command not in SPEC_READING_COMMANDS:
            raise
        print(f"graphslot {args.command}: error: {type(exc).__name__}: {shorten(str(exc), 200, quote=False)}",
              file=sys.stderr)
    return 1


# Commands that read untrusted spec files: every failure is a message and exit 1.
SPEC_READING_COMMANDS = ("validate", "show", "schema")


# --- validate ------------------------------------------------------------------------


def default_targets(config: ProjectConfig, shipped: bool = False) -> List[Tuple[Any, Optional[Path]]]:
    """The project's specs (with the pyproject that listed them), after the shipped
    specs with ``shipped``; graphslot's own pyproject lists the shipped ones."""
    targets: List[Tuple[Any, Optional[Path]]] = [(name, None) for name in shipped_spec_names()] if shipped else []
    seen = {spec_path(name).resolve() for name in shipped_spec_names()} if shipped else set()
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


def unchecked_hook_imports(spec: RegistrySpec) -> int:
    """Distinct ``module:function`` hook references (imported only with --import-hooks)."""
    return len({ref for slot in spec.slots for kind in HOOK_SIGNATURES
                if (ref := getattr(slot, kind)) and is_import_reference(ref)})


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


def add_spec_reading_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--import-hooks", action="store_true",
                        help="import 'module:function' hooks and check their signatures (runs that code; "
                             "also: import_hooks = true under [tool.graphslot]); off, only their form is checked")
    parser.add_argument("--max-bytes", type=non_negative_int, default=DEFAULT_MAX_BYTES, metavar="N",
                        help="largest total of bytes a spec may declare at max_bs = max_num_tokens = 256, "
                             f"under its defaults and every preset (default {DEFAULT_MAX_BYTES})")


@subcommand("validate")
def setup_validate(parser: argparse.ArgumentParser) -> Runner:
    """Check spec files; print every problem as file:line: message.

    Without SPEC: the files listed under [tool.graphslot] specs in the project's
    pyproject.toml (paths relative to it); with --shipped, graphslot's shipped specs
    too. Exit status 0 when every spec is clean, 1 otherwise, 2 when there is nothing
    to validate.
    """
    parser.add_argument("specs", nargs="*", metavar="SPEC", help="a shipped spec name or a YAML file")
    parser.add_argument("--shipped", action="store_true",
                        help="also validate the specs shipped with graphslot (" + ", ".join(shipped_spec_names()) + ")")
    add_spec_reading_options(parser)

    def run(args: argparse.Namespace) -> int:
        if args.specs:
            targets = default_targets(ProjectConfig(root=Path.cwd()), args.shipped)
            targets += [(spec, None) for spec in args.specs]
        else:
            config = load_project_config(Path.cwd())
            targets = default_targets(config, args.shipped)
            if not targets:
                where = (f"{display_path(config.path)} lists no [tool.graphslot] specs" if config.path
                         else "no pyproject.toml found")
                print(f"graphslot validate: error: nothing to validate ({where}): pass spec files, list them "
                      "under [tool.graphslot] specs in pyproject.toml, or pass --shipped for the specs shipped "
                      "with graphslot", file=sys.stderr)
                return 2
        import_hooks = import_hooks_wanted(args, strict=not args.specs)
        failed = errors = 0
        for target, listed_in in targets:
            spec, issues = check_target(target, listed_in, import_hooks, args.max_bytes)
            if spec is not None:
                note = ""
                unchecked = 0 if import_hooks else unchecked_hook_imports(spec)
                if unchecked:
                    note = (f"; {unchecked} hook import{'s' if unchecked > 1 else ''} not checked: "
                            "pass --import-hooks")
                print(f"ok  {spec.source} ({len(spec.slots)} slots{note})")
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
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {shorten(text)}")
    try:
        parsed = yaml.safe_load(value)
    except (yaml.YAMLError, ValueError):
        raise argparse.ArgumentTypeError(f"cannot read the value of {shorten(text)} as a YAML scalar") from None
    if isinstance(parsed, (list, dict)):
        raise argparse.ArgumentTypeError(f"the value of {shorten(text)} must be a scalar "
                                         "(a number, true/false or a name)")
    return name.strip(), parsed


def positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or not 1 <= int(text) < 2**63:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {shorten(text)}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {shorten(text)}")
    return int(text)


def human_bytes(n: float) -> str:
    if n >= 1 << 60:  # beyond any machine; floats may not even hold it
        return f"about 2**{int(n).bit_length() - 1} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).removeprefix("torch.")


def slot_bytes(r: ResolvedSlot) -> int:
    """The bytes a resolved slot's buffer takes, computed (nothing is allocated)."""
    numel = 1
    for extent in r.shape:
        numel *= extent
    return numel * r.dtype_name.itemsize


def json_value(value: Any) -> Any:
    """A param or pad value as JSON: numbers and booleans as they are, anything else
    (a dtype name, inf, nan) as the text the table shows."""
    if isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return None if value is None else format_value(value)


def show_json(spec: RegistrySpec, resolved: Sequence[ResolvedSlot], params: Dict[str, Any],
              changed: Sequence[str], args: argparse.Namespace, unchecked: int) -> Dict[str, Any]:
    """What ``show`` prints as a table, as one JSON object."""
    slots = [{
        "name": r.name, "shape": list(r.shape), "dtype": str(r.dtype_name), "axis": r.axis,
        "slice_dim": r.slice_dim, "padding": slot.padding,
        "pad_value": json_value(r.pad_value) if r.fills_at_allocation else None,
        "device": "cpu", "host": r.host,
        "bytes": slot_bytes(r) if r.enabled else None, "enabled": r.enabled,
    } for slot, r in zip(spec.slots, resolved)]
    enabled = [r for r in resolved if r.enabled]
    return {"spec": spec.name, "source": spec.source, "max_bs": args.max_bs, "max_num_tokens": args.max_num_tokens,
            "preset": args.preset, "params": {k: json_value(v) for k, v in params.items()},
            "changed_params": {k: json_value(params[k]) for k in changed}, "slots": slots, "total_bytes": sum(slot_bytes(r) for r in enabled),
            "enabled_slots": len(enabled), "unchecked_hook_imports": unchecked}


def show_rows(spec: RegistrySpec, resolved: Sequence[ResolvedSlot], device: str = "cpu") -> List[List[str]]:
    rows = []
    for slot, r in zip(spec.slots, resolved):  # resolve_slots keeps spec order
        padding = slot.padding or "-"
        if r.pad_value is not None and r.fills_at_allocation:
            padding += f" ({format_value(r.pad_value)})"
        axis = r.axis + (f" (dim {r.slice_dim})" if r.slice_dim else "")
        host = "cpu (host)" if r.host else device
        nbytes = str(slot_bytes(r)) if r.enabled else "-"
        rows.append([shorten(r.name, quote=False), str(list(r.shape)), r.dtype_name, axis, padding, host,
                     nbytes, "yes" if r.enabled else "no"])
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

    Resolves the spec for the params and capacities as build_registry would and prints
    each slot's shape, dtype, axis, padding, device and size (computed: nothing is
    allocated, and hooks are not imported unless --import-hooks); disabled slots are
    listed with their shape and no bytes. --json prints the same as one JSON object
    (notes go to stderr).
    """
    parser.add_argument("spec", metavar="SPEC", help="a shipped spec name or a YAML file")
    parser.add_argument("--param", action="append", type=param_arg, default=[], metavar="NAME=VALUE",
                        help="set a param; VALUE is a YAML scalar (4, int32, true); repeatable")
    parser.add_argument("--preset", metavar="NAME", help="start from one of the spec's presets")
    parser.add_argument("--max-bs", type=positive_int, default=256, metavar="N", help="batch capacity (default 256)")
    parser.add_argument("--max-num-tokens", type=positive_int, default=256, metavar="N", help="token capacity (default 256)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    add_spec_reading_options(parser)

    def run(args: argparse.Namespace) -> int:
        import_hooks = import_hooks_wanted(args, strict=False)
        spec = load_spec(args.spec, import_hooks=import_hooks, max_bytes=args.max_bytes)
        overrides = dict(args.param)
        params = resolve_params(spec, overrides, preset=args.preset, torch_dtypes=False)
        resolved = resolve_slots(spec, params, args.max_bs, args.max_num_tokens)
        defaults = resolve_params(spec, torch_dtypes=False)
        changed_keys = [k for k, v in params.items() if v != defaults[k]]
        unchecked = 0 if import_hooks else unchecked_hook_imports(spec)
        note = f"note: {unchecked} hook import{'s' if unchecked > 1 else ''} not checked: pass --import-hooks"
        if args.json:
            print(json.dumps(show_json(spec, resolved, params, changed_keys, args, unchecked), indent=2,
                             allow_nan=False))
            if unchecked:
                print(note, file=sys.stderr)
            return 0
        changed = [f"{k}={shorten(format_value(params[k]), quote=False)}" for k in changed_keys]
        preset = f" preset={shorten(args.preset, quote=False)}" if args.preset else ""
        print(f"{spec.name} ({spec.source}): max_bs={args.max_bs} max_num_tokens={args.max_num_tokens}{preset}")
        print(f"params: {', '.join(changed) or 'defaults'}")
        print()
        header = ["slot", "shape", "dtype", "axis", "padding", "device", "bytes", "enabled"]
        print(format_table(header, show_rows(spec, resolved), right=(6,)))
        print()
        enabled = [r for r in resolved if r.enabled]
        total = sum(slot_bytes(r) for r in enabled)
        print(f"total: {total} bytes ({human_bytes(total)}) in {len(enabled)} of {len(resolved)} slots enabled")
        if unchecked:
            print(note)
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
            return 0
        try:
            args.output.write_text(schema_text(), encoding="utf-8")
        except OSError as exc:
            print(f"{args.output}: cannot write: {exc.strerror or exc}", file=sys.stderr)
            return 1
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
    removed. Only files inside the project are written, and only files graphslot
    generated (an existing hand-written file at an output's path is an error). With
    --check nothing is written: exit 1 when an output is stale, missing or orphaned,
    with a unified diff and the command that fixes it.
    """
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when outputs are out of date")

    def run(args: argparse.Namespace) -> int:
        from ..codegen.aot import PACKAGE_INIT_NAME, GenerateReport, generate

        # An invalid [tool.graphslot] table, an output_dir outside the project or an
        # existing file graphslot did not generate: ProjectConfigError, printed here as
        # `file:line: message` lines (exit 1). Spec problems (SpecError, the refused
        # generated code included) are printed the same way by main.
        try:
            config = load_project_config(Path.cwd())
        except ProjectConfigError as exc:  # one `pyproject.toml:LINE: message` line per problem
            print(exc, file=sys.stderr)
            return 1
        if not config.outputs:
            where = display_path(config.path) if config.path else "pyproject.toml (none found)"
            print(f"graphslot generate: error: {where} declares no [[tool.graphslot.outputs]]; see README "
                  "'Generating code ahead of time'", file=sys.stderr)
            return 1
        try:
            text = config.path.read_text(encoding="utf-8")  # for the lines of errors in it
            report = generate(config.root, config.raw, check=args.check, text=text)
        except ProjectConfigError as exc:
            print(exc, file=sys.stderr)
            return 1
        modules, total = GenerateReport.modules, f"{len(config.outputs)} generated module(s)"
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

    return run


# --- bench ---------------------------------------------------------------------------


@subcommand("bench")
def setup_bench(parser: argparse.ArgumentParser) -> Runner:
    """Time fill_from + extract: generated vs interpreted vs hand-written.

    Shipped decode spec, max_bs 256, raw/padded 3/4, 30/32, 200/256, all measured in one
    run; also counts the mutating ATen ops of one padded fill (on a GPU, kernel
    launches). Progress goes to stderr (a bar on a terminal, else a line per size);
    --json keeps stdout pure JSON. Exit 1 when a target is missed.
    """
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--iters", type=positive_int, default=2000, help="calls per sample (default 2000)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="samples; the median is kept (default 7)")

    def run(args: argparse.Namespace) -> int:
        print(f"graphslot bench: fill_from + extract of the shipped decode spec, generated vs interpreted vs "
              f"hand-written, {args.repeats} repeats x {args.iters} iters per batch size", file=sys.stderr)
        import_torch()
        from .bench import format_report, run_bench

        result = run_bench(args.iters, args.repeats, progress=True)
        print(json.dumps(result, indent=2) if args.json else format_report(result))
        return 0 if result["targets_met"] else 1

    return run

# --- demo ----------------------------------------------------------------------------

#: Flags of one demo mode only, with their defaults (None in the parser: given or not).
DEMO_MODE_FLAGS = {"steps": ("decode", 300), "dp": ("decode", 1), "batches": ("prefill", 50),
                   "runner": ("prefill", "all")}
#: ``--model`` names of tiny transformers models, one per tested family (graphslot[hf]).
HF_DEMO_MODELS = ("hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3")


@subcommand("demo")
def setup_demo(parser: argparse.ArgumentParser) -> Runner:
    """Run the reference model through the graph runners and check it against eager.

    --mode decode (default): builds the tiny paged-KV model, generates the decode
    registry code, captures the decode sizes, runs a continuous-batching decode whose
    batch size changes step to step, and compares every step's logits with eager.

    --mode prefill: captures the breakable and the piecewise prefill runners per token
    bucket, runs seeded prefill batches of 1..max-bs requests with mixed prompt lengths
    (some continuing a cached prefix), and compares every batch's logits with eager.

    --model hf-llama (hf-mistral, hf-qwen2, hf-qwen3; needs `pip install 'graphslot[hf]'`):
    a tiny random-weight transformers model of that family decodes through the graph
    runner with requests joining and leaving; every row is checked (allclose) against
    the same request decoded alone by plain transformers.

    --dp N (decode): spawns N ranks of data-parallel attention (gloo on the CPU; NCCL
    with --backend cuda, one GPU a rank), each decoding its own requests: per step the
    ranks exchange token counts and agree on one graph, or all run eager when one is
    beyond the largest graph; every rank's logits are checked against one process
    running the same requests without DP.

    Exact (torch.equal) on the CPU tape, allclose on CUDA (reference/numerics.py says
    when exactness is a fair ask). Progress goes to stderr; --json keeps stdout pure
    JSON. Exit 1 when any step or batch differs.
    """
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                        help="what to run (default decode)")
    parser.add_argument("--model", choices=("reference",) + HF_DEMO_MODELS, default="reference",
                        help="the model: graphslot's reference model (default) or a tiny transformers model "
                             "of a tested family (decode only)")
    parser.add_argument("--registry", choices=("generated", "interpreted"), default="generated",
                        help="registry code (default generated)")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                        help="graph backend (auto: cuda on a GPU machine, else the cpu tape)")
    parser.add_argument("--steps", type=positive_int, help="decode only: scheduler steps (default 300)")
    parser.add_argument("--dp", type=positive_int, help="decode only: data-parallel ranks to spawn (default 1: "
                                                         "one process)")
    parser.add_argument("--batches", type=positive_int, help="prefill only: batches (default 50)")
    parser.add_argument("--runner", choices=("all", "breakable", "piecewise"),
                        help="prefill only: runner(s) to run (default all: both)")
    parser.add_argument("--max-bs", type=positive_int, default=None,
                        help="largest batch size: captured (decode, default 16; hf models 8) or per prefill "
                             "batch (prefill, default 8)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")

    def run(args: argparse.Namespace) -> int:
        if args.model != "reference" and args.mode != "decode":
            parser.error(f"argument --model: {args.model} runs decode only, not --mode {args.mode}")
        for name, (mode, default) in DEMO_MODE_FLAGS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
            elif mode != args.mode:
                parser.error(f"argument --{name}: only for --mode {mode}, not --mode {args.mode}")
        if args.dp > 1:
            if args.model != "reference":
                parser.error(f"argument --dp: runs the reference model only, not --model {args.model}")
            return run_dp(args)
        if args.backend == "cuda" and not (torch := import_torch()).cuda.is_available():
            print(f"graphslot demo: error: --backend cuda needs a CUDA GPU; this torch ({torch.__version__}) "
                  "sees none: use --backend cpu or auto", file=sys.stderr)
            return 1
        if args.model != "reference":
            return run_hf(args)
        what = (f"{args.steps} decode steps (max_bs {args.max_bs or 16})" if args.mode == "decode" else
                f"{args.batches} prefill batches (max_bs {args.max_bs or 8}, runner {args.runner})")
        print(f"graphslot demo: {what}, backend {args.backend}, registry {args.registry}: capturing, then "
              "checking each against eager", file=sys.stderr)
        import_torch()
        if args.mode == "prefill":
            from .demo_prefill import format_prefill_table, run_prefill_demo

            try:
                result = run_prefill_demo(batches=args.batches, backend=args.backend, mode=args.registry,
                                          max_bs=args.max_bs or 8,
                                          runners=None if args.runner == "all" else [args.runner])
            except (RuntimeError, ValueError) as exc:
                print(f"graphslot demo: error: {exc}", file=sys.stderr)
                return 1
            print(json.dumps(result, indent=2) if args.json else format_prefill_table(result))
            return 0 if result["mismatching_batches"] == 0 else 1

        from .demo import format_demo_table, run_demo

        result = run_demo(steps=args.steps, backend=args.backend, mode=args.registry, max_bs=args.max_bs or 16)
        print(json.dumps(result, indent=2) if args.json else format_demo_table(result))
        return 0 if result["mismatching_steps"] == 0 else 1

    return run


def run_hf(args: argparse.Namespace) -> int:
    """``demo --model hf-*``: a tiny transformers model; exit 1 on any mismatch."""
    max_bs = args.max_bs or 8
    print(f"graphslot demo: {args.model}, {args.steps} decode steps (max_bs {max_bs}), backend "
          f"{args.backend}, registry {args.registry}: capturing, then checking each step against "
          "transformers per request", file=sys.stderr)
    import_torch()
    from .demo_hf import format_hf_demo_table, run_hf_demo

    try:
        result = run_hf_demo(args.model, steps=args.steps, backend=args.backend, mode=args.registry,
                             max_bs=max_bs)
    except (ImportError, RuntimeError, ValueError) as exc:
        print(f"graphslot demo: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_hf_demo_table(result))
    return 0 if result["mismatching_steps"] == 0 else 1


def run_dp(args: argparse.Namespace) -> int:
    """``demo --dp N``: the ranks, spawned; exit 1 on any mismatch or disagreement."""
    torch = import_torch()
    if args.backend == "cuda" and torch.cuda.device_count() < args.dp:
        print(f"graphslot demo: error: --dp {args.dp} --backend cuda needs {args.dp} CUDA GPUs (one a rank); this "
              f"torch ({torch.__version__}) sees {torch.cuda.device_count()}: use --backend cpu or auto",
              file=sys.stderr)
        return 1
    max_bs = args.max_bs or 16
    print(f"graphslot demo: {args.dp} DP ranks, {args.steps} decode steps each (max_bs {max_bs}), backend "
          f"{args.backend}, registry {args.registry}: spawning, capturing, then checking every rank against one "
          "process", file=sys.stderr)
    from .demo_dp import dp_demo_failed, format_dp_table, run_dp_demo
    from ..reference.dp_launch import RankFailure

    try:
        result = run_dp_demo(dp=args.dp, steps=args.steps, backend=args.backend, mode=args.registry, max_bs=max_bs)
    except RankFailure as exc:
        print(f"graphslot demo: error: {exc.summary}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_dp_table(result))
    return 1 if dp_demo_failed(result) else 0


# --- verify --------------------------------------------------------------------------


@subcommand("verify")
def setup_verify(parser: argparse.ArgumentParser) -> Runner:
    """Prove a model safe under its spec's padding; find stale inputs.

    For each captured size and a sample of raw sizes padding to it, replays a real batch
    with the padded tail of every slot whose policy leaves it untouched (keep_pad,
    foreach_copy, fill_once) poisoned, one slot at a time, with two patterns (the real
    rows repeated; NaN / flipped bools / other seen ids): the raw rows must stay
    bit-identical to a clean replay. Also captures each size on the CPU tape and lists
    tensors a graph reads that are neither slots nor declared static (stale inputs).

    TARGET is package.module:function returning a VerifyTarget or (runner, make_batch[,
    release]); without it the shipped reference model is verified (--spec, --max-bs and
    --backend are its options, a usage error with TARGET). Prints a table (slot, policy,
    verdict) or --json; exit 1 when anything is unsafe, 2 when TARGET cannot be used
    (it cannot be imported, raises, or make_batch(n) makes a batch of another size).
    """
    from .verify import add_arguments, run as run_verify

    add_arguments(parser, positive_int)
    return lambda args: run_verify(args, parser)


# --- new-spec ------------------------------------------------------------------------


@subcommand("new-spec")
def setup_new_spec(parser: argparse.ArgumentParser) -> Runner:
    """Start a spec of your own from a shipped one and list it in pyproject.toml.

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
    from .new_spec import add_arguments, run as run_new_spec

    add_arguments(parser)
    return run_new_spec


# --- plan-sizes ----------------------------------------------------------------------


@subcommand("plan-sizes")
def setup_plan_sizes(parser: argparse.ArgumentParser) -> Runner:
    """Propose decode capture sizes from the batch sizes a runner served.

    Reads a histogram of raw batch sizes (DecodeGraphRunner.histogram.save(path), or a
    JSON object {"size": steps}) and picks the capture sizes that minimise the expected
    padded rows per step under a budget: at most N graphs (--graphs), or a graph memory
    budget (--memory with a per-graph model --graph-bytes + --row-bytes x size). The
    largest size (--max-bs, default the largest served) is always captured; larger
    batches would run eager. Exact (dynamic programming). Prints the plan next to the
    default ladder at the same max_bs: padded rows per step, padding fraction, saving.
    Exit 1 on a bad histogram or an impossible budget.
    """
    from .plan_sizes import add_arguments

    return add_arguments(parser)
