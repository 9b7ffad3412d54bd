"""What a :class:`~.engine.ContinuousBatcher` step computes, before anything is committed.

:meth:`Computing._compute` admits the waiting requests there is room for (a row and
slots for each prompt, :meth:`Computing._admit`), prefills them (eager forwards asking
the model for each prompt's last logits only: :mod:`.batches`), then decodes every
running request by one token through the :class:`~graphslot.runners.decode.DecodeGraphRunner`
(replayed when a captured size fits, eager otherwise); a request admitted in the step
is decoded in it too, fed the token its prefill drew on the device. With
``mix_prefill`` a step that admits requests while others run is one packed eager
forward of the running requests' tokens and the new prompts instead
(:meth:`Computing._mixed`: the weights read once, not twice), and the new requests
decode from the next step. Tokens are picked on the device per request
(:class:`~.picking.Picking`) and read back once per step (:func:`.sampling.to_host`),
with their logprobs when asked.

Everything lands in a :class:`~.requests.Pending`: the rows and slots taken from the
pool (given back if the step fails) and what the commit will change; no request
changes here (see :mod:`.engine`).
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch

from .batches import Packed, decode_step, fed_ids, packed_fits, packed_logits, prefill_logits, split_prompt_logprobs
from .requests import Lane, Pending, Picks, Request
from .sampling import to_host


class Computing:
    """For :class:`~.engine.ContinuousBatcher`: uses its ``waiting``, ``running``,
    ``_lock``, ``max_bs``, ``model``, ``cache``, ``runner``, ``mix_prefill``,
    ``last_logits_only``, and :class:`~.picking.Picking`'s ``_choose`` and ``_row``."""

    def _compute(self, p: Pending, only: Optional[Request] = None) -> None:
        """Everything a step computes, into ``p``; no request changes. ``only``: the step of
        that one request (running, or admitted if it waits), as :mod:`.recovery` asks."""
        out = p.out
        reads: List[torch.Tensor] = []
        with self._lock:
            queue = self.waiting if only is None else [req for req in self.waiting if req is only]
        self._admit(p, queue)
        p.lanes = [Lane(r, r.row, r.cached, r.output[-1], len(r.output)) for r in self.running
                   if only is None or r is only]
        if p.admitted and p.lanes and self.mix_prefill and self._mixed(p):
            return
        prefill = prompt_part = fresh = None
        if p.admitted:
            logits, prompt_lp = prefill_logits(self.model, self.cache, p.admitted, self.last_logits_only)
            for (req, _, _), row_logits in zip(p.admitted, logits):
                out.prefill_logits[req.rid] = row_logits.clone()
            choice = self._choose(logits, [self._row(req, 0) for req, _, _ in p.admitted])
            prefill = Picks.add(choice, reads)
            if prompt_lp is not None:
                prompt_part = len(reads)
                reads.append(prompt_lp)
            # Decoded in this step too, fed the token just drawn (unless one token is all it wants).
            going_on = [i for i, (req, _, _) in enumerate(p.admitted) if req.max_new_tokens > 1]
            if going_on:
                fresh = choice.tokens.index_select(0, torch.tensor(going_on, device=choice.tokens.device))
                p.lanes += [Lane(req, row, len(slots), None, 1)
                            for req, row, slots in (p.admitted[i] for i in going_on)]
        decode = logits = None
        start = time.perf_counter()
        if p.lanes:
            p.decode_slots = self.cache.pool.take_slots(len(p.lanes))
            p.slots += p.decode_slots
            step = decode_step(self.cache.device, fed_ids(p.lanes, fresh), [lane.position for lane in p.lanes],
                               [lane.row for lane in p.lanes], p.decode_slots)
            self.cache.req_to_token_pool.write_tokens(step.req_pool_indices, step.positions, step.out_cache_loc)
            out.decode_batch_size = len(p.lanes)
            out.decode_graph = self.runner.can_run(step)
            logits = self.runner(step).clone()  # replayed outputs are views of static memory
            if logits.shape[0] != len(p.lanes):
                raise RuntimeError(f"the decode step of {len(p.lanes)} requests returned {logits.shape[0]} rows")
            decode = Picks.add(self._choose(logits, [self._row(lane.req, lane.emitted) for lane in p.lanes]), reads)
        host = to_host(reads)  # the step's one read: it waits for the device
        if p.lanes:
            out.decode_seconds = time.perf_counter() - start
        ended = set()
        first = {}
        if prefill is not None:
            tokens, lps, top = prefill.get(host)
            for i, (req, _, _) in enumerate(p.admitted):
                first[req.rid] = tokens[i]
                p.record(req, 0, tokens[i], lps and lps[i], top and top[i], ended)
            if prompt_part is not None:
                split_prompt_logprobs(p, host[prompt_part])
        if decode is not None:
            tokens, lps, top = decode.get(host)
            for i, lane in enumerate(p.lanes):
                if lane.req.rid in ended:  # its first token ended it: this row was decoded in vain
                    continue
                out.decode[lane.req.rid] = (first[lane.req.rid] if lane.fed is None else lane.fed, logits[i])
                p.record(lane.req, lane.emitted, tokens[i], lps and lps[i], top and top[i], ended)

    def _admit(self, p: Pending, queue: Sequence[Request]) -> None:
        """Take rows and prompt slots for the waiting requests there is room for: a free
        row, and slots for its every token beside what the running requests may still
        take (so a running request never runs out). The queue is indexed, not iterated:
        another thread may append to it meanwhile."""
        cache = self.cache
        i = 0
        free = cache.available_slots - sum(r.need - r.cached for r in self.running)
        while (i < len(queue) and len(self.running) + i < self.max_bs and cache.available_requests
               and free >= queue[i].need):
            req = queue[i]
            row = cache.alloc_request()
            p.rows.append(row)
            slots = cache.alloc_tokens(row, 0, len(req.prompt))
            p.slots += slots
            p.admitted.append((req, row, slots))
            free -= req.need
            i += 1

    def _mixed(self, p: Pending) -> bool:
        """The step as one packed eager forward: each running request's token and each
        admitted prompt, no padding (the weights are read once, where a prefill and a
        decode read them twice). The admitted requests draw their first token here and
        decode from the next step. False (nothing done) when a request wants its prompt
        logprobs or the packed mask would be too large: the step runs apart."""
        lanes = p.lanes
        out = p.out
        n = len(lanes)
        prompts = sum(len(req.prompt) for req, _, _ in p.admitted)
        if (any(req.wants_prompt_logprobs for req, _, _ in p.admitted)
                or not packed_fits(n + prompts, sum(lane.position + 1 for lane in lanes) + prompts)):
            return False
        start = time.perf_counter()
        slots = self.cache.pool.take_slots(n)
        p.decode_slots = slots
        p.slots += slots
        seqs = [Packed([lane.fed], lane.position, lane.req.slots + [slot]) for lane, slot in zip(lanes, slots)]
        seqs += [Packed(req.prompt, 0, prompt_slots) for req, _, prompt_slots in p.admitted]
        dev = self.cache.device
        self.cache.req_to_token_pool.write_tokens(torch.tensor([lane.row for lane in lanes], device=dev),
                                                  torch.tensor([lane.position for lane in lanes], device=dev),
                                                  torch.tensor(slots, device=dev))
        logits = packed_logits(self.model, self.cache, seqs)
        reads: List[torch.Tensor] = []
        picks = Picks.add(self._choose(logits, [self._row(lane.req, lane.emitted) for lane in lanes]
                                       + [self._row(req, 0) for req, _, _ in p.admitted]), reads)
        tokens, lps, top = picks.get(to_host(reads))
        out.decode_batch_size = n
        out.decode_seconds = time.perf_counter() - start
        ended = set()
        for i, (req, _, _) in enumerate(p.admitted, n):
            out.prefill_logits[req.rid] = logits[i].clone()
            p.record(req, 0, tokens[i], lps and lps[i], top and top[i], ended)
        for i, lane in enumerate(lanes):
            out.decode[lane.req.rid] = (lane.fed, logits[i])
            p.record(lane.req, lane.emitted, tokens[i], lps and lps[i], top and top[i], ended)
        return True
