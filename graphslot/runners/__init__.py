"""The graph runners: an engine writes one adapter, the runners own the registry.

One runner per phase, each in any capture mode (``capture="full" | "breakable" |
"piecewise"``, :mod:`.capture`) on any graph backend: :class:`DecodeGraphRunner` (graphs
keyed by batch size and context bucket; which a step replays is
``runner.dispatch``'s), :class:`DPDecodeRunner` over it for data-parallel attention,
:class:`PrefillGraphRunner` (the layer stack, keyed by token bucket), and
:class:`EagerRunner` for the eager path through the same slots. Engines subclass
:class:`DecodeAdapter` / :class:`PrefillAdapter`; ``@eager_on_graph`` marks what a
breakable capture runs eagerly. :class:`ModelGraphRunner` runs one model's every step,
full, piecewise or eager, as its :class:`Dispatcher` picks over the captured
:class:`GraphKey` s for each step's :class:`BatchDescriptor`.
"""

from .adapter import DecodeAdapter
from .breakable import eager_on_graph
from .contract import AdapterContractError
from .decode import DecodeGraphRunner, DecodeRunnerConfig
from .dispatcher import Dispatch, Dispatcher
from .dp import DPDecodeRunner
from .dp_exchange import DPExchange, DPStepError
from .eager import EagerRunner
from .graph_count import GraphCountError
from .guard import ReplayGuardError
from .keys import BatchDescriptor, GraphKey
from .model_runner import ModelGraphRunner
from .prefill import PrefillGraphRunner, PrefillRunnerConfig
from .prefill_adapter import PrefillAdapter

# What an engine needs (docs/api.md); everything else is imported from its module.
__all__ = [
    "AdapterContractError",
    "BatchDescriptor",
    "DPDecodeRunner",
    "DPExchange",
    "DPStepError",
    "DecodeAdapter",
    "DecodeGraphRunner",
    "DecodeRunnerConfig",
    "Dispatch",
    "Dispatcher",
    "EagerRunner",
    "GraphCountError",
    "GraphKey",
    "ModelGraphRunner",
    "PrefillAdapter",
    "PrefillGraphRunner",
    "PrefillRunnerConfig",
    "ReplayGuardError",
    "eager_on_graph",
]
