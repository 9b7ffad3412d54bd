"""Per-model diagnostics over the public runner and graph API.

``graphslot verify``'s engine: :func:`verify_runner` replays a :class:`VerifyTarget`
with poisoned padded tails (:mod:`.poison`) and runs the stale-input audit
(:func:`audit_external_inputs`); :func:`format_report` prints a :class:`VerifyReport`
(:mod:`.verify_report`).
"""

from .audit import ExternalInput, audit_external_inputs, capture_on_tape
from .poison import PATTERNS, UNTOUCHED_POLICIES, Poisoner, poisonable
from .verify import VerifyTarget, verify_runner
from .verify_report import SlotVerdict, VerifyReport, format_report

__all__ = [
    "ExternalInput",
    "PATTERNS",
    "Poisoner",
    "SlotVerdict",
    "UNTOUCHED_POLICIES",
    "VerifyReport",
    "VerifyTarget",
    "audit_external_inputs",
    "capture_on_tape",
    "format_report",
    "poisonable",
    "verify_runner",
]
