"""``graphslot demo``: a model through the graph runners, checked against eager.

The command: its arguments and which workload runs. The workloads (torch), imported when
they run: :mod:`.demo_decode` (continuous-batching decode), :mod:`.demo_prefill`
(multi-request prefill), :mod:`.demo_hf` (a tiny transformers model), :mod:`.demo_dp`
(data-parallel ranks). Torch-free itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict

from ..spec.budget import BufferBudgetError
from ..spec.dtypes import import_torch
from . import limits
from .common import Command, fail

HELP = """Run the reference model through the graph runners and check it against eager.

--workload decode (default): builds the tiny paged-KV model, generates the decode
registry code, captures the decode sizes, runs a continuous-batching decode whose
batch size changes step to step, and compares every step's logits with eager.

--workload prefill: captures the prefill runner, breakable and piecewise, per token
bucket, runs seeded prefill batches of 1..max-bs requests with mixed prompt lengths
(some continuing a cached prefix), and compares every batch's logits with eager.

--model hf-llama (hf-<family> for each tiny-model recipe of
graphslot.integrations.transformers.models.FAMILIES; needs `pip install
'graphslot[hf]'`): a tiny random-weight transformers model of that family decodes
through the graph runner with requests joining and leaving; every row is checked
(allclose) against the same request decoded alone by plain transformers.

--dp N (decode): spawns N ranks of data-parallel attention (gloo on the CPU; NCCL
with --backend cuda, one GPU a rank), each decoding its own requests: per step the
ranks exchange token counts and agree on one graph, or all run eager when one is
beyond the largest graph; every rank's logits are checked against one process
running the same requests without DP.

Exact (torch.equal) on the CPU tape, allclose on CUDA (reference/numerics.py says
when exactness is a fair ask). Progress goes to stderr; --json keeps stdout pure
JSON. Exit 1 when any step or batch differs.
"""

WORKLOADS = ("decode", "prefill")
#: Flags of one workload only, with their defaults (None in the parser: given or not).
WORKLOAD_FLAGS = {"steps": ("decode", 300), "dp": ("decode", 1), "batches": ("prefill", 50),
                  "runner": ("prefill", "all")}
REFERENCE = "reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="decode",
                        help="what to run (default decode)")
    parser.add_argument("--model", default=REFERENCE, metavar="MODEL",
                        help="the model: graphslot's reference model (default) or hf-<family>, a tiny "
                             "transformers model of a family with a tiny-model recipe (hf-llama, ...; decode only)")
    parser.add_argument("--registry", choices=("generated", "interpreted"), default="generated",
                        help="registry code (default generated)")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                        help="graph backend (auto: cuda on a GPU machine, else the cpu tape)")
    parser.add_argument("--steps", type=limits.MAX_STEPS.argument(),
                        help=f"decode only: scheduler steps (default 300, at most {limits.MAX_STEPS.most}; "
                             f"with --dp, --dp × --steps at most {limits.MAX_RANK_STEPS.most})")
    parser.add_argument("--dp", type=limits.MAX_DP.argument(),
                        help=f"decode only: data-parallel ranks to spawn (default 1: one process; at most "
                             f"{limits.MAX_DP.most})")
    parser.add_argument("--batches", type=limits.MAX_BATCHES.argument(),
                        help=f"prefill only: batches (default 50, at most {limits.MAX_BATCHES.most})")
    parser.add_argument("--runner", choices=("all", "breakable", "piecewise"),
                        help="prefill only: runner(s) to run (default all: both)")
    parser.add_argument("--max-bs", type=limits.MAX_BS.argument(), default=None,
                        help=f"largest batch size: captured (decode, default 16; hf models 8; at most "
                             f"{limits.MAX_BS.most}) or per prefill batch (prefill, default 8, at most "
                             f"{limits.PREFILL_MAX_BS.most})")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def check_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error (exit 2) for a model that is neither the reference one nor an hf
    model of a recipe in FAMILIES (imported here, so only when an hf model is named)."""
    if args.model == REFERENCE:
        return
    if args.model.startswith("hf-"):
        from .demo_hf import hf_demo_models

        models = hf_demo_models()  # ImportError without the hf extra: main prints it, exit 1
        if args.model in models:
            return
        choices = ", ".join((REFERENCE, *models))
    else:
        choices = f"{REFERENCE}, hf-<family>"
    parser.error(f"argument --model: invalid choice: {args.model!r} (choose from {choices})")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        check_model(args, parser)
    except ImportError as exc:
        return fail("demo", str(exc))
    if args.model != REFERENCE and args.workload != "decode":
        parser.error(f"argument --model: {args.model} runs decode only, not --workload {args.workload}")
    for name, (workload, default) in WORKLOAD_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif workload != args.workload:
            parser.error(f"argument --{name}: only for --workload {workload}, not --workload {args.workload}")
    check_counts(args, parser)
    if args.dp > 1:
        if args.model != REFERENCE:
            parser.error(f"argument --dp: runs the reference model only, not --model {args.model}")
        return run_dp(args)
    if args.backend == "cuda" and not (torch := import_torch()).cuda.is_available():
        return fail("demo", f"--backend cuda needs a CUDA GPU; this torch ({torch.__version__}) sees none: use "
                            "--backend cpu or auto")
    if args.model != REFERENCE:
        return run_hf(args)
    return run_prefill(args) if args.workload == "prefill" else run_decode(args)


def check_counts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error (exit 2) for a count over its limit (:mod:`.limits`), before anything is built."""
    prefill = args.workload == "prefill"
    (limits.PREFILL_MAX_BS if prefill else limits.MAX_BS).check(
        parser, "--max-bs", args.max_bs, " for --workload prefill" if prefill else "")
    if args.dp > 1:
        limits.MAX_RANK_STEPS.check(parser, "--steps", args.dp * args.steps,
                                    got=f"--dp {args.dp} × --steps {args.steps} = {args.dp * args.steps} rank-steps")


def header(what: str, args: argparse.Namespace, check: str) -> None:
    """The early line on stderr: what runs, before the minutes of capture."""
    print(f"graphslot demo: {what}, backend {args.backend}, registry {args.registry}: {check}", file=sys.stderr)


def show(result: Dict[str, Any], args: argparse.Namespace, table: Callable[[Dict[str, Any]], str],
         failed: bool) -> int:
    """The result as JSON or as its table on stdout; exit 1 when the check ``failed``."""
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 1 if failed else 0


def run_decode(args: argparse.Namespace) -> int:
    header(f"{args.steps} decode steps (max_bs {args.max_bs or 16})", args,
           "capturing, then checking each against eager")
    import_torch()
    from .demo_decode import format_demo_table, run_demo

    result = run_demo(steps=args.steps, backend=args.backend, mode=args.registry, max_bs=args.max_bs or 16)
    return show(result, args, format_demo_table, result["mismatching_steps"] != 0)


def run_prefill(args: argparse.Namespace) -> int:
    header(f"{args.batches} prefill batches (max_bs {args.max_bs or 8}, runner {args.runner})", args,
           "capturing, then checking each against eager")
    import_torch()
    from .demo_prefill import format_prefill_table, run_prefill_demo

    try:
        result = run_prefill_demo(batches=args.batches, backend=args.backend, mode=args.registry,
                                  max_bs=args.max_bs or 8, runners=None if args.runner == "all" else [args.runner])
    except (RuntimeError, ValueError) as exc:
        return fail("demo", str(exc))
    return show(result, args, format_prefill_table, result["mismatching_batches"] != 0)


def run_hf(args: argparse.Namespace) -> int:
    """``--model hf-*``: a tiny transformers model; exit 1 on any mismatch."""
    max_bs = args.max_bs or 8
    header(f"{args.model}, {args.steps} decode steps (max_bs {max_bs})", args,
           "capturing, then checking each step against transformers per request")
    import_torch()
    from .demo_hf import format_hf_demo_table, run_hf_demo

    try:
        result = run_hf_demo(args.model, steps=args.steps, backend=args.backend, mode=args.registry, max_bs=max_bs)
    except BufferBudgetError as exc:  # refused before anything was allocated: the size typed is the error
        return fail("demo", f"argument --max-bs: {max_bs} is more than this machine can hold: {exc}", status=2)
    except (ImportError, RuntimeError, ValueError) as exc:
        return fail("demo", str(exc))
    return show(result, args, format_hf_demo_table, result["mismatching_steps"] != 0)


def run_dp(args: argparse.Namespace) -> int:
    """``--dp N``: the ranks, spawned; exit 1 on any mismatch or disagreement."""
    torch = import_torch()
    if args.backend == "cuda" and torch.cuda.device_count() < args.dp:
        return fail("demo", f"--dp {args.dp} --backend cuda needs {args.dp} CUDA GPUs (one a rank); this torch "
                            f"({torch.__version__}) sees {torch.cuda.device_count()}: use --backend cpu or auto")
    max_bs = args.max_bs or 16
    header(f"{args.dp} DP ranks, {args.steps} decode steps each (max_bs {max_bs})", args,
           "spawning, capturing, then checking every rank against one process")
    from ..reference.dp_launch import RankFailure
    from .demo_dp import dp_demo_failed, format_dp_table, run_dp_demo

    try:
        result = run_dp_demo(dp=args.dp, steps=args.steps, backend=args.backend, mode=args.registry, max_bs=max_bs)
    except RankFailure as exc:
        return fail("demo", exc.summary)
    return show(result, args, format_dp_table, dp_demo_failed(result))


COMMAND = Command("demo", HELP, add_arguments, run)
