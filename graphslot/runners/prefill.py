"""The prefill graph runner: the layer stack, one graph per token bucket, in any capture mode.

The runner captures the adapter's layer stack over the prefill spec's token-padded
buffers, keyed by ``(tokens, requests)``. The embedding head and the logits tail run
eagerly on the live batch, and the attention metadata hook runs on the live batch at
every replay. How a graph is made is the capture mode's (:mod:`.capture`):

* ``breakable`` and ``piecewise``: attention runs eagerly between segments or pieces,
  so a graph never sees the request count: ``requests`` is None and one graph serves
  batches of any number of requests (the batch size is not padded);
* ``full``: attention is inside the graph, reading metadata the hooks write into static
  buffers sized by request slots, so a graph is also keyed by the padded request count
  (``request_buckets``), the request slots past the batch being zero-length rows (as
  sglang pads them); the view the hooks get has ``batch_size`` = the padded count.

The step path is every phase runner's (:class:`~graphslot.runners.step.StepPath`):
observers after the fill, the replay guard (``guard=True`` or ``GRAPHSLOT_DEBUG=1``),
``metrics()`` and ``histogram`` (counted in tokens: replays per token bucket, padded
tokens, eager fallbacks by reason, the raw token counts served), and the audit hooks of
``graphslot verify`` (which poisons the token tails). :meth:`PrefillGraphRunner.stage`
then :meth:`PrefillGraphRunner.launch` split a replay as decode's do.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..api import build
from ..graphs.backend import Graph, GraphBackend, GraphCaptureError
from ..log import get_logger
from ..spec.errors import SlotError
from .batch import check_dummy_batch, describe_dummy
from .config import GraphRunnerConfig, registry_buffers, runner_config
from .contract import check_adapter
from .dispatch import capture_sizes, positive_ints
from .phase import RELEASED, PhaseRunner
from .prefill_adapter import PrefillAdapter, resolve_layer_stack
from .step import FillShape

log = get_logger(__name__)

#: Eager reasons of a prefill runner (logged, per reason).
NOT_A_PREFILL = "not a prefill"
EMPTY_PREFILL = "no requests or no tokens"
TOO_MANY_REQUESTS = "more requests than max_bs"
BEYOND_REQUEST_BUCKETS = "more requests than the largest request bucket"
TOO_MANY_TOKENS = "more tokens than the largest token bucket"


def default_token_buckets(max_num_tokens: int) -> List[int]:
    """sglang-like piecewise schedule: fine steps for small counts, coarser above."""
    sched = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, 1 << 20, 512)))
    return [n for n in sched if n <= max_num_tokens]


def token_buckets(max_num_tokens: int, explicit: Optional[Sequence[int]] = None) -> List[int]:
    """Buckets to capture, largest first, duplicates merged; a default schedule also gets
    its cap. Explicit buckets must be ints >= 1 (a TypeError or ValueError naming
    ``token_buckets`` and the value otherwise); ``max_num_tokens`` caps only the default."""
    if explicit is None:
        sizes = default_token_buckets(max_num_tokens)
        if max_num_tokens >= 1 and max_num_tokens not in sizes:
            sizes.append(max_num_tokens)
    else:
        sizes = positive_ints("token_buckets", explicit)
    if not sizes:
        raise ValueError(f"no token bucket to capture (max_num_tokens={max_num_tokens}, buckets={explicit})")
    return sorted(set(int(n) for n in sizes), reverse=True)


@dataclass
class PrefillRunnerConfig(GraphRunnerConfig):
    #: Most requests one prefill batch may hold.
    max_bs: int = 8
    #: The prefill slot spec: a shipped name, a YAML path or a loaded RegistrySpec.
    spec: Any = "prefill"
    #: Cap of the default bucket schedule.
    max_num_tokens: int = 256
    #: Explicit token buckets; None takes :func:`default_token_buckets`.
    token_buckets: Optional[Sequence[int]] = None
    #: ``capture="full"`` only: the padded request counts a graph is keyed by too; None:
    #: the default ladder up to ``max_bs`` (:func:`~graphslot.runners.dispatch.capture_sizes`).
    request_buckets: Optional[Sequence[int]] = None


class PreparedPrefill(NamedTuple):
    """A prefill batch staged in its graph's buffers (:meth:`PrefillGraphRunner.stage`)."""

    graph: Any
    batch: Any
    raw_tokens: int
    #: The token bucket replayed.
    tokens: int
    #: The tokens counted in the metrics; None: not counted.
    needed: Optional[int]
    #: The runner's :attr:`~graphslot.runners.phase.PhaseRunner.generation` when staged.
    generation: int = 0
    #: Which fill of the runner's buffers this step's is (:attr:`~graphslot.runners.phase.PhaseRunner.fills`).
    fill: int = 0


class PrefillGraphRunner(PhaseRunner):
    """Captures the layer stack per key on construction (largest first), or, ``lazy``,
    each key when a batch first needs it; ``runner(fb)`` replays or runs eager."""

    phase = "prefill"
    size_unit = "tokens"
    key_words = ("token bucket", "request slots")
    _log = log

    def __init__(self, adapter: PrefillAdapter, config: Optional[PrefillRunnerConfig] = None, *,
                 defer_capture: bool = False, **overrides: Any):
        """``defer_capture``: capture nothing yet, :meth:`capture_all` does."""
        config = runner_config(PrefillRunnerConfig, config, overrides)
        #: Where the registry's buffers and the graphs live: the adapter's ``device``, else its model's.
        self.device = check_adapter(adapter, PrefillAdapter, PrefillAdapter.REQUIRED_HOOKS)
        self.adapter = adapter
        self.config = config
        self.stack = resolve_layer_stack(adapter)
        self.buckets = token_buckets(config.max_num_tokens, config.token_buckets)
        self._ascending = sorted(self.buckets)
        self.max_bs = int(config.max_bs)
        # The stack's hidden input is a reset-only slot, so its address is fixed too.
        params = {**adapter.spec_params(), **config.params, "register_input_embeds": True,
                  "hidden_size": adapter.hidden_size, "embed_dtype": adapter.hidden_dtype}
        self.registry = build(config.spec, max_bs=self.max_bs, max_num_tokens=self.buckets[0], device=self.device,
                                       params=params, impl=config.impl, max_bytes=config.max_bytes,
                                       **registry_buffers(config.buffers))
        self._init_graphs(config, adapter.split_ops)
        #: ``capture="full"``: the request-slot counts a graph is keyed by, largest first; None otherwise.
        self.request_buckets: Optional[List[int]] = None
        if self.capture_mode.name == "full":
            self.request_buckets = capture_sizes(self.max_bs, config.request_buckets, name="request_buckets")
        self._requests_ascending = sorted(self.request_buckets or [self.max_bs])
        #: What every graph runs: the layer stack, or (piecewise) it compiled to split at the split ops.
        self.captured_fn = self.capture_mode.compile(self.stack)
        self._side = adapter.side_inputs()
        # Before any capture: what would otherwise fail in the first capture or step.
        check_dummy_batch(adapter, self.registry, adapter.make_dummy_batch(self.buckets[0]),
                          ("is_prefill", "batch_size", "num_tokens"), "PrefillAdapter")
        adapter.init_graph_state(self.max_bs, self.buckets[0])
        self._init_step_path(config.guard, log)
        if not (config.lazy or defer_capture):
            self._capture_keys(self.graph_keys)

    @property
    def graph_keys(self) -> List[Tuple[int, Optional[int]]]:
        """Every ``(token bucket, request slots or None)`` captured (lazy: capturable), largest first."""
        return [(n, r) for n in self.buckets for r in (self.request_buckets or [None])]

    # -- capture ---------------------------------------------------------------------
    def _check_key(self, n: int, requests: Optional[int]) -> None:
        if n not in self.buckets:
            raise KeyError(f"token bucket {n} is not among the runner's buckets {self.buckets}")
        if requests not in (self.request_buckets or [None]):
            raise KeyError(f"request slots {requests!r} are not among the runner's request buckets "
                           f"{self.request_buckets}")

    def capture_key_on(self, backend: GraphBackend, n: int, requests: Optional[int] = None, *,
                       warmup: int = 0) -> Tuple[Graph, Any]:
        """Token bucket ``n`` (at ``requests`` request slots, ``capture="full"``) captured
        on ``backend``: ``(graph, view)``, ``view`` being the staged dummy batch."""
        adapter = self.adapter
        reg = self.registry
        rows = requests or 0
        reg.run_pre_capture(rows, n, self._side)
        dummy = adapter.make_dummy_batch(n)
        try:  # every row is padding
            reg.fill_from(dummy, raw_bs=0, padded_bs=rows, raw_num_tokens=0, padded_num_tokens=n,
                          side_inputs=self._side)
            view = reg.extract(dummy, padded_bs=rows, padded_num_tokens=n)
        except SlotError as exc:
            raise SlotError(f"capturing token bucket {n}: {describe_dummy(adapter, dummy)} does not fit spec "
                            f"'{reg.spec.name}': {exc}") from exc
        adapter.init_capture_metadata(n, view)
        self.capture_mode.mark_rows(view, reg)
        hidden = view.input_embeds
        stack = self.captured_fn

        def run() -> Any:
            with torch.no_grad():
                return adapter.run_layer_stack(stack, hidden, view)

        try:
            return self._capture(backend, run, warmup), view
        except GraphCaptureError as e:
            raise GraphCaptureError(f"token bucket {n}: {e}") from e

    # -- replay ----------------------------------------------------------------------
    def eager_reason(self, fb: Any) -> Optional[str]:
        """Why ``fb`` cannot replay a graph, or None when it can."""
        if not self.adapter.is_prefill(fb):
            return NOT_A_PREFILL
        bs = self.adapter.batch_size(fb)
        n = self.adapter.num_tokens(fb)
        if bs < 1 or n < 1:
            return EMPTY_PREFILL
        if bs > self.max_bs:
            return TOO_MANY_REQUESTS
        if bs > self._requests_ascending[-1]:
            return BEYOND_REQUEST_BUCKETS
        if n > self.buckets[0]:
            return TOO_MANY_TOKENS
        return RELEASED if self.released else None

    def bucket(self, fb: Any) -> int:
        n = self.adapter.num_tokens(fb)
        return self._ascending[bisect.bisect_left(self._ascending, n)]

    def request_slots(self, fb: Any) -> Optional[int]:
        """The padded request count ``fb``'s graph is keyed by (``capture="full"``), else None."""
        if self.request_buckets is None:
            return None
        return self._requests_ascending[bisect.bisect_left(self._requests_ascending, self.adapter.batch_size(fb))]

    def prepare_replay(self, n: int, view: Any, fb: Any) -> None:
        """The per-replay metadata hook on the live batch (runs at EVERY replay)."""
        self.adapter.init_replay_metadata(n, view, fb)

    def replay(self, fb: Any, *, count: bool = True) -> Any:
        """The eager tail's result for ``fb`` (e.g. logits ``[raw_tokens, vocab]``).
        ``count=False``: kept out of :meth:`metrics` and the histogram. :meth:`stage`
        then :meth:`launch`."""
        return self.launch(self.stage(fb, count=count))

    def stage(self, fb: Any, *, count: bool = True) -> PreparedPrefill:
        """Stage ``fb`` for its graph: a lazy capture, the fill, the observers, extract, the
        embedding head, the replay metadata and the guard, so that :meth:`launch` only
        replays and runs the tail. Nothing else may fill or replay in between."""
        adapter = self.adapter
        reg = self.registry
        bs = adapter.batch_size(fb)
        raw = adapter.num_tokens(fb)
        n = self.bucket(fb)
        requests = self.request_slots(fb)
        rows = bs if requests is None else requests
        self._next_fill()  # from here on the buffers are this step's: a step staged before is stale
        with self._in_step():  # from the graph's fetch to its replay, release() and recapture() refuse
            graph = self.graph(n, requests)  # before the fill: a lazy capture fills the buffers with its dummy batch
            with torch.no_grad():
                reg.fill_from(fb, raw_bs=bs, padded_bs=rows, raw_num_tokens=raw, padded_num_tokens=n,
                              side_inputs=self._side)
                self._filled(FillShape(bs, rows, raw, n))
                view = reg.extract(fb, padded_bs=rows, padded_num_tokens=n)
                view.input_embeds[:raw].copy_(adapter.embed(fb))
                self.prepare_replay(n, view, fb)
            self._check_guard()
        return PreparedPrefill(graph, fb, raw, n, raw if count else None, self.generation, self.fills)

    def launch(self, step: PreparedPrefill) -> Any:
        """Replay a step :meth:`stage` staged and run the eager tail on its raw tokens. A
        RuntimeError when the runner was released or recaptured since, or its buffers were
        filled again (stage it again)."""
        with torch.no_grad():
            self._replay_staged(step.graph, step.generation, step.fill)
            if step.needed is not None:
                self.stats.replayed(step.raw_tokens, step.tokens, step.needed)
            return self.adapter.logits(step.graph.output[:step.raw_tokens], step.batch)

    def __call__(self, fb: Any) -> Any:
        """Replay when a bucket fits, else the eager forward (counted in :meth:`metrics`,
        logged, :attr:`eager_log`)."""
        reason = self.eager_reason(fb)
        if reason is None:
            return self.replay(fb)
        needed = None if reason in (NOT_A_PREFILL, EMPTY_PREFILL) else self.adapter.num_tokens(fb)
        self._record_eager(reason, needed, "%s ran eager: %s (max_bs %d, largest token bucket %d)", self.what,
                           reason, self.max_bs, self.buckets[0])
        return self.adapter.forward_eager(fb)

    # -- the audit hooks -------------------------------------------------------------
    @property
    def verify_sizes(self) -> List[int]:
        """The token buckets."""
        return self.buckets

    def step_size(self, fb: Any) -> int:
        return self.adapter.num_tokens(fb)

    def padded_size(self, fb: Any) -> int:
        return self.bucket(fb)

    def __repr__(self) -> str:
        requests = "" if self.request_buckets is None else f" requests={self.request_buckets}"
        return (f"<PrefillGraphRunner capture={self.capture_mode.name} backend={self.backend.name} "
                f"buckets={self.buckets}{requests}>")
