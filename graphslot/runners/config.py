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
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence, Type, TypeVar

C = TypeVar("C", bound="GraphRunnerConfig")


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
    #: Graph backend: "auto" (cuda on a CUDA device, else the cpu tape), "cuda", "cpu", or
    #: a backend object (the :class:`~graphslot.graphs.backend.GraphBackend` protocol).
    backend: Any = "auto"
    #: The memory pool every graph is captured into: the engine's handle
    #: (``graphslot.graphs.graph_pool(device)``, ``torch.cuda.graph_pool_handle()``),
    #: shared by every runner given it; None: the backend makes its own.
    graph_pool: Any = None
    #: A zero-argument factory of context managers entered around every capture: once per
    #: graph under "full", once per segment or piece otherwise (sglang's ``graph_capture()``).
    #: Each call returns a fresh context manager (or one that can be entered again); the
    #: runner checks it (:func:`~graphslot.runners.capture.checked_context`).
    capture_context: Optional[Callable[[], ContextManager[Any]]] = None
    #: The registry's implementation: "generated", "interpreted" or a generated module.
    impl: Any = "generated"
    #: Spec params, over the adapter's ``spec_params()``.
    params: Mapping[str, Any] = field(default_factory=dict)
    #: Progress bar over capture; None shows it on a TTY only.
    progress: Optional[bool] = None
    #: Eager runs before each capture (lazy inits, autotuning happen outside the graph).
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


def runner_config(cls: Type[C], config: Optional[C], overrides: Mapping[str, Any]) -> C:
    """``config`` (default: ``cls()``) with ``overrides`` applied; an unknown name is a
    TypeError naming it."""
    return dataclasses.replace(config or cls(), **overrides)
