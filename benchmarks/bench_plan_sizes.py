"""Capture-size planner vs the default ladder on synthetic serving traces.

    python benchmarks/bench_plan_sizes.py [--steps N] [--json] [--save-histogram PATH]

Two deterministic traces (graphslot/reference/serving_trace.py: Poisson arrivals with
a slowly swinging rate, lognormal output lengths, a continuous batcher capped at 256
running requests): "busy" reaches the cap, "light" stays below 64. For each, the
default ladder up to 256 (35 graphs) and the planner's sizes for a range of graph
budgets, all capturing 256: expected padded rows per decode step, the padding fraction
(padding rows over all rows computed), the ratio to the ladder, and the fewest graphs
whose plan pads no more than the ladder. --save-histogram writes the busy trace's
histogram for ``graphslot plan-sizes``. No model runs: the figures are counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Dict, List

from graphslot.reference.serving_trace import TraceConfig, serving_histogram
from graphslot.planning.planner import default_ladder, evaluate, plan_capture_sizes

MAX_BS = 256
TRACES = {"busy": TraceConfig(arrival_rate=0.6), "light": TraceConfig(arrival_rate=0.1)}
BUDGETS = (4, 8, 12, 16, 24, 35)


def run_trace(config: TraceConfig) -> Dict[str, Any]:
    histogram = serving_histogram(config)
    ladder = evaluate(default_ladder(MAX_BS), histogram)
    rows: List[Dict[str, Any]] = []
    start = time.perf_counter()
    for graphs in BUDGETS:
        plan = plan_capture_sizes(histogram, graphs, max_bs=MAX_BS)
        rows.append({"graphs": graphs, "used": len(plan), "padded_rows_per_step": plan.padded_rows_per_step,
                     "padding_fraction": plan.padding_fraction,
                     "vs_ladder": plan.padded_rows_per_step / ladder.padded_rows_per_step,
                     "sizes": list(plan.sizes)})
    plan_seconds = (time.perf_counter() - start) / len(BUDGETS)
    matching = next(n for n in range(1, len(ladder) + 1)
                    if plan_capture_sizes(histogram, n, max_bs=MAX_BS).padded_rows <= ladder.padded_rows)
    return {"trace": dataclasses.asdict(config), "steps": histogram.steps, "distinct_sizes": len(histogram.counts),
            "mean_rows": sum(bs * n for bs, n in histogram.counts.items()) / histogram.steps,
            "ladder": {"graphs": len(ladder), "padded_rows_per_step": ladder.padded_rows_per_step,
                       "padding_fraction": ladder.padding_fraction},
            "plans": rows, "fewest_graphs_matching_ladder": matching, "plan_seconds": plan_seconds,
            "histogram": histogram}


def format_trace(name: str, r: Dict[str, Any]) -> str:
    ladder = r["ladder"]
    lines = [f"{name}: {r['steps']} steps, {r['distinct_sizes']} distinct sizes, {r['mean_rows']:.1f} rows/step "
             f"(arrival rate {r['trace']['arrival_rate']}/step, median {r['trace']['median_tokens']:.0f} tokens)",
             f"  {'':>16} {'graphs':>6} {'padded rows/step':>16} {'padding':>8} {'vs ladder':>9}",
             f"  {'default ladder':>16} {ladder['graphs']:>6} {ladder['padded_rows_per_step']:>16.3f} "
             f"{100 * ladder['padding_fraction']:>7.2f}% {1:>8.2f}x"]
    for p in r["plans"]:
        lines.append(f"  {'plan':>16} {p['used']:>6} {p['padded_rows_per_step']:>16.3f} "
                     f"{100 * p['padding_fraction']:>7.2f}% {p['vs_ladder']:>8.2f}x")
    lines.append(f"  fewest planned graphs padding no more than the ladder's {ladder['graphs']}: "
                 f"{r['fewest_graphs_matching_ladder']}; planning takes {1e3 * r['plan_seconds']:.1f} ms")
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=TraceConfig.steps, help="decode steps per trace")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--save-histogram", metavar="PATH", help="write the busy trace's histogram")
    args = parser.parse_args(argv)
    print(f"bench_plan_sizes: {len(TRACES)} synthetic traces of {args.steps} steps, max_bs {MAX_BS}, "
          f"graph budgets {', '.join(map(str, BUDGETS))}", file=sys.stderr)
    results = {name: run_trace(dataclasses.replace(config, steps=args.steps)) for name, config in TRACES.items()}
    if args.save_histogram:
        results["busy"]["histogram"].save(args.save_histogram)
    for r in results.values():
        r.pop("histogram")
    print(json.dumps(results, indent=2) if args.json else
          "\n\n".join(format_trace(name, r) for name, r in results.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
