"""The settings every graph runner shares, and how a runner takes its config.

:class:`GraphRunnerConfig` holds what every runner has (graph backend, registry mode,
spec params, progress bar, warm-ups, the buffer byte cap);
:class:`~graphslot.runners.decode.DecodeRunnerConfig` and
:class:`~graphslot.runners.prefill.PrefillRunnerConfig` add their own. A runner is
built from a config, keyword overrides, or both (:func:`runner_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Type, TypeVar

C = TypeVar("C", bound="GraphRunnerConfig")


@dataclass
class GraphRunnerConfig:
    #: Largest batch (requests) a graph serves.
    max_bs: int = 32
    #: Graph backend: "auto" (cuda on a CUDA device, else the cpu tape), "cuda", "cpu".
    backend: str = "auto"
    #: Registry mode: "generated", "interpreted" or a generated module.
    mode: Any = "generated"
    #: Spec params, over the adapter's ``spec_params()``.
    params: Mapping[str, Any] = field(default_factory=dict)
    #: Progress bar over capture; None shows it on a TTY only.
    progress: Optional[bool] = None
    #: Eager runs before each capture (lazy inits, autotuning happen outside the graph).
    warmup: int = 1
    #: Cap on the registry's buffer bytes (``build_registry(max_bytes=)``); None:
    #: ``GRAPHSLOT_MAX_BUFFER_BYTES``, else 4 GiB.
    max_bytes: Optional[int] = None


def runner_config(cls: Type[C], config: Optional[C], overrides: Mapping[str, Any]) -> C:
    """``config`` (default: ``cls()``) with ``overrides`` applied; an unknown name is a
    TypeError naming it."""
    return dataclasses.replace(config or cls(), **overrides)
