"""gpu_proof's summaries and tables: what each part's pieces say, against the issue's targets.

Stdlib only: the orchestrator never imports torch (its pieces own the device).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional

GIB = 1 << 30
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")
SKIP = re.compile(r"^SKIPPED \[(\d+)\] (\S+): (.*)$")
TWO_GPUS = re.compile(r"\b(2|two|multiple) (CUDA )?GPUs\b", re.IGNORECASE)


def parse_pytest(stdout: str) -> Dict[str, Any]:
    """Counts from pytest's last line, each skip with its reason (``-rs``), failures (``-rfE``)."""
    counts: Dict[str, int] = {}
    lines = stdout.splitlines()
    for line in reversed(lines):
        found = SUMMARY.findall(line)
        if found and " in " in line:
            counts = {("errors" if kind.startswith("error") else kind): int(n) for n, kind in found}
            break
    skips = [{"count": int(m[1]), "where": m[2], "reason": m[3]} for m in map(SKIP.match, lines) if m]
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return {**counts, "skips": skips, "failures": failures[:20],
            "two_gpu_skips": [s for s in skips if TWO_GPUS.search(s["reason"])]}


def result_of(records: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    """The results of the pieces named ``prefix``…, merged (a piece with several cases
    keys each by case)."""
    merged: Dict[str, Any] = {}
    for name, record in records.items():
        if name.startswith(prefix) and isinstance(record.get("result"), dict):
            merged.update(record["result"])
    return merged


def all_equal(case: Optional[Dict[str, Any]]) -> Optional[bool]:
    return None if not case else case.get("equal") == case.get("total")


def summarize(part: int, records: Dict[str, Any]) -> Dict[str, Any]:
    ran = all(r.get("rc") == 0 and not r.get("timed_out") for r in records.values())
    summary: Dict[str, Any] = {"every_piece_ran": ran}
    if part == 1:
        tests = (records.get("pytest_cuda") or {}).get("result") or {}
        demos = {"decode full (cli)": (result_of(records, "demo_decode_cli") or {}).get("mismatching_steps"),
                 "prefill breakable+piecewise (cli)":
                     (result_of(records, "demo_prefill_cli") or {}).get("mismatching_batches")}
        modes = result_of(records, "demo_")
        for mode in ("breakable", "piecewise"):
            demos[f"decode {mode}"] = (modes.get(mode) or {}).get("mismatching_steps")
        batcher = result_of(records, "batcher")
        cases = {f"batch {bs}": all_equal(c) for bs, c in (batcher.get("batches") or {}).items()}
        cases["trace"] = all_equal(batcher.get("trace"))
        for bs, c in (batcher.get("reduce_overhead") or {}).items():
            cases[f"reduce-overhead batch {bs}"] = all_equal(c)
        after = batcher.get("after_reduce_overhead") or {}
        cases["after reduce-overhead: batch"] = all_equal(after.get("batch"))
        cases["after reduce-overhead: trace"] = all_equal(after.get("trace"))
        summary.update(tests={k: tests.get(k, 0) for k in ("passed", "failed", "skipped", "errors")},
                       two_gpu_skips=len(tests.get("two_gpu_skips", [])), demo_mismatches=demos,
                       batcher_tokens_equal=cases,
                       correct=ran and all(v == 0 for v in demos.values()) and all(v is True for v in cases.values()))
    elif part == 2:
        fill = result_of(records, "fill")
        summary.update(sglang=fill.get("sglang"), skipped=fill.get("skipped"), targets=fill.get("targets"))
    elif part == 3:
        capture = result_of(records, "capture")
        summary["capture"] = {mode: {"seconds": c.get("capture_s"), "reserved": c.get("memory", {}).get("reserved"),
                                     "dynamo_graphs": c.get("dynamo", {}).get("unique_graphs"),
                                     "partial": c.get("partial", False),
                                     "seconds_met": c.get("targets", {}).get("seconds_met"),
                                     "reserved_met": c.get("targets", {}).get("reserved_met")}
                              for mode, c in capture.items() if mode in ("full", "breakable", "piecewise")}
        summary["gap"] = (capture.get("gap") or {}).get("targets")
    else:
        serving = result_of(records, "serving")
        summary["targets"] = serving.get("targets")
        summary["tokens_equal"] = {f"bs {bs} {name}": f"{e['equal']}/{e['total']}"
                                   for bs, row in (serving.get("batches") or {}).items() for name, e in row.items()}
    return summary


# -- tables ------------------------------------------------------------------------------
def num(value: Any, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def gib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / GIB:.3f} GiB"


def environment_line(env: Dict[str, Any], out: Path) -> str:
    wheels = env.get("wheels", {})
    installed = ", ".join(wheels.get("installed", [])) or wheels.get("reason") or wheels.get("error", "")[-200:]
    keys = ("python", "torch", "cuda", "gpu", "transformers", "triton", "pydantic", "sglang", "sglang_registry")
    return (f"gpu_proof {env.get('date')}: " + ", ".join(f"{k} {env.get(k)}" for k in keys)
            + f"\n  wheels: {installed}\n  results: {out}")


def piece_lines(records: Dict[str, Any]) -> List[str]:
    lines = []
    for name, r in records.items():
        if "skipped" in r:
            lines.append(f"  {name}: not run: {r['skipped']}")
            continue
        state = "TIMED OUT" if r["timed_out"] else ("ok" if r["rc"] == 0 else f"FAILED (rc {r['rc']})")
        lines.append(f"  {name}: {state}, {r['seconds']:.1f} s")
        if "tail" in r:
            lines += ["    | " + line for line in r["tail"].strip().splitlines()[-8:]]
    return lines


def table(result: Dict[str, Any]) -> str:
    part = result["part"]
    s = result["summary"]
    lines = [f"== part {part}: {result['name']} ({result['seconds']:.0f} s of {result['budget_s']:.0f})"
             + (" [smoke]" if result["smoke"] else "")]
    lines += piece_lines(result["pieces"])
    records = result["pieces"]
    if part == 1:
        t = s["tests"]
        lines.append(f"  pytest -m cuda: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped ({s['two_gpu_skips']} for two GPUs)")
        for skip in ((records.get("pytest_cuda") or {}).get("result") or {}).get("skips", [])[:12]:
            lines.append(f"    skipped {skip['count']}: {skip['where']}: {skip['reason']}")
        lines.append("  demo mismatches: " + ", ".join(f"{k} {v}" for k, v in s["demo_mismatches"].items()))
        lines.append("  batcher tokens = generate: " + ", ".join(
            f"{k} {'yes' if v else ('n/a' if v is None else 'NO')}" for k, v in s["batcher_tokens_equal"].items()))
        lines.append(f"  correct: {s['correct']}")
    elif part == 2:
        lines += fill_table(result_of(records, "fill"))
    elif part == 3:
        lines += capture_table(result_of(records, "capture"))
    else:
        lines += serving_table(result_of(records, "serving"))
    return "\n".join(lines)


def launches(value: Optional[Dict[str, int]]) -> str:
    return "n/a" if value is None else f"{value['gpu_events']} ({value['launch_calls']} calls)"


def fill_table(fill: Dict[str, Any]) -> List[str]:
    if fill.get("skipped"):
        return [f"  {fill['skipped']}"]
    lines = [f"  sglang {fill.get('sglang')}: fill_from + extract host µs; GPU events of one fill_from",
             "  raw/pad   graphslot            sglang               sglang fast path     vs fast path"]
    for r in fill.get("rows", []):
        cells = [f"{num(r[f'{n}_us'], '.2f', 'µs'):>9} {launches(r[f'{n}_launches']):>10}"
                 for n in ("graphslot", "sglang", "sglang_fast_path")]
        ratio = num(r["vs_fast_path"], ".2f", "x")
        lines.append(f"  {r['raw']:>3}/{r['padded']:<4} " + "  ".join(cells) + f"  {ratio}")
    t = fill.get("targets")
    if t:
        lines.append(f"  targets: 1 GPU event per padded fill {t['one_gpu_event_per_padded_fill']}; "
                     f"{num(t['host_us_at_256'], '.2f')} µs at 256 (<= {t['host_us_target']}) {t['host_us_met']}; "
                     f"faster than the fast path everywhere {t['faster_than_fast_path_everywhere']}; "
                     f"same buffers {t['same_buffers_everywhere']}")
    return lines


def capture_table(capture: Dict[str, Any]) -> List[str]:
    lines = [f"  {capture.get('model', '')}: mode, sizes, capture s, allocated / reserved growth, Dynamo graphs"]
    for mode in ("full", "breakable", "piecewise"):
        c = capture.get(mode)
        if not c:
            lines.append(f"  {mode:<10} not measured")
            continue
        if c.get("partial"):
            lines.append(f"  {mode:<10} cut: {c['sizes_started']} sizes started in {c['seconds_so_far']:.1f} s, "
                         f"Dynamo graphs so far {c['dynamo']['unique_graphs']}")
            continue
        t = c["targets"]
        lines.append(f"  {mode:<10} {c['sizes']:>3}  {c['capture_s']:6.2f} s ({'ok' if t['seconds_met'] else 'over'}"
                     f" {t['seconds']:.0f} s)  +{gib(c['memory']['allocated'])} / +{gib(c['memory']['reserved'])}"
                     f" (<= 1 GiB: {t['reserved_met']})  {c['dynamo']['unique_graphs']}")
    gap = capture.get("gap")
    if gap:
        lines.append("  step gap: bs, GPU not in the graph per step, host µs of replay (of which graph.replay)")
        for r in gap["rows"]:
            lines.append(f"  {r['bs']:>5}  {num(r['gap_us'], '.1f', 'µs'):>9}  {r['replay_host_us']:7.1f}µs "
                         f"({r['graph_replay_host_us']:.1f}µs)")
        t = gap["targets"]
        lines.append(f"  target: <= {t['gap_us']:.0f} µs at bs {t['bs']}: {t['gap_met']}")
    return lines


def serving_table(serving: Dict[str, Any]) -> List[str]:
    lines = []
    trace = serving.get("trace")
    if trace:
        lines.append(f"  changing batch ({trace['steps']} steps, {trace['distinct_sizes']} sizes), ms per step, "
                     "first pass / steady:")
        for name in ("graphslot", "reduce_overhead_per_size", "reduce_overhead_padded_to_max"):
            if name in trace:
                v = trace[name]
                lines.append(f"    {name:<30} {v['first_pass_ms_per_step']:9.3f} / {v['steady_ms_per_step']:.3f}")
    lines.append(f"  {serving.get('new_tokens')} new tokens per request, prompt {serving.get('prompt_tokens')}: "
                 "tokens/s, ms per step, tokens = generate's")
    for bs, row in (serving.get("batches") or {}).items():
        cells = [f"{name} {e['tokens_per_s']:.0f} tok/s {e['ms_per_step']:.2f} ms {e['equal']}/{e['total']}"
                 for name, e in row.items()]
        lines.append(f"    bs {bs:>3}: " + "; ".join(cells))
    lines.append(f"  targets: {serving.get('targets')}")
    for name, err in (serving.get("errors") or {}).items():
        lines.append(f"  error in {name}: {err[:300]}")
    return lines
