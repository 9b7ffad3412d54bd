"""A small continuous-batching driver: requests join and leave, decode goes through graphs.

Each :meth:`ContinuousBatcher.step` first prefills the requests admitted this step
(one eager transformers forward over all of them, right-padded, writing the pool), then
decodes every running request by one token through the :class:`DecodeGraphRunner`
(replayed when a captured size fits, eager otherwise). Sampling is greedy unless a
``sample`` function is given. A request leaves when it has ``max_new_tokens`` tokens,
meets ``eos_token_id`` or is aborted; its row and slots go back to the pool.

A step is all or nothing. It computes first (admission, prefill, decode, sampling) into
local results, taking the rows and slots it needs from the pool, and only then commits
them to the requests, in one place that cannot fail halfway. When anything raises on
the way (the model, the runner, ``sample``, a check of what ``sample`` returned), the
rows and slots go back (what the step wrote to the KV pool went to them, so nothing
reads it), the requests it admitted stay at the head of the waiting queue, no request
changes, and the exception propagates: calling ``step()`` again gives the tokens an
uninterrupted run gives.

:meth:`~ContinuousBatcher.add_request` and :meth:`~ContinuousBatcher.abort` take a lock
and may be called from any thread, and from ``sample``: an abort while a step runs takes
effect at the step's end (the request keeps that step's tokens and gets no more).
``step()`` itself runs in one thread at a time. Requests and arguments are checked up
front: token ids are integers in the model's vocabulary, counts are ints >= 1.

Host bookkeeping (rows, slots, lengths) stays in Python lists, so building a step reads
nothing from the device; only sampling does.
"""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ...runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from .adapter import DecodeStep, HFDecodeAdapter
from .cache import PagedCache


def greedy(logits: torch.Tensor) -> List[int]:
    return logits.argmax(-1).tolist()


# -- checks -------------------------------------------------------------------------
def _as_int(value: Any) -> Optional[int]:
    """An int or an integral torch/numpy scalar as a Python int; None for anything else.
    Bools and floats (even 1.0) are not ints here: a token id or a count is never truncated."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim())):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _count(value: Any, name: str, where: str) -> int:
    """``value`` as an int >= 1, or a TypeError/ValueError naming ``name``."""
    n = _as_int(value)
    if n is None or n < 1:
        raise (TypeError if n is None else ValueError)(f"{where}: {name} must be an int >= 1, got {value!r}")
    return n


def _token_id(value: Any, vocab_size: int, what: str) -> int:
    """``value`` as a token id of the model, or a TypeError/ValueError naming ``what``."""
    t = _as_int(value)
    if t is None:
        raise TypeError(f"{what} is {value!r} ({type(value).__name__}); token ids must be integers")
    if not 0 <= t < vocab_size:
        raise ValueError(f"{what} is {t}, outside the model's vocabulary (0 <= id < {vocab_size})")
    return t


def _token_ids(values: Any, vocab_size: int, what: str) -> List[int]:
    """A sequence, tensor or array of token ids as Python ints (a tensor is read once)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        try:
            values = list(values)
        except TypeError:
            raise TypeError(f"{what} must be a sequence of token ids, got {type(values).__name__}") from None
    return [v if type(v) is int and 0 <= v < vocab_size else _token_id(v, vocab_size, f"{what}[{i}]")
            for i, v in enumerate(values)]


# -- requests and steps ---------------------------------------------------------------
@dataclass(eq=False)
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    output: List[int] = field(default_factory=list)
    row: int = 0  # request-pool row once admitted (0: not admitted)
    slots: List[int] = field(default_factory=list)  # KV slot per cached position
    finished: bool = False

    @property
    def cached(self) -> int:
        """Tokens in the KV cache; the last output token is not yet among them."""
        return len(self.slots)


@dataclass
class StepOutput:
    """What one step did; logits rows are copies (``[vocab]`` each)."""

    prefill_logits: Dict[int, torch.Tensor] = field(default_factory=dict)
    #: rid -> (token fed, logits it produced)
    decode: Dict[int, tuple] = field(default_factory=dict)
    decode_batch_size: int = 0
    decode_graph: bool = False
    #: Wall time of the decode: building the batch, the runner, sampling.
    decode_seconds: float = 0.0
    finished: List[int] = field(default_factory=list)
    #: Requests whose :meth:`ContinuousBatcher.abort` came while the step ran (and that
    #: did not finish in it): they got the step's tokens and left at its end.
    aborted: List[int] = field(default_factory=list)


class _Lane(NamedTuple):
    """One request's row of a step's decode."""

    req: Request
    row: int
    position: int  # where the fed token goes: the request's cached tokens
    fed: int
    emitted: int  # output tokens before this decode's


@dataclass
class _Pending:
    """A computed step not yet committed: what it took from the pool, what it will change."""

    out: StepOutput = field(default_factory=StepOutput)
    rows: List[int] = field(default_factory=list)  # taken from the pool, for rollback
    slots: List[int] = field(default_factory=list)
    admitted: List[Tuple[Request, int, List[int]]] = field(default_factory=list)  # (request, row, prompt slots)
    lanes: List[_Lane] = field(default_factory=list)
    decode_slots: List[int] = field(default_factory=list)  # one per lane
    tokens: List[Tuple[Request, int]] = field(default_factory=list)  # in the order they are appended
    ending: List[Request] = field(default_factory=list)


class ContinuousBatcher:
    """Decode a stream of requests with a transformers causal LM through graphs.

    ``max_bs`` caps the running batch and the captured sizes; ``max_requests`` (default
    ``max_bs``) sizes the request pool; ``max_context_len`` (prompt plus new tokens)
    sizes the cache rows, default the config's ``max_position_embeddings``. Runner
    options (``backend``, ``mode``, ``capture_bs``, ``progress``...) go to
    :class:`DecodeRunnerConfig`.

    Thread safety: :meth:`add_request` and :meth:`abort` hold ``self._lock`` while they
    change the queue, so other threads (and ``sample``) may call them while a step runs;
    :meth:`step` holds it only at its start and to commit. One thread at a time steps.
    """

    def __init__(self, model: Any, *, max_bs: int = 8, max_context_len: Optional[int] = None,
                 max_requests: Optional[int] = None, sample: Callable[[torch.Tensor], List[int]] = greedy,
                 eos_token_id: Optional[int] = None, allow_untested: bool = False, **runner_options: Any):
        config, where = model.config, "ContinuousBatcher"
        max_bs = _count(max_bs, "max_bs", where)
        max_requests = max_bs if max_requests is None else _count(max_requests, "max_requests", where)
        max_context_len = (config.max_position_embeddings if max_context_len is None
                           else _count(max_context_len, "max_context_len", where))
        self.model, self.sample, self.max_bs = model, sample, max_bs
        self.cache = PagedCache(config, max_requests=max_requests, max_context_len=max_context_len,
                                dtype=model.dtype, device=model.device)
        self.vocab_size: int = self.cache.config.vocab_size
        self.eos_token_id = (None if eos_token_id is None
                             else _token_id(eos_token_id, self.vocab_size, f"{where}: eos_token_id"))
        self.adapter = HFDecodeAdapter(model, self.cache, allow_untested=allow_untested)
        runner_options.setdefault("progress", False)
        self.runner = DecodeGraphRunner(self.adapter, DecodeRunnerConfig(max_bs=max_bs, **runner_options))
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.requests: Dict[int, Request] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stepping = False
        self._aborts: Dict[int, None] = {}  # rids aborted while the step runs, in order

    # -- requests --------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """Queue a request; it is prefilled at the next step with room for it."""
        prompt = _token_ids(prompt, self.vocab_size, "add_request: prompt")
        if not prompt:
            raise ValueError("add_request: the prompt is empty; a request needs at least one token")
        max_new_tokens = _count(max_new_tokens, "max_new_tokens", "add_request")
        # The last new token is sampled, never fed: it needs no cache position.
        need = len(prompt) + max_new_tokens - 1
        if need > self.cache.max_context_len:
            raise ValueError(f"a request of {len(prompt)} prompt tokens and {max_new_tokens} new tokens needs "
                             f"{need} cache positions, more than max_context_len={self.cache.max_context_len}")
        with self._lock:
            req = Request(next(self._ids), prompt, max_new_tokens)
            self.requests[req.rid] = req
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
        all or nothing (see the module docstring)."""
        with self._lock:
            if self._stepping:
                raise RuntimeError("ContinuousBatcher.step() is already running: call it from one thread at a "
                                   "time, and not from sample")
            self._stepping = True
        pending = _Pending()
        try:
            self._compute(pending)
        except BaseException:
            with self._lock:
                try:
                    self.cache.pool.free(pending.slots)
                    self.cache.req_to_token_pool.free(pending.rows)
                finally:
                    self._end_step(None)
            raise
        with self._lock:
            try:
                self._commit(pending)
            finally:
                self._end_step(pending.out)
        return pending.out

    def _compute(self, p: _Pending) -> None:
        """Everything a step computes, into ``p``; no request changes."""
        out = p.out
        self._admit(p)
        p.lanes = [_Lane(r, r.row, r.cached, r.output[-1], len(r.output)) for r in self.running]
        if p.admitted:
            logits = self._prefill(p.admitted)
            for (req, row, slots), row_logits, token in zip(p.admitted, logits, self._sample(logits)):
                out.prefill_logits[req.rid] = row_logits.clone()
                p.tokens.append((req, token))
                if self._ends(req, 1, token):
                    p.ending.append(req)
                else:
                    p.lanes.append(_Lane(req, row, len(slots), token, 1))
        if not p.lanes:
            return
        start = time.perf_counter()
        for lane in p.lanes:
            p.decode_slots += self.cache.alloc_tokens(lane.row, lane.position, 1)
            p.slots.append(p.decode_slots[-1])
        step = self._decode_step([lane.fed for lane in p.lanes], [lane.position for lane in p.lanes],
                                 [lane.row for lane in p.lanes], p.decode_slots)
        out.decode_batch_size = len(p.lanes)
        out.decode_graph = self.runner.can_run(step)
        logits = self.runner(step).clone()  # replayed outputs are views of static memory
        if logits.shape[0] != len(p.lanes):
            raise RuntimeError(f"the decode step of {len(p.lanes)} requests returned {logits.shape[0]} rows")
        tokens = self._sample(logits)  # reads the device: the step is done when it returns
        out.decode_seconds = time.perf_counter() - start
        for lane, row_logits, token in zip(p.lanes, logits, tokens):
            out.decode[lane.req.rid] = (lane.fed, row_logits)
            p.tokens.append((lane.req, token))
            if self._ends(lane.req, lane.emitted + 1, token):
                p.ending.append(lane.req)

    def _commit(self, p: _Pending) -> None:
        """Apply a computed step: list operations only, nothing here can fail halfway."""
        for req, row, slots in p.admitted:
            self.waiting.popleft()  # the admitted are the queue's head: only a commit or an abort between steps pops
            req.row, req.slots = row, slots
            self.running.append(req)
        for lane, slot in zip(p.lanes, p.decode_slots):
            lane.req.slots.append(slot)
        for req, token in p.tokens:
            req.output.append(token)
        for req in p.ending:
            self._finish(req)
            p.out.finished.append(req.rid)

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

    def _admit(self, p: _Pending) -> None:
        """Take rows and prompt slots for the waiting requests there is room for (the queue is
        indexed, not iterated: another thread may append to it meanwhile)."""
        cache, i = self.cache, 0
        while (i < len(self.waiting) and len(self.running) + i < self.max_bs and cache.available_requests
               and cache.available_slots >= len(self.waiting[i].prompt) + self.waiting[i].max_new_tokens):
            req = self.waiting[i]
            row = cache.alloc_request()
            p.rows.append(row)
            slots = cache.alloc_tokens(row, 0, len(req.prompt))
            p.slots += slots
            p.admitted.append((req, row, slots))
            i += 1

    def _sample(self, logits: torch.Tensor) -> List[int]:
        tokens = _token_ids(self.sample(logits), self.vocab_size, "sample(logits)")
        if len(tokens) != logits.shape[0]:
            raise ValueError(f"sample must return one token id per row of logits: got {len(tokens)} for "
                             f"{logits.shape[0]}")
        return tokens

    def _prefill(self, admitted: List[Tuple[Request, int, List[int]]]) -> torch.Tensor:
        """Last-position logits ``[len(admitted), vocab]``: one eager forward, rows right-padded.

        A padding token sits at position 0 of the dummy slot 0, so it writes nothing a
        request reads, and its query sees position 0 of its own row only."""
        dev, width = self.cache.device, max(len(r.prompt) for r, _, _ in admitted)
        ids = torch.zeros(len(admitted), width, dtype=torch.int64)
        pos = torch.zeros(len(admitted), width, dtype=torch.int64)
        loc = torch.zeros(len(admitted), width, dtype=torch.int64)
        for i, (r, _, slots) in enumerate(admitted):
            n = len(r.prompt)
            ids[i, :n], pos[i, :n], loc[i, :n] = torch.tensor(r.prompt), torch.arange(n), torch.tensor(slots)
        ids, pos = ids.to(dev), pos.to(dev)
        self.cache.bind(loc.view(-1).to(dev), torch.tensor([row for _, row, _ in admitted], device=dev))
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True,
                             attention_mask=self.cache.attention_mask(pos, self.model.dtype))
        last = torch.tensor([len(r.prompt) - 1 for r, _, _ in admitted], device=dev)
        return out.logits[torch.arange(len(admitted), device=dev), last]

    def _decode_step(self, fed: List[int], positions: List[int], rows: List[int], locs: List[int]) -> DecodeStep:
        """The decode batch: token ``fed[i]`` at ``positions[i]`` of request row ``rows[i]``, its
        KV to slot ``locs[i]``."""
        dev = self.cache.device

        def i64(values, device=dev):
            return torch.tensor(values, dtype=torch.int64, device=device)

        lens = [p + 1 for p in positions]
        return DecodeStep(input_ids=i64(fed), positions=i64(positions), out_cache_loc=i64(locs),
                          req_pool_indices=i64(rows), seq_lens=i64(lens), seq_lens_cpu=i64(lens, "cpu"),
                          batch_size=len(fed))

    def _ends(self, req: Request, emitted: int, token: int) -> bool:
        return emitted >= req.max_new_tokens or (self.eos_token_id is not None and token == self.eos_token_id)

    def _drop(self, req: Request) -> None:
        """Abort ``req`` between steps (under the lock); a finished request stays as it is."""
        if req.finished:
            return
        if req.row:
            self._finish(req)
        else:
            self.waiting.remove(req)
            req.finished = True

    def _finish(self, req: Request) -> None:
        req.finished = True
        self.running.remove(req)
        self.cache.free_request(req.row, req.slots)
        req.slots = []
