"""Batch builders and a small continuous-batching scheduler for the reference model.

Requests arrive and finish at different steps, so the decode batch size changes from
step to step, which is what a CUDA-graph runner has to cope with (padding to captured
sizes). The decode forward is injected per step (``Scheduler.step(decode_fn)``), so the
same schedule can be driven by the eager model and by a graph runner and compared
logit by logit. Everything is deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from .forward_batch import ForwardBatch, ForwardMode
from .memory import SWAKVCache

ForwardFn = Callable[[ForwardBatch], torch.Tensor]


def _i64(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def make_extend_batch(
    runtime,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    new_tokens: Sequence[Sequence[int]],
) -> ForwardBatch:
    """An EXTEND batch appending ``new_tokens[i]`` after ``prefix_lens[i]`` cached tokens.

    Allocates the KV slots and records them in ``req_to_token``; the slots are
    ``fb.out_cache_loc`` (request by request, in order).
    """
    device = runtime.device
    ext = [len(t) for t in new_tokens]
    seq = [p + n for p, n in zip(prefix_lens, ext)]
    loc = runtime.token_to_kv_pool.alloc(sum(ext))
    start = 0
    for r, p, n in zip(req_pool_indices, prefix_lens, ext):
        runtime.req_to_token_pool.write(r, p, loc[start : start + n])
        start += n
    starts = [sum(ext[:i]) for i in range(len(ext))]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(ext),
        input_ids=_i64((t for toks in new_tokens for t in toks), device),
        req_pool_indices=_i64(req_pool_indices, device),
        seq_lens=_i64(seq, device),
        out_cache_loc=loc,
        seq_lens_cpu=_i64(seq, "cpu"),
        positions=_i64((pos for p, s in zip(prefix_lens, seq) for pos in range(p, s)), device),
        num_token_non_padded=torch.tensor([sum(ext)], dtype=torch.int32, device=device),
        extend_seq_lens=_i64(ext, device),
        extend_prefix_lens=_i64(prefix_lens, device),
        extend_start_loc=_i64(starts, device),
        extend_seq_lens_cpu=ext,
    )


def make_decode_batch(
    runtime,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    new_tokens: Union[Sequence[int], Sequence[Sequence[int]]],
    forward_mode: Optional[ForwardMode] = None,
) -> ForwardBatch:
    """A DECODE (one token per request) or TARGET_VERIFY (k tokens each) batch.

    ``new_tokens`` is one token per request, or equal-length lists of k tokens. The mode
    defaults to DECODE for k == 1 and TARGET_VERIFY otherwise; ``seq_lens`` follows
    sglang: prefix + 1 for DECODE, the prefix alone for TARGET_VERIFY. Allocates the KV
    slots and records them in ``req_to_token``.
    """
    device = runtime.device
    rows = [[t] if isinstance(t, int) else list(t) for t in new_tokens]
    k = len(rows[0]) if rows else 1
    if any(len(r) != k for r in rows):
        raise ValueError("every request needs the same number of new tokens")
    if forward_mode is None:
        forward_mode = ForwardMode.DECODE if k == 1 else ForwardMode.TARGET_VERIFY
    bs = len(rows)
    loc = runtime.token_to_kv_pool.alloc(bs * k)
    positions = [p + j for p in prefix_lens for j in range(k)]
    runtime.req_to_token_pool.write_tokens(
        _i64((r for r in req_pool_indices for _ in range(k)), device), _i64(positions, device), loc
    )
    seq = [p if forward_mode == ForwardMode.TARGET_VERIFY else p + k for p in prefix_lens]
    return ForwardBatch(
        forward_mode=forward_mode,
        batch_size=bs,
        input_ids=_i64((t for r in rows for t in r), device),
        req_pool_indices=_i64(req_pool_indices, device),
        seq_lens=_i64(seq, device),
        out_cache_loc=loc,
        seq_lens_cpu=_i64(seq, "cpu"),
        positions=_i64(positions, device),
        num_token_non_padded=torch.tensor([bs * k], dtype=torch.int32, device=device),
        num_tokens_per_bs=k,
    )


@dataclass
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    arrival_step: int = 0
    output_ids: List[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    kv_slots: List[int] = field(default_factory=list)  # full-pool slot of each cached token
    swa_evicted: int = 0  # tokens [0, swa_evicted) no longer hold an SWA slot

    @property
    def kv_len(self) -> int:
        return len(self.kv_slots)


def generate_requests(
    num_requests: int,
    *,
    seed: int = 0,
    vocab_size: int = 128,
    max_context_len: int = 64,
    prompt_len: Tuple[int, int] = (2, 12),
    max_new_tokens: Tuple[int, int] = (1, 12),
    max_arrival_gap: int = 3,
) -> List[Request]:
    """Random prompts with staggered arrivals; lengths clipped to fit the context."""
    rng = random.Random(seed)
    requests = []
    arrival = 0
    for rid in range(num_requests):
        n = min(rng.randint(*prompt_len), max_context_len - 1)
        prompt = [rng.randrange(vocab_size) for _ in range(n)]
        new = min(rng.randint(*max_new_tokens), max_context_len - n)
        requests.append(Request(rid, prompt, new, arrival))
        arrival += rng.randint(0, max_arrival_gap)
    return requests


@dataclass
class StepRecord:
    step: int
    prefill_rids: List[int]
    decode_rids: List[int]
    decode_batch: Optional[ForwardBatch]
    decode_logits: Optional[torch.Tensor]  # [bs, vocab], a copy
    next_tokens: List[int]  # sampled by the decode, per decode_rids
    finished_rids: List[int]

    @property
    def batch_size(self) -> int:
        return len(self.decode_rids)


class Scheduler:
    """Admit arrived requests (one eager EXTEND), then decode everything running.

    ``decode_fn(fb)`` returns logits with at least ``fb.batch_size`` rows (a runner may
    return its padded rows too); ``extend_fn`` defaults to the eager forward as well.
    To compare two forwards on one schedule, call both inside one ``decode_fn``: they
    write identical K/V to the same slots, so the second run sees the same cache.
    """

    def __init__(
        self,
        runtime,
        requests: Optional[Sequence[Request]] = None,
        *,
        seed: int = 0,
        num_requests: int = 12,
        max_running: int = 8,
        **generate_kwargs,
    ):
        self.runtime = runtime
        if requests is None:
            generate_kwargs.setdefault("vocab_size", runtime.config.vocab_size)
            generate_kwargs.setdefault("max_context_len", runtime.config.max_context_len)
            requests = generate_requests(num_requests, seed=seed, **generate_kwargs)
        self.waiting: List[Request] = sorted(requests, key=lambda r: (r.arrival_step, r.rid))
        self.running: List[Request] = []
        self.finished: List[Request] = []
        self.max_running = max_running
        self.step_idx = 0

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def run(self, decode_fn: Optional[ForwardFn] = None, extend_fn: Optional[ForwardFn] = None,
            max_steps: int = 10_000) -> List[StepRecord]:
        records = []
        while not self.done and len(records) < max_steps:
            records.append(self.step(decode_fn, extend_fn))
        return records

    def step(self, decode_fn: Optional[ForwardFn] = None, extend_fn: Optional[ForwardFn] = None) -> StepRecord:
        rt = self.runtime
        finished: List[int] = []

        admitted = self._admit()
        if admitted:
            fb = make_extend_batch(rt, [r.req_pool_idx for r in admitted], [0] * len(admitted),
                                   [r.prompt for r in admitted])
            logits = (extend_fn or rt.forward)(fb)
            last = torch.tensor(fb.extend_seq_lens_cpu).cumsum(0) - 1
            tokens = logits.index_select(0, last.to(logits.device)).argmax(-1).tolist()
            loc = fb.out_cache_loc.tolist()
            for r, tok in zip(admitted, tokens):
                r.kv_slots, loc = loc[: len(r.prompt)], loc[len(r.prompt) :]
                r.output_ids.append(tok)
            self.running += admitted
            finished += self._retire()

        batch = None
        logits = None
        next_tokens = []
        decoding = list(self.running)
        if decoding:
            batch = make_decode_batch(rt, [r.req_pool_idx for r in decoding], [r.kv_len for r in decoding],
                                      [r.output_ids[-1] for r in decoding])
            logits = (decode_fn or rt.forward)(batch)[: len(decoding)].detach().clone()
            next_tokens = logits.argmax(-1).tolist()
            for r, slot, tok in zip(decoding, batch.out_cache_loc.tolist(), next_tokens):
                r.kv_slots.append(slot)
                r.output_ids.append(tok)
            finished += self._retire()

        record = StepRecord(
            self.step_idx, [r.rid for r in admitted], [r.rid for r in decoding], batch, logits, next_tokens, finished
        )
        self.step_idx += 1
        return record

    def _admit(self) -> List[Request]:
        admitted = []
        pool = self.runtime.req_to_token_pool
        while (
            self.waiting
            and self.waiting[0].arrival_step <= self.step_idx
            and len(self.running) + len(admitted) < self.max_running
            and pool.available > 0
        ):
            r = self.waiting.pop(0)
            r.req_pool_idx = pool.alloc(1)[0]
            admitted.append(r)
        return admitted

    def _retire(self) -> List[int]:
        """Free finished requests; release SWA slots that left every future window."""
        kv = self.runtime.token_to_kv_pool
        ctx = self.runtime.config.max_context_len
        window = self.runtime.config.sliding_window
        done = []
        still = []
        for r in self.running:
            # The last sampled token is not cached yet; its decode would write at kv_len.
            if len(r.output_ids) >= r.max_new_tokens or r.kv_len >= ctx:
                kv.free(r.kv_slots)
                self.runtime.req_to_token_pool.free(r.req_pool_idx)
                self.finished.append(r)
                done.append(r.rid)
                continue
            if isinstance(kv, SWAKVCache) and window:
                # The next query sits at position kv_len and sees keys > kv_len - window.
                keep_from = max(0, r.kv_len - window + 1)
                if keep_from > r.swa_evicted:
                    kv.free_swa(r.kv_slots[r.swa_evicted : keep_from])
                    r.swa_evicted = keep_from
            still.append(r)
        self.running = still
        return done
