"""The batches a :class:`~.engine.ContinuousBatcher` step runs: the eager prefill and the decode step.

Both are built from host lists (nothing is read from the device) and bound to the
:class:`~.cache.PagedCache` by the slots each token's K and V go to.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple, Union

import torch

from .adapter import DecodeStep
from .cache import MASK_2D, PagedCache
from .requests import Pending, Request


def takes_logits_to_keep(model: Any) -> bool:
    """Whether ``model.forward`` has transformers' ``logits_to_keep`` argument."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def prefill_logits(model: Any, cache: PagedCache, admitted: List[Tuple[Request, int, List[int]]], last_logits_only: bool
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Last-position logits ``[len(admitted), vocab]`` (one eager forward) and the prompt
    logprobs of the requests that asked (concatenated; None when none did).

    Rows are left-padded, so every prompt ends in the last column and the model
    computes the logits of the last ``keep`` columns only (``logits_to_keep``): 1, or
    the longest prompt whose logprobs were asked for. The 2-D mask route (Bloom, alibi
    Falcon: :mod:`.cache`) needs each row from column 0, so there rows are
    right-padded and every column's logits computed. A padding token sits at position
    0 of the dummy slot 0, so it writes nothing a request reads, and its query sees
    position 0 of its own row only. The forward gathers ``width`` positions per row
    (the longest prompt), not ``max_context_len``."""
    dev, width = cache.device, max(len(r.prompt) for r, _, _ in admitted)
    left = cache.mask_route != MASK_2D
    asked = [r for r, _, _ in admitted if r.wants_prompt_logprobs]
    keep = max((len(r.prompt) for r in asked), default=1) if left and last_logits_only else 0
    ids, pos, loc = [], [], []
    for r, _, slots in admitted:
        pad = [0] * (width - len(r.prompt))
        ids.append(pad + r.prompt if left else r.prompt + pad)
        pos.append(pad + list(range(len(r.prompt))) if left else list(range(len(r.prompt))) + pad)
        loc.append(pad + slots if left else slots + pad)
    ids, pos = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
    cache.bind(torch.tensor(loc, device=dev).view(-1), torch.tensor([row for _, row, _ in admitted],
                                                                         device=dev))
    extra = {"logits_to_keep": keep} if keep else {}
    with torch.no_grad(), cache.gathering(width):
        logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                            attention_mask=cache.attention_mask(pos, model.dtype), **extra).logits
    # column of row i's prompt token 0 among the logits' columns
    starts = [logits.shape[1] - len(r.prompt) if left else 0 for r, _, _ in admitted]
    last = (logits[:, -1] if left else
            logits[torch.arange(len(admitted), device=dev),
                   torch.tensor([len(r.prompt) - 1 for r, _, _ in admitted], device=dev)])
    if not asked:
        return last, None
    parts = []
    for i, (r, _, _) in enumerate(admitted):
        n = len(r.prompt)
        if r.wants_prompt_logprobs and n > 1:  # column starts[i] + j predicts prompt token j + 1
            lp = logits[i, starts[i]:starts[i] + n - 1].float().log_softmax(-1)
            parts.append(lp.gather(1, torch.tensor(r.prompt[1:], device=dev).unsqueeze(1)).squeeze(1))
    return last, torch.cat(parts) if parts else torch.zeros(0, device=dev)

def split_prompt_logprobs(p: Pending, values: List[float]) -> None:
    """Hand each request that asked its prompt logprobs (``values``: what :func:`prefill_logits` concatenated)."""
    start = 0
    for req, _, _ in p.admitted:
        if req.wants_prompt_logprobs:
            n = len(req.prompt) - 1
            p.prompt_logprobs.append((req, [None] + values[start:start + n]))
            start += n


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
