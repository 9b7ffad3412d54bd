"""One model, one pool: :class:`ModelGraphRunner` runs every step, full, piecewise or eager.

It composes the phase runners that exist, one per capture mode and variant, over one
model, one graph pool and one :class:`~graphslot.BufferPool` for their registries:

* ``full``: a :class:`~graphslot.runners.decode.DecodeGraphRunner` (``capture="full"``)
  per variant, for uniform decode batches;
* ``piecewise``: a :class:`~graphslot.runners.prefill.PrefillGraphRunner`
  (``capture="piecewise"``) per variant, for any token count: prefills, mixed prefill +
  decode batches, and the decode steps no full graph holds (when the prefill adapter
  takes decode batches).

The variant is realised by composition: an adapter declares ``variants`` (default
``("",)``) and ``variant(fb)``, and ``for_variant(variant)`` gives the adapter bound to one
(its forward, or layer stack, runs that variant); each variant's phase runner is built
over its bound adapter. The :class:`~graphslot.runners.dispatcher.Dispatcher` holds
every captured key (``GraphKey(size, bucket, variant)`` per mode) and is the only record
of what can replay: capture and release change it, nothing else. Per step: a
:class:`~graphslot.runners.keys.BatchDescriptor` -> ``Dispatch(mode, key, reason)`` ->
the runner of that mode and variant replays that key, or the adapter's eager forward
runs. ``runner.last_dispatch`` is the last step's choice.
"""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..graphs.backend import graph_pool as new_graph_pool
from ..log import PerReason, get_logger
from ..registry.buffers import BufferPool
from ..registry.stepcheck import describe
from .adapter import DecodeAdapter
from .config import DEFAULT_MAX_GRAPHS, runner_config
from .contract import AdapterContractError, check_adapter
from .decode import DecodeGraphRunner, DecodeRunnerConfig
from .dispatcher import EAGER, FULL, MODES, PIECEWISE, Dispatch, Dispatcher
from .graph_count import KNOBS, check_graph_count, describe_count
from .keys import BatchDescriptor, GraphKey
from .phase import FillCounter
from .prefill import PrefillGraphRunner, PrefillRunnerConfig
from .prefill_adapter import PrefillAdapter
from .session import CaptureSession

log = get_logger(__name__)

Pair = Tuple[int, Optional[int]]


def adapter_variants(adapter: Any) -> Tuple[str, ...]:
    """The variants ``adapter`` declares (``adapter.variants``), ``("",)`` when it declares none."""
    variants = getattr(adapter, "variants", ("",))
    if isinstance(variants, str) or not all(isinstance(v, str) for v in variants) or not variants:
        raise TypeError(f"{type(adapter).__name__}.variants must be a non-empty sequence of strings "
                        f"(\"\" is the base variant), got {variants!r}")
    if len(set(variants)) != len(variants):
        raise ValueError(f"{type(adapter).__name__}.variants names a variant twice: {list(variants)}")
    return tuple(variants)


def bound_adapter(adapter: Any, variant: str) -> Any:
    """The adapter whose forward (or layer stack) runs ``variant``: ``adapter.for_variant(variant)``,
    or ``adapter`` itself when it declares no variant but the base."""
    if adapter_variants(adapter) == ("",):
        return adapter
    for_variant = getattr(adapter, "for_variant", None)
    if for_variant is None:
        raise TypeError(f"{type(adapter).__name__} declares variants {list(adapter.variants)} but has no "
                        "for_variant(variant): give it one returning the adapter bound to that variant")
    try:
        return for_variant(variant)
    except Exception as exc:
        exc.add_note(f"graphslot: while binding {type(adapter).__name__} to variant {variant!r} "
                     f"(for_variant({variant!r}))")
        raise


def bound_adapters(adapter: Any, base: type) -> Dict[str, Any]:
    """Each variant of ``adapter`` -> its bound adapter (a ``base``), one object per variant: a graph
    captures its adapter's forward, so an object bound to two variants would replay one under the
    other's key. Else an error naming the adapter and the variant."""
    bound: Dict[str, Any] = {}
    for variant in adapter_variants(adapter):
        one = bound_adapter(adapter, variant)
        where = f"{type(adapter).__name__}.for_variant({variant!r})"
        if one is None:
            raise TypeError(f"{where} returned None, expected the adapter bound to variant {variant!r} "
                            f"(a {base.__name__})")
        try:
            check_adapter(one, base, base.REQUIRED_HOOKS)
        except AdapterContractError as exc:
            raise AdapterContractError(f"{where} returned {describe(one)}, not a {base.__name__}: {exc}") from None
        twin = next((other for other, seen in bound.items() if seen is one), None)
        if twin is not None:
            raise ValueError(f"{where} returned the adapter it returned for variant {twin!r}: one object cannot run "
                             "two variants (each variant's graphs capture its own adapter's forward); return a new "
                             "adapter per variant (they may share weights and state)")
        bound[variant] = one
    return bound


def captured_pairs(runner: Any) -> Set[Pair]:
    """The keys a phase runner holds graphs for, as ``(size, bucket or None)``."""
    return {(key, None) if isinstance(key, int) else (key[0], key[1]) for key in runner.graphs}


class ModelGraphRunner:
    """Full, piecewise or eager per step, over one model, pool and buffer pool.

    ``modes``: the capture modes to capture (``"full"`` needs ``decode_adapter``,
    ``"piecewise"`` ``prefill_adapter``). ``max_bs``: the most requests (both phases);
    ``max_num_tokens``: the largest piecewise token bucket. ``graph_pool``: the pool every
    graph goes into (None: one of the runner's own); ``backend``: a name or a backend
    object, shared by every phase runner; ``capture_context``: the engine's, entered
    around every graph or piece; ``buffers``: where the registries' static tensors come
    from (None: one new ``BufferPool``, shared by all). ``decode_config`` /
    ``prefill_config``: the phase runners' other settings (capture sizes, context
    buckets, token buckets...); the arguments here override theirs. ``max_graphs``: the
    most graphs, every mode and variant together; more is refused before any capture.
    ``defer_capture``: capture nothing yet; :meth:`capture` does.
    """

    def __init__(self, decode_adapter: Optional[DecodeAdapter], prefill_adapter: Optional[PrefillAdapter], *,
                 modes: Sequence[str] = MODES, max_bs: int = 32, max_num_tokens: int = 256,
                 graph_pool: Any = None, backend: Any = "auto",
                 capture_context: Optional[Callable[[], ContextManager[Any]]] = None,
                 max_graphs: int = DEFAULT_MAX_GRAPHS, buffers: Any = None,
                 decode_config: Optional[DecodeRunnerConfig] = None,
                 prefill_config: Optional[PrefillRunnerConfig] = None,
                 defer_capture: bool = False, progress: Optional[bool] = None):
        self.modes = self._check_modes(modes, decode_adapter, prefill_adapter)
        self.decode_adapter = decode_adapter
        self.prefill_adapter = prefill_adapter
        first = decode_adapter if FULL in self.modes else prefill_adapter
        self.device = check_adapter(first, DecodeAdapter if FULL in self.modes else PrefillAdapter, ())
        own_pool = graph_pool is None and isinstance(backend, str)
        if graph_pool is None:
            graph_pool = new_graph_pool(self.device) if isinstance(backend, str) else backend.pool
        #: The pool every graph of every phase runner is captured into.
        self.graph_pool = graph_pool
        self._own_pool = own_pool
        self.max_graphs = max_graphs
        shared = dict(backend=backend, graph_pool=graph_pool, capture_context=capture_context, max_graphs=max_graphs,
                      buffers=BufferPool() if buffers is None else buffers, max_bs=max_bs, lazy=False)
        if progress is not None:
            shared["progress"] = progress
        #: The phase runner of each ``(mode, variant)``, none captured yet.
        self.runners: Dict[Tuple[str, str], Any] = {}
        if PIECEWISE in self.modes:  # first: the larger token count sizes the shared attention metadata
            config = runner_config(PrefillRunnerConfig, prefill_config,
                                   dict(shared, capture="piecewise", max_num_tokens=max_num_tokens))
            self._add_runners(PIECEWISE, PrefillGraphRunner, prefill_adapter, config)
        if FULL in self.modes:
            config = runner_config(DecodeRunnerConfig, decode_config, dict(shared, capture="full"))
            self._add_runners(FULL, DecodeGraphRunner, decode_adapter, config)
        fills = FillCounter()  # one set of buffers (the BufferPool) and one model state: a stage on any runner
        for runner in self.runners.values():  # makes every step staged before stale
            runner.fill_counter = fills
        full = [runner for (mode, _), runner in self.runners.items() if mode == FULL]
        self._full_k = full[0].k if full else None
        self._bucketed = bool(full) and full[0].bucketed
        self._reader = prefill_adapter if prefill_adapter is not None else decode_adapter
        #: The adapter whose ``variant(fb)`` is read (the decode adapter's, else the prefill adapter's), or None.
        self._variant_owner = next((a for a in (decode_adapter, prefill_adapter) if hasattr(a, "variant")), None)
        #: The captured keys of every mode: what can replay.
        self.dispatcher = Dispatcher()
        self._keys: Dict[Tuple[str, str], Set[GraphKey]] = {}
        #: The last step's choice (None before the first step).
        self.last_dispatch: Optional[Dispatch] = None
        self._replays: Counter = Counter()
        self._variants: Counter = Counter()
        self._eager: Counter = Counter()
        self.eager_log = PerReason(log)
        if not defer_capture:
            self.capture()

    def _add_runners(self, mode: str, cls: type, adapter: Any, config: Any) -> None:
        """One deferred ``cls`` runner per variant of ``adapter``, over its bound adapter."""
        base = DecodeAdapter if mode == FULL else PrefillAdapter
        for variant, bound in bound_adapters(adapter, base).items():
            self.runners[(mode, variant)] = cls(bound, config, defer_capture=True)

    @staticmethod
    def _check_modes(modes: Sequence[str], decode_adapter: Any, prefill_adapter: Any) -> Tuple[str, ...]:
        modes = tuple(modes)
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            raise ValueError(f"modes must name one or more of: {', '.join(MODES)}; got {list(modes)}")
        if FULL in modes and decode_adapter is None:
            raise ValueError("mode 'full' needs a decode adapter (decode_adapter is None): pass one, "
                             "or modes=('piecewise',)")
        if PIECEWISE in modes and prefill_adapter is None:
            raise ValueError("mode 'piecewise' needs a prefill adapter (prefill_adapter is None): pass one, "
                             "or modes=('full',)")
        return modes

    # -- capture ---------------------------------------------------------------------
    def planned(self) -> Dict[Tuple[str, str], List[Pair]]:
        """Every key each phase runner captures, by ``(mode, variant)``."""
        return {where: list(runner.graph_keys) for where, runner in self.runners.items()}

    def describe_plan(self) -> str:
        """The graphs to capture in words, by mode and variant: ``"full: 4 batch sizes x 2
        variants ('', 'lora') = 8; piecewise: ..."``."""
        parts = []
        for mode in self.modes:
            plans = {variant: keys for (m, variant), keys in self.planned().items() if m == mode}
            runner = next(r for (m, _), r in self.runners.items() if m == mode)
            per_variant = describe_count(next(iter(plans.values())), *runner.key_words)
            names = ", ".join(repr(v) for v in plans)
            count = sum(len(keys) for keys in plans.values())
            plural = "s" if len(plans) != 1 else ""
            parts.append(f"{mode}: {per_variant} x {len(plans)} variant{plural} ({names}) = {count}")
        return "; ".join(parts)

    @property
    def static_bytes(self) -> int:
        """Bytes of the registries' static buffers, each shared storage once."""
        storages = {}
        for runner in self.runners.values():
            for slot in runner.registry.active:
                storage = slot.buffer.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def capture(self) -> None:
        """Capture every key not captured yet, every mode and variant, after counting them
        all: more than ``max_graphs`` is refused before any graph is captured."""
        count = sum(len(keys) for keys in self.planned().values())
        knobs = [knob for mode, phase in ((FULL, "decode"), (PIECEWISE, "prefill")) if mode in self.modes
                 for knob in KNOBS[phase]] + ["the adapters' variants"]
        plan = self.describe_plan()
        check_graph_count(count, self.max_graphs, f"ModelGraphRunner ({plan})", knobs, lazy_hint=False)
        with self._session(plan, count):
            try:
                for runner in self.runners.values():
                    runner.capture_all()
            finally:  # cut short: the dispatcher holds what was captured
                self._sync_all()

    def _session(self, plan: str, count: int) -> CaptureSession:
        """One capture session for every mode and variant: the engine's context is entered
        once, and each runner's own session joins this one."""
        first = next(iter(self.runners.values()))
        return CaptureSession(context=first._capture_context, backend=first.backend, device=self.device, log=log,
                              what="model", keys=plan, graphs=count, static_bytes=self.static_bytes)

    def _check_lifecycle(self, call: str) -> None:
        """Raise before any runner acts when one of them refuses ``call`` now (a step or a
        capture of it is in progress): a refused call changes no runner."""
        for runner in self.runners.values():
            runner.check_lifecycle_call(call)

    def _sync_all(self) -> None:
        for where in self.runners:
            self._sync(where)

    def _sync(self, where: Tuple[str, str]) -> None:
        """The dispatcher's keys of ``where`` made what its runner holds."""
        mode, variant = where
        now = {GraphKey(a, b, variant) for a, b in captured_pairs(self.runners[where])}
        was = self._keys.get(where, set())
        if was - now:
            self.dispatcher.remove(mode, *(was - now))
        if now - was:
            self.dispatcher.add(mode, *(now - was))
        self._keys[where] = now

    def release(self) -> None:
        """Drop every graph of every mode and variant (steps then run eager, ``"no graphs
        captured"``); the runner's own pool's memory goes back. Buffers stay put. Between
        steps only: during a step it raises, and no runner is released."""
        self._check_lifecycle("release()")
        try:
            for runner in self.runners.values():
                runner.release_graphs()
        finally:
            self._sync_all()
        if self._own_pool and self.device.type == "cuda":
            gc.collect()  # graphs in reference cycles hold their pool's blocks
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def recapture(self) -> None:
        """Capture again every key captured before (or before :meth:`release`), after the
        weights, a LoRA or the KV cache changed, in one capture session. Between steps only:
        during a step it raises, and no runner is touched. Cut short by an error, it leaves
        every runner released (no graph from before the call replays); the next
        :meth:`recapture` captures every key again."""
        self._check_lifecycle("recapture()")
        count = sum(len(runner.recapture_keys) for runner in self.runners.values())
        try:
            for runner in self.runners.values():  # all first: cut short, no runner keeps a graph from before
                runner.release_graphs()
            with self._session(self.describe_plan(), count):
                for runner in self.runners.values():
                    runner.recapture_graphs()
        finally:
            self._sync_all()

    # -- a step ------------------------------------------------------------------------
    def describe(self, fb: Any) -> BatchDescriptor:
        """``fb`` as the dispatcher sees it."""
        num_reqs = self._reader.batch_size(fb)
        uniform = (self._full_k is not None and num_reqs >= 1
                   and self.decode_adapter.tokens_per_bs(fb) == self._full_k)
        context = self.decode_adapter.context_len(fb) if uniform and self._bucketed else None
        owner = self._variant_owner
        variant = "" if owner is None else owner.variant(fb)
        if not isinstance(variant, str):
            raise TypeError(f"{type(owner).__name__}.variant(fb) must return a str (one of its variants "
                            f"{list(adapter_variants(owner))}), got {variant!r} ({type(variant).__name__})")
        return BatchDescriptor(self._reader.num_tokens(fb), num_reqs, uniform, context, variant)

    def dispatch(self, fb: Any) -> Dispatch:
        """What ``fb`` runs: the dispatcher's pick, unless that key's runner declines the
        batch (its ``eager_reason``: a batch its adapter does not take, say)."""
        return self._decide(fb)[1]

    def _decide(self, fb: Any) -> Tuple[BatchDescriptor, Dispatch]:
        desc = self.describe(fb)
        choice = self.dispatcher.dispatch(desc)
        if choice.mode == EAGER:
            return desc, choice
        reason = self.runners[(choice.mode, choice.key.variant)].eager_reason(fb)
        return desc, choice if reason is None else Dispatch(EAGER, None, reason)

    def __call__(self, fb: Any) -> Any:
        """The step's outputs: a replay of the dispatched key, or the eager forward (the
        decode adapter's for a uniform batch, else the prefill adapter's)."""
        desc, choice = self._decide(fb)
        self.last_dispatch = choice
        if choice.mode == EAGER:
            self._eager[choice.reason] += 1
            self.eager_log.log(choice.reason, "step ran eager: %s", choice.reason)
            uniform = desc.uniform or self.prefill_adapter is None
            return (self.decode_adapter if uniform else self.prefill_adapter).forward_eager(fb)
        key = choice.key
        runner = self.runners[(choice.mode, key.variant)]
        self._replays[choice.mode] += 1
        self._variants[key.variant] += 1
        if choice.mode == FULL:
            step = runner.prepare(fb, longest=desc.context)
            self._agree(choice, (step.bs, step.context))
            return runner.launch(step)
        self._agree(choice, (runner.bucket(fb), runner.request_slots(fb)))
        return runner.replay(fb)

    @staticmethod
    def _agree(choice: Dispatch, picked: Pair) -> None:
        if picked != (choice.key.size, choice.key.bucket):
            raise RuntimeError(f"the {choice.mode} runner would replay {picked}, the dispatcher chose {choice.key}: "
                               "their keys differ (a phase runner captured or released outside the ModelGraphRunner?)")

    # -- figures ---------------------------------------------------------------------
    def metrics(self) -> Dict[str, Any]:
        """Steps, replays per mode and per variant, eager steps by reason, graphs per mode."""
        eager = sum(self._eager.values())
        replays = {mode: self._replays[mode] for mode in self.modes}
        return {
            "steps": sum(replays.values()) + eager,
            "replays": replays,
            "replays_per_variant": dict(sorted(self._variants.items())),
            "eager_fallbacks": eager,
            "eager_reasons": dict(self._eager.most_common()),
            "graphs": {mode: len(self.dispatcher.keys(mode)) for mode in self.modes},
        }

    def __repr__(self) -> str:
        graphs = ", ".join(f"{mode}={len(self.dispatcher.keys(mode))}" for mode in self.modes)
        variants = sorted({variant for _, variant in self.runners})
        return f"<ModelGraphRunner graphs: {graphs} variants={variants} backend pool={type(self.graph_pool).__name__}>"
