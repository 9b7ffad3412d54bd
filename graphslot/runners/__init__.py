"""The graph runners: an engine writes one adapter, the runners own the registry.

One runner per phase, each in any capture mode (``capture="full" | "breakable" |
"piecewise"``, :mod:`.capture`) on any graph backend: :class:`DecodeGraphRunner` (graphs
keyed by batch size and context bucket; which a step replays is
:class:`SizeDispatcher`'s), :class:`DPDecodeRunner` over it for data-parallel attention,
:class:`PrefillGraphRunner` (the layer stack, keyed by token bucket), and
:class:`EagerRunner` for the eager path through the same slots. Engines subclass
:class:`DecodeAdapter` / :class:`PrefillAdapter`; ``@eager_on_graph`` marks what a
breakable capture runs eagerly.
"""

from .adapter import DecodeAdapter
from .breakable import capture_breakable, eager_on_graph, is_eager_on_graph
from .config import GraphRunnerConfig
from .contract import AdapterContractError
from .decode import DecodeGraphRunner, DecodeRunnerConfig, PreparedReplay, StepObserver
from .dispatch import SizeDispatcher, capture_sizes
from .dp import DPDecodeRunner, DPExchange, DPStep, DPStepError
from .eager import EagerRunner
from .guard import ReplayGuardError
from .metrics import RunnerMetrics
from .outputs import SharedOutputs, slice_rows
from .prefill import PrefillGraphRunner, PrefillRunnerConfig, default_token_buckets, token_buckets
from .prefill_adapter import LayerStackError, PrefillAdapter

__all__ = [
    "AdapterContractError",
    "DPDecodeRunner",
    "DPExchange",
    "DPStep",
    "DPStepError",
    "DecodeAdapter",
    "DecodeGraphRunner",
    "DecodeRunnerConfig",
    "EagerRunner",
    "GraphRunnerConfig",
    "LayerStackError",
    "PrefillAdapter",
    "PrefillGraphRunner",
    "PrefillRunnerConfig",
    "PreparedReplay",
    "ReplayGuardError",
    "RunnerMetrics",
    "SharedOutputs",
    "SizeDispatcher",
    "StepObserver",
    "capture_breakable",
    "capture_sizes",
    "default_token_buckets",
    "eager_on_graph",
    "is_eager_on_graph",
    "slice_rows",
    "token_buckets",
]
