"""The batches a :class:`~.engine.ContinuousBatcher` step runs: the eager prefill, the
decode step, and the packed step that does both in one forward.

All are built from host lists (nothing is read from the device) and bound to the
:class:`~.cache.PagedCache` by the slots each token's K and V go to.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .adapter import DecodeStep
from .cache import PagedCache
from .forward import with_cache
from .masks import MASK_2D
from .requests import Lane, Pending, Request
from .rope import per_row_rope


#: What one prefill forward costs beside its tokens, in padded tokens: the weights read
#: once more, the Python of an eager forward (:func:`prefill_groups`). On a GPU a forward's
#: launches cost far more than a padded token.
FORWARD_TOKENS = {"cpu": 64}
FORWARD_TOKENS_ELSEWHERE = 1024


def prefill_groups(lengths: Sequence[int], forward_tokens: int) -> List[List[int]]:
    """The admitted requests (by index into ``lengths``, their prompt lengths) split into
    prefill forwards: sorted by length, cut where a cut saves more padding than a
    forward costs (``forward_tokens``). Each forward pads its rows to its longest prompt,
    so one forward over prompts of 16 and 64 tokens computes 128 positions for 80; the
    cuts minimise ``forwards x forward_tokens + padded positions`` (exactly: a dynamic
    programme over the sorted lengths, a group always a run of them)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cost = [0] + [float("inf")] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = lengths[order[end - 1]]
        for start in range(end):
            total = cost[start] + forward_tokens + (end - start) * longest
            if total < cost[end]:
                cost[end] = total
                cut[end] = start
    groups = []
    end = len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def prefill_logits(model: Any, cache: PagedCache, admitted: List[Tuple[Request, int, List[int]]], last_logits_only: bool
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Last-position logits ``[len(admitted), vocab]`` (eager forwards over groups of
    similar prompt lengths, :func:`prefill_groups`) and the prompt logprobs of the
    requests that asked (concatenated in ``admitted`` order; None when none did)."""
    forward_tokens = FORWARD_TOKENS.get(cache.device.type, FORWARD_TOKENS_ELSEWHERE)
    groups = prefill_groups([len(r.prompt) for r, _, _ in admitted], forward_tokens)
    lasts: List[torch.Tensor] = []
    prompt_lps: List[Optional[torch.Tensor]] = [None] * len(admitted)
    for group in groups:
        last, lps = _forward(model, cache, [admitted[i] for i in group], last_logits_only)
        lasts.append(last)
        for i, lp in zip(group, lps):
            prompt_lps[i] = lp
    ran = [i for group in groups for i in group]  # the rows of torch.cat(lasts)
    last = torch.cat(lasts) if len(lasts) > 1 else lasts[0]
    if ran != sorted(ran):
        last = last.index_select(0, torch.tensor(_inverse(ran), device=cache.device))
    if not any(r.wants_prompt_logprobs for r, _, _ in admitted):
        return last, None
    asked = [lp for lp in prompt_lps if lp is not None]
    return last, torch.cat(asked) if asked else torch.zeros(0, device=cache.device)


def _inverse(order: List[int]) -> List[int]:
    inverse = [0] * len(order)
    for position, i in enumerate(order):
        inverse[i] = position
    return inverse


def _forward(model: Any, cache: PagedCache, admitted: List[Tuple[Request, int, List[int]]], last_logits_only: bool
             ) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    """One prefill forward: last-position logits ``[len(admitted), vocab]`` and each
    request's prompt logprobs (None where not asked, or for a one-token prompt).

    Rows are left-padded, so every prompt ends in the last column and the model
    computes the logits of the last ``keep`` columns only (``logits_to_keep``): 1, or
    the longest prompt whose logprobs were asked for. The 2-D mask route (Bloom, alibi
    Falcon: :mod:`.cache`) needs each row from column 0, so there rows are
    right-padded and every column's logits computed. A padding token sits at position
    0 of the dummy slot 0, so it writes nothing a request reads, and its query sees
    position 0 of its own row only. The forward gathers ``width`` positions per row
    (the longest prompt), not ``max_context_len``."""
    dev = cache.device
    width = max(len(r.prompt) for r, _, _ in admitted)
    left = cache.mask_route != MASK_2D
    asked = [r for r, _, _ in admitted if r.wants_prompt_logprobs]
    keep = max((len(r.prompt) for r in asked), default=1) if left and last_logits_only else 0
    ids = []
    pos = []
    loc = []
    for r, _, slots in admitted:
        pad = [0] * (width - len(r.prompt))
        ids.append(pad + r.prompt if left else r.prompt + pad)
        pos.append(pad + list(range(len(r.prompt))) if left else list(range(len(r.prompt))) + pad)
        loc.append(pad + slots if left else slots + pad)
    ids = torch.tensor(ids, device=dev)
    pos = torch.tensor(pos, device=dev)
    cache.bind(torch.tensor(loc, device=dev).view(-1), torch.tensor([row for _, row, _ in admitted], device=dev))
    extra = {"logits_to_keep": keep} if keep else {}
    with torch.no_grad(), cache.gathering(width), per_row_rope(model):
        logits = model(input_ids=ids, position_ids=pos, **with_cache(model, cache), use_cache=True,
                       attention_mask=cache.attention_mask(pos, model.dtype), **extra).logits
    # column of row i's prompt token 0 among the logits' columns
    starts = [logits.shape[1] - len(r.prompt) if left else 0 for r, _, _ in admitted]
    last = (logits[:, -1] if left else
            logits[torch.arange(len(admitted), device=dev),
                   torch.tensor([len(r.prompt) - 1 for r, _, _ in admitted], device=dev)])
    parts: List[Optional[torch.Tensor]] = []
    for i, (r, _, _) in enumerate(admitted):
        n = len(r.prompt)
        lp = None
        if r.wants_prompt_logprobs and n > 1:  # column starts[i] + j predicts prompt token j + 1
            lp = logits[i, starts[i]:starts[i] + n - 1].float().log_softmax(-1)
            lp = lp.gather(1, torch.tensor(r.prompt[1:], device=dev).unsqueeze(1)).squeeze(1)
        parts.append(lp)
    return last, parts


def split_prompt_logprobs(p: Pending, values: List[float]) -> None:
    """Hand each request that asked its prompt logprobs (``values``: what :func:`prefill_logits` concatenated)."""
    start = 0
    for req, _, _ in p.admitted:
        if req.wants_prompt_logprobs:
            n = len(req.prompt) - 1
            p.prompt_logprobs.append((req, [None] + values[start:start + n]))
            start += n


def fed_ids(lanes: List[Lane], fresh: Optional[torch.Tensor]) -> Union[List[int], torch.Tensor]:
    """The decode's input ids: the running requests' last tokens (host), then the tokens
    the admitted ones just drew (``fresh``, on the device: not read to be fed)."""
    known = [lane.fed for lane in lanes if lane.fed is not None]
    if fresh is None:
        return known
    return torch.cat([torch.tensor(known, dtype=torch.int64, device=fresh.device), fresh])


def decode_step(dev: torch.device, fed: Union[List[int], torch.Tensor], positions: List[int], rows: List[int],
                locs: List[int]) -> DecodeStep:
    """The decode batch: token ``fed[i]`` at ``positions[i]`` of request row ``rows[i]``, its
    KV to slot ``locs[i]``."""
    def i64(values, device=dev):
        return torch.tensor(values, dtype=torch.int64, device=device)

    lens = [p + 1 for p in positions]
    return DecodeStep(input_ids=fed if isinstance(fed, torch.Tensor) else i64(fed), positions=i64(positions),
                      out_cache_loc=i64(locs), req_pool_indices=i64(rows), seq_lens=i64(lens),
                      seq_lens_cpu=i64(lens, "cpu"), batch_size=len(positions))


#: Most elements (queries x keys) a packed step's mask may have; a step beyond prefills
#: apart (the mask is dense: every query against every gathered key).
PACKED_MASK_ELEMENTS = 1 << 22


class Packed(NamedTuple):
    """One sequence of a packed step: its new ``tokens`` at positions ``start, start+1,
    ...`` and the slots of its whole context (``start + len(tokens)`` of them, the new
    tokens' last)."""

    tokens: List[int]
    start: int
    slots: List[int]


def packed_fits(queries: int, keys: int) -> bool:
    """Whether a packed step of ``queries`` tokens over ``keys`` context slots keeps its
    mask within :data:`PACKED_MASK_ELEMENTS`."""
    return queries * keys <= PACKED_MASK_ELEMENTS


def packed_logits(model: Any, cache: PagedCache, seqs: Sequence[Packed]) -> torch.Tensor:
    """The logits of each sequence's last token, ``[len(seqs), vocab]``: one eager forward
    over all of them packed in one row (no padding), each token attending over its own
    sequence's context (:meth:`.cache.PagedCache.packed_mask`); the model computes the
    logits of those positions only (``logits_to_keep``)."""
    ids = []
    pos = []
    loc = []
    query_seqs = []
    keys = []
    key_seqs = []
    key_pos = []
    last = []
    for i, (tokens, start, slots) in enumerate(seqs):
        ids += tokens
        pos += range(start, start + len(tokens))
        loc += slots[start:]
        query_seqs += [i] * len(tokens)
        keys += slots
        key_seqs += [i] * len(slots)
        key_pos += range(len(slots))
        last.append(len(ids) - 1)

    def i64(values):
        return torch.tensor(values, dtype=torch.int64, device=cache.device)

    cache.bind_packed(i64(loc), i64(keys))
    mask = cache.packed_mask(i64(query_seqs), i64(pos), i64(key_seqs), i64(key_pos), model.dtype)
    with torch.no_grad(), per_row_rope(model):  # packed: a longrope model never packs (rope.plan)
        out = model(input_ids=i64(ids).view(1, -1), position_ids=i64(pos).view(1, -1), **with_cache(model, cache),
                    use_cache=True, attention_mask=mask, logits_to_keep=i64(last))
    return out.logits[0]

