"""``graphslot plan-sizes``: capture sizes from a served-batch-size histogram.

Torch-free: reads the JSON a runner's ``histogram.save(path)`` wrote (or a bare
``{"size": steps}`` object), plans with :mod:`graphslot.planning.planner` and compares
the plan with the default ladder at the same ``max_bs``.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Dict, Optional

from ..planning.histogram import BatchSizeHistogram, HistogramError
from ..planning.planner import MAX_GRAPHS, default_ladder, evaluate, plan_capture_sizes
from ..spec.errors import shorten
from . import limits
from .common import Command, fail, format_table

HELP = """Propose decode capture sizes from the batch sizes a runner served.

Reads a histogram of raw batch sizes (DecodeGraphRunner.histogram.save(path), or a
JSON object {"size": steps}) and picks the capture sizes that minimise the expected
padded rows per step under a budget: at most N graphs (--graphs), or a graph memory
budget (--memory with a per-graph model --graph-bytes + --row-bytes x size). The
largest size (--max-bs, default the largest served) is always captured; larger
batches would run eager. Exact (dynamic programming). Prints the plan next to the
default ladder at the same max_bs: padded rows per step, padding fraction, saving.
Exit 1 on a bad histogram or an impossible budget.
"""

UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def byte_count(text: str) -> int:
    """``1073741824``, ``1GiB``, ``512 MiB``, ``64k``: a whole number of bytes."""
    match = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,6})?)\s*([a-zA-Z]{0,3})\s*", text)
    unit = UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise argparse.ArgumentTypeError(f"expected bytes such as 1073741824, 512MiB or 2GiB, got {shorten(text, 40)}")
    return int(float(match.group(1)) * unit)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("histogram", metavar="HISTOGRAM.json",
                        help="a runner's histogram.save() output, or a JSON object {\"size\": steps}")
    parser.add_argument("--graphs", type=limits.MAX_PLAN_GRAPHS.argument(), metavar="N",
                        help=f"capture at most N graphs (at most {MAX_GRAPHS}; default: as many as the default "
                             "ladder captures up to max_bs)")
    parser.add_argument("--max-bs", type=limits.MAX_CAPACITY.argument(), metavar="M",
                        help="largest graph, always captured; larger batches run eager (default: the largest "
                             f"size served; at most {limits.MAX_CAPACITY.most})")
    parser.add_argument("--memory", type=byte_count, metavar="BYTES",
                        help="instead of --graphs: graphs whose memory sums to at most BYTES, each taking "
                             "--graph-bytes + --row-bytes x its size")
    parser.add_argument("--graph-bytes", type=byte_count, default=0, metavar="BYTES",
                        help="with --memory: memory of any graph (default 0)")
    parser.add_argument("--row-bytes", type=byte_count, default=0, metavar="BYTES",
                        help="with --memory: memory per batch row of a graph (default 0)")
    parser.add_argument("--json", action="store_true", help="print the plan and the comparison as JSON")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.memory is None and (args.graph_bytes or args.row_bytes):
        parser.error("--graph-bytes and --row-bytes need --memory")
    if args.memory is not None and args.graphs is not None:
        parser.error("give one budget: --graphs or --memory")
    if args.memory is not None and not (args.graph_bytes or args.row_bytes):
        parser.error("--memory needs a memory model: --graph-bytes and/or --row-bytes")
    try:
        histogram = BatchSizeHistogram.load(args.histogram)
        report = plan_report(args.histogram, histogram, args.graphs, args.max_bs, args.memory,
                             (args.graph_bytes, args.row_bytes) if args.memory is not None else None)
    except (HistogramError, ValueError, OSError) as exc:
        message = f"{args.histogram}: {exc.strerror}" if isinstance(exc, OSError) and exc.strerror else exc
        return fail("plan-sizes", str(message))
    print(json.dumps(report, indent=2) if args.json else format_plan_report(report))
    return 0


def plan_report(path: str, histogram: BatchSizeHistogram, graphs: Optional[int], max_bs: Optional[int],
                memory: Optional[int], graph_memory: Optional[tuple]) -> Dict[str, Any]:
    """The plan, the default ladder at the same max_bs, and the saving, as JSON-ready data."""
    counts = histogram.counts
    cap = max_bs or max(counts)
    ladder = evaluate(default_ladder(cap), counts, memory=graph_memory)
    if memory is None:
        graphs = graphs or min(len(ladder), MAX_GRAPHS)
        plan = plan_capture_sizes(counts, graphs, max_bs=cap)
        budget: Dict[str, Any] = {"graphs": graphs}
    else:
        plan = plan_capture_sizes(counts, max_bs=cap, memory_budget=memory, graph_memory=graph_memory)
        budget = {"memory": memory, "graph_bytes": graph_memory[0], "row_bytes": graph_memory[1]}
    saved = ladder.padded_rows_per_step - plan.padded_rows_per_step
    steps = histogram.steps
    return {
        "command": "plan-sizes",
        "histogram": {"path": path, "steps": steps, "distinct_sizes": len(counts), "min": min(counts),
                      "max": max(counts), "mean_rows": sum(bs * n for bs, n in counts.items()) / steps},
        "budget": budget, "max_bs": cap, "plan": plan.to_json(), "default_ladder": ladder.to_json(),
        "saving": {"padded_rows_per_step": saved,
                   "fraction": saved / ladder.padded_rows_per_step if ladder.padded_rows_per_step else 0.0,
                   "graphs": len(ladder) - len(plan)},
    }


def _row(name: str, plan: Dict[str, Any], memory: bool) -> list:
    row = [name, str(plan["graphs"]), f"{plan['padded_rows_per_step']:.3f}", f"{100 * plan['padding_fraction']:.2f}%"]
    return row + [f"{plan['memory'] / 2**20:.1f} MiB"] if memory else row


def format_plan_report(report: Dict[str, Any]) -> str:
    h = report["histogram"]
    plan = report["plan"]
    ladder = report["default_ladder"]
    saving = report["saving"]
    budget = report["budget"]
    memory = "memory" in budget
    what = (f"graphs within {budget['memory'] / 2**20:.1f} MiB ({budget['graph_bytes']} B + {budget['row_bytes']} B "
            f"per row each)" if memory else f"at most {budget['graphs']} graphs")
    header = ["", "graphs", "padded rows/step", "padding"] + (["graph memory"] if memory else [])
    lines = [
        f"{h['path']}: {h['steps']} steps, {h['distinct_sizes']} distinct batch sizes in {h['min']}..{h['max']}, "
        f"{h['mean_rows']:.2f} rows/step on average",
        f"plan: {what}, max_bs {report['max_bs']}",
        "",
        format_table(header, [_row("plan", plan, memory), _row("default ladder", ladder, memory)],
                     right=tuple(range(1, len(header)))),
        "",
        f"saving vs the default ladder: {saving['padded_rows_per_step']:+.3f} padded rows/step "
        f"({100 * saving['fraction']:+.1f}%), {saving['graphs']:+d} graphs",
        "sizes: " + " ".join(map(str, plan["sizes"])),
    ]
    eager = {int(bs): n for bs, n in plan["eager"].items()}
    if eager:
        n = sum(eager.values())
        lines.append(f"eager (above max_bs {report['max_bs']}): {len(eager)} sizes in {min(eager)}..{max(eager)}, "
                     f"{n} of {h['steps']} steps ({100 * n / h['steps']:.1f}%)")
    lines.append(f"runner: DecodeRunnerConfig(max_bs={plan['max_bs']}, capture_bs={plan['sizes']})")
    return "\n".join(lines)


COMMAND = Command("plan-sizes", HELP, add_arguments, run)
