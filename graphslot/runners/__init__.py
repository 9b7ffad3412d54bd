"""The graph runners: an engine writes one adapter, the runners own the registry.

One runner per phase, each in any capture mode (``capture="full" | "breakable" |
"piecewise"``, :mod:`.capture`) on any graph backend: :class:`DecodeGraphRunner` (graphs
keyed by batch size and context bucket; which a step replays is
``runner.dispatch``'s), :class:`DPDecodeRunner` over it for data-parallel attention,
:class:`PrefillGraphRunner` (the layer stack, keyed by token bucket), and
:class:`EagerRunner` for the eager path through the same slots. Engines subclass
:class:`DecodeAdapter` / :class:`PrefillAdapter`; ``@eager_on_graph`` marks what a
breakable capture runs eagerly.
"""

from .adapter import DecodeAdapter
from .breakable import eager_on_graph
from .contract import AdapterContractError
from .decode import DecodeGraphRunner, DecodeRunnerConfig
from .dp import DPDecodeRunner, DPExchange, DPStepError
from .eager import EagerRunner
from .guard import ReplayGuardError
from .prefill import PrefillGraphRunner, PrefillRunnerConfig
from .prefill_adapter import PrefillAdapter

# What an engine needs (docs/api.md); everything else is imported from its module.
__all__ = [
    "AdapterContractError",
    "DPDecodeRunner",
    "DPExchange",
    "DPStepError",
    "DecodeAdapter",
    "DecodeGraphRunner",
    "DecodeRunnerConfig",
    "EagerRunner",
    "PrefillAdapter",
    "PrefillGraphRunner",
    "PrefillRunnerConfig",
    "ReplayGuardError",
    "eager_on_graph",
]
