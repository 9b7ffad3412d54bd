"""``graphslot verify``'s report: a verdict per slot, the stale inputs and problems found, as a dict (``--json``)
and as the printed table. :func:`graphslot.tools.verify.verify_runner` makes one of a graph runner's replays,
``graphslot.integrations.vllm.verify`` of the vLLM plugin's runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from .audit import ExternalInput


@dataclass
class SlotVerdict:
    slot: str
    policy: str
    verdict: str  # "safe", "UNSAFE", "n/a" (no padded rows), "unverified"
    detail: str
    leaks: List[Dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"slot": self.slot, "policy": self.policy, "verdict": self.verdict, "detail": self.detail,
                "leaks": self.leaks}


@dataclass
class VerifyReport:
    label: str
    backend: str
    cases: List[Tuple[int, int]]  # (raw_bs, padded_bs) replayed
    slots: List[SlotVerdict]
    external_inputs: List[ExternalInput]
    problems: List[str]  # anything else that makes the result unsafe (non-determinism)
    summary: str = ""  # what was run, for a target that replays no graphs (the vLLM plugin); else the cases

    @property
    def safe(self) -> bool:
        return not (self.problems or self.external_inputs or any(s.verdict == "UNSAFE" for s in self.slots))

    def as_dict(self) -> Dict[str, Any]:
        return {"mode": "verify", "target": self.label, "backend": self.backend, "safe": self.safe,
                "cases": [{"raw_bs": r, "padded_bs": p} for r, p in self.cases],
                "slots": [s.as_dict() for s in self.slots],
                "external_inputs": [e.as_dict() for e in self.external_inputs], "problems": self.problems,
                **({"summary": self.summary} if self.summary else {})}


def format_report(report: VerifyReport) -> str:
    """The per-slot table, then external inputs and problems, then the verdict."""
    rows = [(s.slot, s.policy, s.verdict, s.detail) for s in report.slots]
    widths = [max(len(r[i]) for r in rows + [("slot", "policy", "verdict", "")]) for i in range(3)]
    head = ("slot", "policy", "verdict")
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  detail"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    cases = ", ".join(f"{r}->{p}" for r, p in report.cases) or "none"
    if report.summary:
        lines.append(f"\n{report.summary}")
    else:
        lines.append(f"\nsteps replayed (raw->padded): {cases}; backend {report.backend}")
    if report.external_inputs:
        lines.append("stale inputs:" if report.summary else "external inputs (stale after capture):")
        lines += [f"  {e.describe()}" for e in report.external_inputs]
    lines += [f"problem: {p}" for p in report.problems]
    lines.append("verdict: " + ("safe" if report.safe else "UNSAFE"))
    return "\n".join(lines)
