"""A small continuous-batching driver: requests join and leave, decode goes through graphs.

Each :meth:`ContinuousBatcher.step` prefills the requests admitted this step (eager)
and decodes every running request by one token through the :class:`DecodeGraphRunner`,
or, with ``mix_prefill`` (the CPU's default), runs both as one packed eager forward;
tokens are picked on the device per request (:mod:`.computing`). A request leaves when
it has ``max_new_tokens`` tokens, draws one of its stop tokens (EOS; kept in its
output, as generate keeps it) or is aborted.

A step is all or nothing. It computes first (admission, prefill, decode, sampling) into
local results, taking the rows and slots it needs from the pool, and only then commits
them to the requests, in one place that cannot fail halfway. When anything raises on
the way (the model, the runner, the sampler or ``sample``, a check of what ``sample``
returned), the rows and slots go back (what the step wrote to the KV pool went to them,
so nothing reads it), the requests it admitted stay at the head of the waiting queue,
no request changes, and the exception propagates: calling ``step()`` again gives the
tokens an uninterrupted run gives (a seeded draw is a function of the request's seed and
token index, so a retry draws the same); unless one request alone is to blame, which is
then dropped and the step computed without it (:mod:`.recovery`). Streaming callbacks
run after the commit.

:meth:`~ContinuousBatcher.add_request` and :meth:`~ContinuousBatcher.abort` take a lock
and may be called from any thread, and from ``sample``: an abort while a step runs takes
effect at the step's end (the request keeps that step's tokens and gets no more).
``step()`` itself runs in one thread at a time. Requests and arguments are checked up
front: token ids are integers in the model's vocabulary, counts are ints >= 1, sampling
parameters within their ranges; each refusal names the argument.

Host bookkeeping (rows, slots, lengths) stays in Python lists, so building a step reads
nothing from the device; the step's one read is its tokens (:func:`.sampling.to_host`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from ...graphs.cuda import CudaGraphBackend
from ...runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from . import rope
from .adapter import HFDecodeAdapter, check_model
from .budget import Allocations, check_decode_graphs, pool_size
from .cache import PagedCache, kv_geometry
from .checks import count, flag, stop_ids, token_ids
from .computing import Computing
from .driving import Driving
from .families import packs
from .forward import forward_takes
from .generation import generation_settings
from .geometry import bytes_per_slot, text_config
from .requests import FINISH_ABORT, Pending, Request, StepOutput, TokenEvent, notify, reentered
from .picking import Picking
from .recovery import Recovery
from .sampling import Sampler, check_seed, generation_defaults, model_eos, request_seed


class ContinuousBatcher(Computing, Driving, Picking, Recovery):
    """Decode a stream of requests with a transformers causal LM through graphs.

    * ``max_bs`` caps the running batch and the captured sizes; ``max_requests``
      (default ``max_bs``) sizes the request pool; their graphs must fit the free memory
      beside the KV budget, checked first (:func:`.budget.check_decode_graphs`).
    * The KV pool takes ``kv_cache_bytes`` (pool and request table; default: a share of
      the device's free memory, at most ``GRAPHSLOT_MAX_KV_BYTES``; :mod:`.budget`).
      ``max_context_len`` (prompt plus new tokens of one request) defaults to
      ``min(max_position_embeddings, num_slots - 1)``; requests wait until the pool can
      hold all their tokens.
    * ``eos_token_id``: ids that end every request (kept in its output); default: the
      model's, as generate; ``()`` for none. A request may give its own.
    * Sampling is per request (:meth:`add_request`); the parameters a request leaves
      unset take the model's ``generation_config``, over generate's defaults (greedy;
      sampling is at temperature 1 with top_k 50). ``seed`` seeds the requests that give
      none (default: drawn from torch's global generator, so ``torch.manual_seed`` makes
      a run repeatable).
    * ``sample``: an escape hatch, ``sample(scores [rows, vocab]) -> token ids`` for every
      row of every step instead of the built-in sampler. It gets float32 scores with the
      ``min_new_tokens`` masks applied, its ids are read on the host (a read per call),
      and requests cannot set sampling parameters then. It may be set or changed
      between steps (``engine.sample = fn``; None: the built-in sampler).
    * ``mix_prefill`` (default: True on the CPU): see :mod:`.computing`; where the
      family cannot pack (:func:`.families.packs`) or a request wants its prompt
      logprobs, the step prefills apart. The tokens are the same either way.
    * Runner options (``backend``, ``impl``, ``capture_bs``, ...) go to :class:`DecodeRunnerConfig`;
      ``context_buckets`` is ``"auto"`` here. On a GPU the backend asks for a fresh cuBLAS
      workspace: torch.compile's CUDAGraph Trees may share the process.

    Thread safety: :meth:`add_request` and :meth:`abort` hold ``self._lock`` while they
    change the queue, so other threads (and ``sample``) may call them while a step runs;
    :meth:`step` holds it only at its start and to commit. One thread at a time steps.
    """

    def __init__(self, model: Any, *, max_bs: int = 8, max_context_len: Optional[int] = None,
                 max_requests: Optional[int] = None, kv_cache_bytes: Optional[int] = None,
                 eos_token_id: Any = None, sample: Optional[Callable[[torch.Tensor], Any]] = None,
                 seed: Optional[int] = None, mix_prefill: Optional[bool] = None, allow_untested: bool = False,
                 **runner_options: Any):
        config = model.config
        where = "ContinuousBatcher"
        max_bs = count(max_bs, "max_bs", where)
        max_requests = max_bs if max_requests is None else count(max_requests, "max_requests", where)
        max_context_len = None if max_context_len is None else count(max_context_len, "max_context_len", where)
        kv_cache_bytes = None if kv_cache_bytes is None else count(kv_cache_bytes, "kv_cache_bytes", where)
        self.vocab_size: int = text_config(config).vocab_size
        #: The ids that end a request by default (sorted; empty: none).
        self.eos_token_ids: Tuple[int, ...] = (model_eos(model, self.vocab_size) if eos_token_id is None else
                                               stop_ids(eos_token_id, self.vocab_size, f"{where}: eos_token_id"))
        self.defaults = generation_defaults(model)
        #: What the model's generation_config blocks (its settings that would change generate's tokens and are
        #: not applied are refused here: :mod:`.generation`).
        self.generation = generation_settings(model, self.vocab_size)
        self.min_new_tokens = count(getattr(getattr(model, "generation_config", None), "min_new_tokens", None) or 0,
                                    "min_new_tokens", "model.generation_config", minimum=0)
        self.seed = (int(torch.empty((), dtype=torch.int64).random_().item()) if seed is None
                     else check_seed(seed, where))
        device = torch.device(model.device)
        check_model(model, allow_untested, max_context_len)  # before the probe runs the model
        runner_options = {"progress": False, "context_buckets": "auto", **runner_options}
        if device.type == "cuda" and runner_options.get("backend", "auto") in ("auto", "cuda"):
            runner_options["backend"] = CudaGraphBackend(device, pool=runner_options.pop("graph_pool", None),
                                                         fresh_cublas_workspace=True)
        runner_config = DecodeRunnerConfig(max_bs=max_bs, **runner_options)
        #: What each layer caches per token (one eager forward of one token): the pool's slots and their bytes.
        with Allocations() as made:
            self.geometry = kv_geometry(model)
        per_slot = bytes_per_slot(self.geometry, model.dtype)
        #: The pool's size and the budget it came from.
        self.kv_budget = pool_size(per_slot, device, max_requests=max_requests, max_context_len=max_context_len,
                                   kv_cache_bytes=kv_cache_bytes,
                                   positions=getattr(text_config(config), "max_position_embeddings", None))
        check_decode_graphs(device, self.kv_budget, runner_config, max_requests, made.bytes, per_slot)
        self.model = model
        self.sample = sample
        self.max_bs = max_bs
        self.sampler = Sampler()
        self.cache = PagedCache(config, max_requests=max_requests, max_context_len=self.kv_budget.max_context_len,
                                num_slots=self.kv_budget.num_slots, dtype=model.dtype, device=device,
                                geometry=self.geometry)
        self.adapter = HFDecodeAdapter(model, self.cache, allow_untested=allow_untested)
        #: Prefill asks the model for the last position's logits only (``logits_to_keep``);
        #: False for a model without it (all positions' logits are computed, the last used).
        self.last_logits_only = forward_takes(model, "logits_to_keep")
        #: A step that admits requests while others run packs both in one eager forward (:meth:`_mixed`).
        mix_prefill = flag(mix_prefill, "mix_prefill", where, allow_none=True)
        self.mix_prefill = ((device.type == "cpu" if mix_prefill is None else mix_prefill)
                            and self.last_logits_only and packs(self.cache.config) and not rope.plan(model))
        self.runner = DecodeGraphRunner(self.adapter, runner_config)
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.requests: Dict[int, Request] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stepping = False
        self._notifying = False  # the step's on_token callbacks run
        self._aborts: Dict[int, None] = {}  # rids aborted while the step runs, in order

    # -- requests --------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, do_sample: Optional[bool] = None,
                    temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                    seed: Optional[int] = None, min_new_tokens: Optional[int] = None, eos_token_id: Any = None,
                    stop_token_ids: Sequence[int] = (), logprobs: bool = False, top_logprobs: int = 0,
                    prompt_logprobs: bool = False, on_token: Optional[Callable[[TokenEvent], Any]] = None) -> Request:
        """Queue a request; it is prefilled at the next step with room for it.

        * Sampling: ``do_sample`` (None: sample when ``temperature``, ``top_k``, ``top_p``
          or ``seed`` is given, else the model's default), ``temperature`` (0: greedy;
          else at least ``sampling.MIN_TEMPERATURE``, about 1.18e-38), ``top_k`` (0:
          off), ``top_p`` (1: off), ``seed`` (default: from the engine's seed and the
          request id). Unset ones take the engine's defaults.
        * Stopping: ``max_new_tokens``; ``eos_token_id`` (an id or ids; None: the engine's;
          ``()``: none) and ``stop_token_ids`` end the request, the token kept in its
          output; ``min_new_tokens`` (default: the model's, else 0) masks them until the
          output has that many tokens.
        * ``logprobs``: record each output token's logprob in ``Request.logprobs``;
          ``top_logprobs=n``: and the n most likely in ``Request.top_logprobs``;
          ``prompt_logprobs``: each prompt token's, in ``Request.prompt_logprobs``.
        * ``on_token(event)``: called with each :class:`TokenEvent` of the request after
          the step that made it committed, in the stepping thread.
        """
        where = "add_request"
        prompt = token_ids(prompt, self.vocab_size, f"{where}: prompt")
        if not prompt:
            raise ValueError("add_request: the prompt is empty; a request needs at least one token")
        max_new_tokens = count(max_new_tokens, "max_new_tokens", where)
        # The last new token is sampled, never fed: it needs no cache position.
        need = len(prompt) + max_new_tokens - 1
        if need > self.cache.max_context_len:
            raise ValueError(f"{where}: a request of {len(prompt)} prompt tokens and {max_new_tokens} new tokens "
                             f"needs {need} cache positions, more than max_context_len={self.cache.max_context_len}")
        crossing = rope.crossing_problem(self.model, len(prompt), max_new_tokens)
        if crossing is not None:
            raise ValueError(f"{where}: {crossing}")
        params = self._sampling(where, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed)
        min_new = self.min_new_tokens if min_new_tokens is None else count(min_new_tokens, "min_new_tokens", where, 0)
        if min_new > max_new_tokens:
            raise ValueError(f"add_request: min_new_tokens={min_new} is more than max_new_tokens={max_new_tokens}")
        min_new = max(min_new, self.generation.min_new(len(prompt), max_new_tokens))  # generation_config.min_length
        eos = self.eos_token_ids if eos_token_id is None else stop_ids(eos_token_id, self.vocab_size,
                                                                       f"{where}: eos_token_id")
        stops = tuple(sorted(set(eos) | set(token_ids(stop_token_ids, self.vocab_size, f"{where}: stop_token_ids"))))
        top_n = count(top_logprobs, "top_logprobs", where, 0)
        if top_n > self.vocab_size:
            raise ValueError(f"add_request: top_logprobs={top_n} is more than the vocabulary ({self.vocab_size})")
        want = flag(logprobs, "logprobs", where) or top_n > 0
        wants_prompt = flag(prompt_logprobs, "prompt_logprobs", where)
        if on_token is not None and not callable(on_token):
            raise TypeError(f"add_request: on_token must be callable (it gets each TokenEvent), got {on_token!r}")
        with self._lock:
            rid = next(self._ids)
            if seed is None:
                params = dataclasses.replace(params, seed=request_seed(self.seed, rid))
            req = Request(rid, prompt, max_new_tokens, sampling=params, stop_token_ids=stops, min_new_tokens=min_new,
                          logprobs=[] if want else None, top_logprobs=[] if top_n else None, top_n=top_n,
                          wants_prompt_logprobs=wants_prompt, on_token=on_token)
            self.requests[rid] = req
            self.waiting.append(req)
        return req

    def abort(self, rid: int) -> None:
        """Drop a request, waiting or running (a client that went away); a finished one stays
        as it is. While a step runs (from ``sample``, or another thread) the abort takes
        effect at the step's end, failed or not: the request keeps that step's tokens."""
        with self._lock:
            req = self.requests.get(rid)
            if req is None:
                raise KeyError(f"abort: no request {rid!r} (request ids are the rid of what add_request returned)")
            if self._stepping:
                self._aborts[rid] = None
            else:
                self._drop(req)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    # -- a step ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Prefill the requests there is room for and decode every running one by a token;
        all or nothing (see the module docstring). Then the new tokens' ``on_token``
        callbacks run; when one raises, the others still run and the first exception
        propagates (the step stays committed)."""
        with self._lock:
            if self._stepping or self._notifying:
                raise RuntimeError(reentered(self._notifying))
            self._stepping = True
        pending = Pending()
        try:
            try:
                self._compute(pending)
            except Exception as exc:
                self._release(pending)
                pending = self._recover(pending, exc)  # or raises exc: no request alone is to blame
        except BaseException:
            try:
                self._release(pending)
            finally:
                with self._lock:
                    self._end_step(None)
            raise
        with self._lock:
            try:
                self._commit(pending)
            finally:
                self._end_step(pending.out)
                self._notifying = True  # until the callbacks ran: a step() in one would send its events first
        try:
            notify(pending.tokens)
        finally:
            self._notifying = False
        return pending.out

    def _release(self, p: Pending) -> None:
        """Give back the rows and slots a computed step took (once: they are forgotten)."""
        with self._lock:
            self.cache.pool.free(p.slots)
            self.cache.req_to_token_pool.free(p.rows)
            p.slots = []
            p.rows = []

    def _commit(self, p: Pending) -> None:
        """Apply a computed step: list operations only, nothing here can fail halfway."""
        for req, row, slots in p.admitted:
            self.waiting.popleft()  # the admitted are the queue's head: only a commit or an abort between steps pops
            req.row = row
            req.slots = slots
            self.running.append(req)
        for lane, slot in zip(p.lanes, p.decode_slots):
            lane.req.slots.append(slot)
        for req, values in p.prompt_logprobs:
            req.prompt_logprobs = values
        for req, event in p.tokens:
            req.output.append(event.token)
            if req.logprobs is not None:
                req.logprobs.append(event.logprob)
            if req.top_logprobs is not None:
                req.top_logprobs.append(event.top_logprobs)
        for req, reason in p.ending:
            self._finish(req, reason)
            p.out.finished.append(req.rid)
        p.out.events = [event for _, event in p.tokens]

    def _end_step(self, out: Optional[StepOutput]) -> None:
        """Apply the aborts that came during the step (under the lock), and end it."""
        try:
            for rid in self._aborts:
                req = self.requests[rid]
                if not req.finished:
                    self._drop(req)
                    if out is not None:
                        out.aborted.append(rid)
        finally:
            self._aborts.clear()
            self._stepping = False

    def _drop(self, req: Request, reason: str = FINISH_ABORT) -> None:
        """Abort (or fail) ``req`` between steps (under the lock); a finished request stays as it is."""
        if req.finished:
            return
        if req.row:
            self._finish(req, reason)
        else:
            self.waiting.remove(req)
            req.finished = True
            req.finish_reason = reason

    def _finish(self, req: Request, reason: str) -> None:
        req.finished = True
        req.finish_reason = reason
        self.running.remove(req)
        self.cache.free_request(req.row, req.slots)
        req.slots = []
