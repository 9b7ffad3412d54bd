"""What the prefill graph runners share: token buckets, capture loop, replay.

A prefill runner captures the adapter's layer stack once per token bucket over the
prefill spec's token-padded buffers. The batch size is not padded: the stack never
sees it, so one graph serves batches of any number of requests. The embedding head and
the logits tail run eagerly on the live batch, and the attention metadata hook runs on
the live batch at every replay. Subclasses say only how one bucket's stack run becomes
a :class:`~graphslot.graphs.segments.SegmentedGraph` (:meth:`PrefillGraphRunner.capture_stack`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..api import build_registry
from ..graphs.backend import GraphCaptureError, get_graph_backend
from ..graphs.segments import SegmentedGraph
from ..log import PerReason, get_logger, progress_bar
from ..spec.errors import SlotError
from .batch import check_dummy_batch, describe_dummy
from .config import GraphRunnerConfig, runner_config
from .contract import check_adapter, statics
from .prefill_adapter import PrefillAdapter, resolve_layer_stack
from .report import CaptureTimer, describe_sizes

log = get_logger(__name__)

#: Eager reasons of a prefill runner (logged, per reason).
NOT_A_PREFILL = "not a prefill"
EMPTY_PREFILL = "no requests or no tokens"
TOO_MANY_REQUESTS = "more requests than max_bs"
TOO_MANY_TOKENS = "more tokens than the largest token bucket"


def default_token_buckets(max_num_tokens: int) -> List[int]:
    """sglang-like piecewise schedule: fine steps for small counts, coarser above."""
    sched = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, 1 << 20, 512)))
    return [n for n in sched if n <= max_num_tokens]


def token_buckets(max_num_tokens: int, explicit: Optional[Sequence[int]] = None) -> List[int]:
    """Buckets to capture, largest first; a default schedule also gets its cap."""
    if explicit is None:
        sizes = default_token_buckets(max_num_tokens)
        if max_num_tokens >= 1 and max_num_tokens not in sizes:
            sizes.append(max_num_tokens)
    else:
        sizes = [n for n in explicit if n >= 1]
    if not sizes:
        raise ValueError(f"no token bucket to capture (max_num_tokens={max_num_tokens}, buckets={explicit})")
    return sorted(set(int(n) for n in sizes), reverse=True)


@dataclass
class PrefillRunnerConfig(GraphRunnerConfig):
    #: Most requests one prefill batch may hold (the batch size is not padded).
    max_bs: int = 8
    #: Cap of the default bucket schedule.
    max_num_tokens: int = 256
    #: Explicit token buckets; None takes :func:`default_token_buckets`.
    token_buckets: Optional[Sequence[int]] = None


class PrefillGraphRunner:
    """Captures the layer stack per token bucket on construction (largest first)."""

    config_class = PrefillRunnerConfig
    #: Progress-bar title.
    kind = "prefill"

    def __init__(self, adapter: PrefillAdapter, config: Optional[PrefillRunnerConfig] = None, **overrides: Any):
        config = runner_config(self.config_class, config, overrides)
        #: Where the registry's buffers and the graphs live: the adapter's ``device``, else its model's.
        self.device = check_adapter(adapter, PrefillAdapter, PrefillAdapter.REQUIRED_HOOKS)
        self.adapter, self.config = adapter, config
        self.stack = resolve_layer_stack(adapter)
        self.buckets = token_buckets(config.max_num_tokens, config.token_buckets)
        self._ascending = sorted(self.buckets)
        self.max_bs = int(config.max_bs)
        # The stack's hidden input is a reset-only slot, so its address is fixed too.
        params = {**adapter.spec_params(), **config.params, "register_input_embeds": True,
                  "hidden_size": adapter.hidden_size, "embed_dtype": adapter.hidden_dtype}
        self.registry = build_registry("prefill", self.max_bs, self.buckets[0], self.device,
                                       params=params, mode=config.mode, max_bytes=config.max_bytes)
        self.backend = get_graph_backend(config.backend, self.device)
        self._side = adapter.side_inputs()
        # Before any capture: what would otherwise fail in the first capture or step.
        check_dummy_batch(adapter, self.registry, adapter.make_dummy_batch(self.buckets[0]),
                          ("is_prefill", "batch_size", "num_tokens"), "PrefillAdapter")
        self.setup()
        self.graphs: Dict[int, SegmentedGraph] = {}
        self.capture_seconds = self._capture_all()
        #: Eager fallbacks logged (INFO), per reason: the first, then every 1000th.
        self.eager_log = PerReason(log)

    def setup(self) -> None:
        """Subclass hook: runs once, after the registry and backend exist, before capture."""

    def capture_stack(self, n: int, hidden: torch.Tensor, view: Any) -> SegmentedGraph:
        """Capture one run of the layer stack on ``hidden`` (``[n, H]``) and ``view``."""
        raise NotImplementedError

    # -- capture ---------------------------------------------------------------------
    def _capture_all(self) -> float:
        self.adapter.init_graph_state(self.max_bs, self.buckets[0])
        bar = progress_bar(self.buckets, show=self.config.progress, desc=f"Capturing {self.kind} prefill graphs",
                           unit="graph", leave=False)
        buckets = f"token bucket{'s' if len(self.buckets) > 1 else ''} {describe_sizes(self.buckets)}"
        with CaptureTimer(log, f"{self.kind} prefill", buckets, self.backend.name, self.device,
                          self.registry.nbytes) as timer:
            for n in bar:
                bar.set_postfix(tokens=n)
                self.graphs[n] = self._capture_one(n)
                timer.count += 1
        return timer.seconds

    def _capture_one(self, n: int) -> SegmentedGraph:
        adapter, reg = self.adapter, self.registry
        reg.run_pre_capture(0, n, self._side)
        dummy = adapter.make_dummy_batch(n)
        try:
            reg.fill_from(dummy, 0, 0, 0, n, self._side)  # every token row is padding
            view = reg.extract(dummy, 0, n)
        except SlotError as exc:
            raise SlotError(f"capturing token bucket {n}: {describe_dummy(adapter, dummy)} does not fit spec "
                            f"'{reg.spec.name}': {exc}") from exc
        adapter.init_capture_metadata(n, view)
        try:
            return self.capture_stack(n, view.input_embeds, view)
        except GraphCaptureError as e:
            raise GraphCaptureError(f"token bucket {n}: {e}") from e

    # -- replay ----------------------------------------------------------------------
    def eager_reason(self, fb: Any) -> Optional[str]:
        """Why ``fb`` cannot replay a graph, or None when it can."""
        if not self.adapter.is_prefill(fb):
            return NOT_A_PREFILL
        bs, n = self.adapter.batch_size(fb), self.adapter.num_tokens(fb)
        if bs < 1 or n < 1:
            return EMPTY_PREFILL
        if bs > self.max_bs:
            return TOO_MANY_REQUESTS
        if n > self.buckets[0]:
            return TOO_MANY_TOKENS
        return None

    def can_run(self, fb: Any) -> bool:
        return self.eager_reason(fb) is None

    def bucket(self, fb: Any) -> int:
        n = self.adapter.num_tokens(fb)
        return self._ascending[bisect.bisect_left(self._ascending, n)]

    def prepare_replay(self, n: int, view: Any, fb: Any) -> None:
        """The per-replay metadata hook on the live batch (runs at EVERY replay)."""
        self.adapter.init_replay_metadata(n, view, fb)

    def replay(self, fb: Any) -> Any:
        """The eager tail's result for ``fb`` (e.g. logits ``[raw_tokens, vocab]``)."""
        adapter, reg = self.adapter, self.registry
        bs, raw = adapter.batch_size(fb), adapter.num_tokens(fb)
        n = self.bucket(fb)
        with torch.no_grad():
            reg.fill_from(fb, bs, bs, raw, n, self._side)
            view = reg.extract(fb, bs, n)
            view.input_embeds[:raw].copy_(adapter.embed(fb))
            self.prepare_replay(n, view, fb)
            graph = self.graphs[n]
            graph.replay()
            return adapter.logits(graph.output[:raw], fb)

    def __call__(self, fb: Any) -> Any:
        """Replay when a bucket fits, else the eager forward (logged, :attr:`eager_log`)."""
        reason = self.eager_reason(fb)
        if reason is None:
            return self.replay(fb)
        self.eager_log.log(reason, "%s prefill ran eager: %s (max_bs %d, largest token bucket %d)", self.kind,
                           reason, self.max_bs, self.buckets[0])
        return self.adapter.forward_eager(fb)

    # -- figures ---------------------------------------------------------------------
    @property
    def static_bytes(self) -> int:
        return self.registry.nbytes

    def external_inputs(self, n: int) -> List[torch.Tensor]:
        """Tensors bucket ``n``'s segments read that nothing keeps current (tape only)."""
        declared = [s.buffer for s in self.registry.active] + statics(self.adapter)
        return self.graphs[n].external_inputs(declared)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend.name} buckets={self.buckets}>"
