"""Batch-size histograms and the capture-size planner. Imports no torch.

A runner records the raw batch sizes it serves in a :class:`BatchSizeHistogram`
(``save``/``load`` as JSON); :func:`plan_capture_sizes` proposes the sizes that pad
least under a budget of graphs or graph memory, :func:`evaluate` scores any sizes, and
:func:`default_ladder` is the schedule a runner captures without a plan.
"""

from .histogram import BatchSizeHistogram, HistogramError, parse_histogram
from .planner import MAX_GRAPHS, Plan, default_capture_schedule, default_ladder, evaluate, plan_capture_sizes

__all__ = [
    "BatchSizeHistogram",
    "HistogramError",
    "MAX_GRAPHS",
    "Plan",
    "default_capture_schedule",
    "default_ladder",
    "evaluate",
    "parse_histogram",
    "plan_capture_sizes",
]
