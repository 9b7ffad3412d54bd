"""The graph runners: an engine writes one adapter, the runners own the registry.

Decode: :class:`DecodeGraphRunner` (one graph per captured batch size; which size a step
replays is :class:`SizeDispatcher`'s), :class:`DPDecodeRunner` over it for data-parallel
attention, :class:`EagerRunner` for the eager path through the same slots. Prefill:
:class:`BreakableGraphRunner` (cut at :func:`eager_on_graph` calls) and
:class:`PiecewiseGraphRunner` (``torch.compile`` split at ops). Engines subclass
:class:`DecodeAdapter` / :class:`PrefillAdapter`.
"""

from .adapter import DecodeAdapter
from .breakable import BreakableGraphRunner, capture_breakable, eager_on_graph, is_eager_on_graph
from .config import GraphRunnerConfig
from .contract import AdapterContractError
from .decode import DecodeGraphRunner, DecodeRunnerConfig, PreparedReplay, StepObserver
from .dispatch import SizeDispatcher, capture_sizes
from .dp import DPDecodeRunner, DPExchange, DPStep, DPStepError
from .eager import EagerRunner
from .guard import ReplayGuardError
from .metrics import RunnerMetrics
from .outputs import SharedOutputs, slice_rows
from .piecewise import PiecewiseGraphRunner, PiecewiseRunnerConfig
from .prefill import PrefillGraphRunner, PrefillRunnerConfig, default_token_buckets, token_buckets
from .prefill_adapter import LayerStackError, PrefillAdapter

__all__ = [
    "AdapterContractError",
    "BreakableGraphRunner",
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
    "PiecewiseGraphRunner",
    "PiecewiseRunnerConfig",
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
