"""The settings every graph runner shares, and how a runner takes its config.

:class:`GraphRunnerConfig` holds what every runner has (capture mode, graph backend and
pool, the engine's capture context, registry mode, spec params, progress bar, warm-ups,
lazy capture, the buffer byte cap, the replay guard);
:class:`~graphslot.runners.decode.DecodeRunnerConfig` and
:class:`~graphslot.runners.prefill.PrefillRunnerConfig` add their own. A runner is
built from a config, keyword overrides, or both (:func:`runner_config`).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Mapping, Optional, Sequence, Tuple, Type, TypeVar

from ..api import is_pool

C = TypeVar("C", bound="GraphRunnerConfig")

#: The default of ``GraphRunnerConfig.max_graphs``.
DEFAULT_MAX_GRAPHS = 512


@dataclass
class GraphRunnerConfig:
    #: Largest batch (requests) a graph serves.
    max_bs: int = 32
    #: How a graph is made (:mod:`graphslot.runners.capture`): "full" (one graph per key),
    #: "breakable" (segments cut at ``@eager_on_graph`` calls), "piecewise"
    #: (``torch.compile`` split at ``split_ops``, each piece a graph).
    capture: str = "full"
    #: Piecewise's split ops (``"ns::name"``); None: the adapter's ``split_ops``.
    split_ops: Optional[Sequence[str]] = None
    #: Piecewise: what compiles each piece, once (``"inductor"``, ``"aot_eager"``,
    #: ``"eager"``: none, or another Dynamo backend); None: ``"inductor"`` on the cuda
    #: graph backend, ``"aot_eager"`` on the cpu tape (which cannot record Inductor's C++
    #: kernels; :mod:`graphslot.runners.piecewise`).
    compile_backend: Optional[str] = None
    #: Graph backend: "auto" (cuda on a CUDA device, else the cpu tape), "cuda", "cpu", or
    #: a backend object (the :class:`~graphslot.graphs.backend.GraphBackend` protocol).
    backend: Any = "auto"
    #: The memory pool every graph is captured into: the engine's handle
    #: (``graphslot.graphs.graph_pool(device)``, ``torch.cuda.graph_pool_handle()``),
    #: shared by every runner given it; None: the backend makes its own.
    graph_pool: Any = None
    #: A zero-argument factory of context managers (sglang's ``graph_capture()``), entered
    #: once per capture session: every graph, segment and piece of one construction,
    #: ``capture_all()``, ``recapture()`` or lazy capture (:mod:`graphslot.runners.session`).
    #: A stream it yields (its ``.stream``, or the value itself) is captured on.
    #: Each call returns a fresh context manager; the runner checks it
    #: (:func:`~graphslot.runners.capture.checked_context`).
    capture_context: Optional[Callable[[], ContextManager[Any]]] = None
    #: The registry's implementation: "generated", "interpreted" or a generated module.
    impl: Any = "generated"
    #: Spec params, over the adapter's ``spec_params()``.
    params: Mapping[str, Any] = field(default_factory=dict)
    #: Progress bar over capture; None shows it on a TTY only.
    progress: Optional[bool] = None
    #: Eager runs before each capture (lazy inits, autotuning happen outside the graph);
    #: 0 to :data:`MAX_WARMUP`.
    warmup: int = 1
    #: "all": warm up before every key's capture; "largest": only before the first
    #: capture (the largest key, unless lazy) -- once lazy inits are done, a warm-up only
    #: costs time and fills the general allocator cache with that key's activations.
    warmup_sizes: str = "all"
    #: Capture a key when a step first needs it instead of all at construction: a fast
    #: start, paid for by that first step (and, captured in any order, a shared pool that
    #: may grow past the largest graph's needs). After ``release()`` steps then capture
    #: again on demand instead of running eager.
    lazy: bool = False
    #: Cap on the registry's buffer bytes (``build_registry(max_bytes=)``); None:
    #: ``GRAPHSLOT_MAX_BUFFER_BYTES``, else 4 GiB.
    max_bytes: Optional[int] = None
    #: Check before each replay that no slot buffer or static tensor moved
    #: (:mod:`graphslot.runners.guard`); None: on when ``GRAPHSLOT_DEBUG=1``.
    guard: Optional[bool] = None
    #: Where the registry's static tensors come from, as ``build_registry(buffers=)``:
    #: None allocates them; a pool (``graphslot.BufferPool``) shares them with every
    #: registry built from it (the runners of a ``ModelGraphRunner``); anything else is
    #: adopted from.
    buffers: Any = None
    #: Most graphs the runner captures: a capture that would take it past them is refused
    #: before any graph is captured, with an error naming the knobs that make keys.
    max_graphs: int = DEFAULT_MAX_GRAPHS


def registry_buffers(buffers: Any) -> Dict[str, Any]:
    """``buffers`` as ``graphslot.api.build`` takes it: ``pool=`` or ``adopt=``."""
    return {"pool": buffers} if is_pool(buffers) else {"adopt": buffers}


def runner_config(cls: Type[C], config: Optional[C], overrides: Mapping[str, Any]) -> C:
    """``config`` (default: ``cls()``) with ``overrides`` applied, its counts checked and
    made ints (:data:`COUNTS`, :data:`MOST`); an unknown name is a TypeError naming it."""
    config = dataclasses.replace(config or cls(), **overrides)
    counts = {name: checked_count(name, getattr(config, name), least, MOST.get(name))
              for name, least in COUNTS.items() if getattr(config, name, None) is not None}
    return dataclasses.replace(config, **counts)


#: The count settings of a runner's config, with the least each may be (None, where a
#: setting may be None, is left alone).
COUNTS = {"max_bs": 1, "warmup": 0, "num_tokens_per_bs": 1, "capture_bs_multiple": 1}

#: The most warm-ups before each capture: engines run one to three; many more only
#: delay the start (``warmup=10**9`` never captured).
MAX_WARMUP = 100

#: The count settings with a most, and what the error says it is.
MOST = {"warmup": (MAX_WARMUP, "eager runs before each capture")}


def checked_count(where: str, value: Any, least: int, most: Optional[Tuple[int, str]] = None) -> int:
    """``value`` as an int (anything ``operator.index`` takes: a numpy integer too); a
    TypeError naming ``where`` for a bool, a float or anything else, a ValueError below
    ``least`` or, ``most`` given as ``(most, what the setting is)``, above it."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    value = operator.index(value)
    if value < least:
        raise ValueError(f"{where} must be an int >= {least}, got {value}")
    if most is not None and value > most[0]:
        raise ValueError(f"{where} must be an int <= {most[0]} ({most[1]}), got {value}")
    return value
