"""A small continuous-batching driver: requests join and leave, decode goes through graphs.

Each :meth:`ContinuousBatcher.step` first prefills the requests admitted this step
(one eager transformers forward over all of them, right-padded, writing the pool), then
decodes every running request by one token through the :class:`DecodeGraphRunner`
(replayed when a captured size fits, eager otherwise). Sampling is greedy unless a
``sample`` function is given. A request leaves when it has ``max_new_tokens`` tokens,
meets ``eos_token_id`` or is aborted; its row and slots go back to the pool.

Host bookkeeping (rows, slots, lengths) stays in Python lists, so building a step reads
nothing from the device; only sampling does.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

import torch

from ...runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from .adapter import DecodeStep, HFDecodeAdapter
from .cache import PagedCache


def greedy(logits: torch.Tensor) -> List[int]:
    return logits.argmax(-1).tolist()


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


class ContinuousBatcher:
    """Decode a stream of requests with a transformers causal LM through graphs.

    ``max_bs`` caps the running batch and the captured sizes; ``max_context_len``
    (prompt plus new tokens) sizes the cache rows, default the config's
    ``max_position_embeddings``. Runner options (``backend``, ``mode``,
    ``capture_bs``, ``progress``...) go to :class:`DecodeRunnerConfig`.
    """

    def __init__(self, model: Any, *, max_bs: int = 8, max_context_len: Optional[int] = None,
                 max_requests: Optional[int] = None, sample: Callable[[torch.Tensor], List[int]] = greedy,
                 eos_token_id: Optional[int] = None, allow_untested: bool = False, **runner_options: Any):
        config = model.config
        self.model, self.sample, self.eos_token_id = model, sample, eos_token_id
        self.max_bs = max_bs
        self.cache = PagedCache(config, max_requests=max_requests or max_bs,
                                max_context_len=max_context_len or config.max_position_embeddings,
                                dtype=model.dtype, device=model.device)
        self.adapter = HFDecodeAdapter(model, self.cache, allow_untested=allow_untested)
        runner_options.setdefault("progress", False)
        self.runner = DecodeGraphRunner(self.adapter, DecodeRunnerConfig(max_bs=max_bs, **runner_options))
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.requests: Dict[int, Request] = {}
        self._ids = itertools.count()

    # -- requests --------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """Queue a request; it is prefilled at the next step with room for it."""
        prompt = [int(t) for t in prompt]
        if not prompt or max_new_tokens < 1:
            raise ValueError(f"a request needs a prompt and max_new_tokens >= 1, got {len(prompt)} prompt tokens "
                             f"and max_new_tokens={max_new_tokens}")
        # The last new token is sampled, never fed: it needs no cache position.
        need = len(prompt) + max_new_tokens - 1
        if need > self.cache.max_context_len:
            raise ValueError(f"a request of {len(prompt)} prompt tokens and {max_new_tokens} new tokens needs "
                             f"{need} cache positions, more than max_context_len={self.cache.max_context_len}")
        req = Request(next(self._ids), prompt, max_new_tokens)
        self.requests[req.rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: int) -> None:
        """Drop a request, waiting or running (a client that went away)."""
        req = self.requests[rid]
        if req in self.waiting:
            self.waiting.remove(req)
            req.finished = True
        elif not req.finished:
            self._finish(req)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    # -- a step ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput()
        admitted = self._admit()
        if admitted:
            logits = self._prefill(admitted)
            for req, row, token in zip(admitted, logits, self.sample(logits)):
                out.prefill_logits[req.rid] = row.clone()
                self._append(req, token, out)
        if self.running:
            start = time.perf_counter()
            batch = list(self.running)
            fed = [req.output[-1] for req in batch]
            step = self._decode_step(batch, fed)
            out.decode_batch_size = len(batch)
            out.decode_graph = self.runner.can_run(step)
            logits = self.runner(step).clone()  # replayed outputs are views of static memory
            tokens = self.sample(logits)  # reads the device: the step is done when it returns
            out.decode_seconds = time.perf_counter() - start
            if logits.shape[0] != len(batch):
                raise RuntimeError(f"the decode step of {len(batch)} requests returned {logits.shape[0]} rows")
            for req, token_in, row, token in zip(batch, fed, logits, tokens):
                out.decode[req.rid] = (token_in, row)
                self._append(req, token, out)
        return out

    def _admit(self) -> List[Request]:
        admitted = []
        while (self.waiting and len(self.running) < self.max_bs and self.cache.available_requests
               and self.cache.available_slots >= len(self.waiting[0].prompt) + self.waiting[0].max_new_tokens):
            req = self.waiting.popleft()
            req.row = self.cache.alloc_request()
            req.slots = self.cache.alloc_tokens(req.row, 0, len(req.prompt))
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _prefill(self, reqs: List[Request]) -> torch.Tensor:
        """Last-position logits ``[len(reqs), vocab]``: one eager forward, rows right-padded.

        A padding token sits at position 0 of the dummy slot 0, so it writes nothing a
        request reads, and its query sees position 0 of its own row only."""
        dev, width = self.cache.device, max(len(r.prompt) for r in reqs)
        ids = torch.zeros(len(reqs), width, dtype=torch.int64)
        pos = torch.zeros(len(reqs), width, dtype=torch.int64)
        loc = torch.zeros(len(reqs), width, dtype=torch.int64)
        for i, r in enumerate(reqs):
            n = len(r.prompt)
            ids[i, :n], pos[i, :n], loc[i, :n] = torch.tensor(r.prompt), torch.arange(n), torch.tensor(r.slots)
        ids, pos = ids.to(dev), pos.to(dev)
        self.cache.bind(loc.view(-1).to(dev), torch.tensor([r.row for r in reqs], device=dev))
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True,
                             attention_mask=self.cache.attention_mask(pos, self.model.dtype))
        last = torch.tensor([len(r.prompt) - 1 for r in reqs], device=dev)
        return out.logits[torch.arange(len(reqs), device=dev), last]

    def _decode_step(self, batch: List[Request], fed: List[int]) -> DecodeStep:
        positions = [r.cached for r in batch]
        for r in batch:
            r.slots += self.cache.alloc_tokens(r.row, r.cached, 1)
        dev = self.cache.device

        def i64(values, device=dev):
            return torch.tensor(values, dtype=torch.int64, device=device)

        lens = [p + 1 for p in positions]
        return DecodeStep(input_ids=i64(fed), positions=i64(positions), out_cache_loc=i64([r.slots[-1] for r in batch]),
                          req_pool_indices=i64([r.row for r in batch]), seq_lens=i64(lens),
                          seq_lens_cpu=i64(lens, "cpu"), batch_size=len(batch))

    def _append(self, req: Request, token: int, out: StepOutput) -> None:
        req.output.append(int(token))
        if len(req.output) >= req.max_new_tokens or (self.eos_token_id is not None and token == self.eos_token_id):
            self._finish(req)
            out.finished.append(req.rid)

    def _finish(self, req: Request) -> None:
        req.finished = True
        self.running.remove(req)
        self.cache.free_request(req.row, req.slots)
        req.slots = []
