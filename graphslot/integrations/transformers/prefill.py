"""The prefill runners' adapter for Llama-like transformers models over a :class:`.cache.PagedCache`.

A prefill step packs every request's new tokens into one row of ``T`` tokens
(:class:`PrefillStep`, the prefill spec's field names; chunked prefill: a request may
start after a cached prefix). The runner pads ``T`` to a token bucket and captures the
layer stack (:class:`HFLayerStack`: the rotary embedding, the decoder layers, the final
norm) on the static ``input_embeds``; the embedding and the ``lm_head`` run eagerly.
The stack runs the layers without a ``Cache``: attention is routed
(:mod:`.attention`), and each layer's attention writes the new tokens' K and V into
the pool at ``out_cache_loc`` and attends over the keys :class:`PrefillMetadata`
names, so a decode over the same cache can follow.

Which keys a token sees: request ``r`` of the step is row ``rows[r]`` of the cache's
``req_to_token``; the keys are the first ``L`` positions of every request's row,
``[R * L]``, and token ``i`` (of request ``token_req[i]``, -1 for padding) sees key
``(r, j)`` when ``r == token_req[i]`` and ``j <= positions[i]`` (the cache's packed
mask: sliding windows per layer type too). ``rows`` and ``token_req`` are static
buffers the metadata hooks write before every capture and replay. Under
``capture="full"`` the mask and the gather are inside the graph, so ``R`` is the
graph's padded request count (padded requests are the dummy row 0) and ``L`` the
cache's ``max_context_len``; otherwise attention runs eagerly on the live batch, with
``R`` its request count and ``L`` its longest context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Tuple

import torch
from torch import nn

from ...runners.handles import op_handle
from ...runners.prefill_adapter import PrefillAdapter
from .attention import ROUTED_FAMILIES, SPLIT_OPS, route_attention
from .cache import PagedCache
from .rope import rope_types



@dataclass(frozen=True)
class PrefillStep:
    """One packed prefill step: token ``i`` is ``input_ids[i]`` at ``positions[i]``, its
    K and V to slot ``out_cache_loc[i]``; request ``r`` has ``extend_seq_lens_cpu[r]``
    consecutive tokens and is row ``req_pool_indices[r]``, ``seq_lens_cpu[r]`` long after."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_seq_lens_cpu: Tuple[int, ...]
    batch_size: int


def prefill_step(device: torch.device, chunks: Sequence[Tuple[int, int, Sequence[int], Sequence[int]]]
                 ) -> PrefillStep:
    """The step of ``chunks``: ``(row, start, tokens, slots)`` each, the tokens at
    positions ``start..`` of the request in cache row ``row``, their K and V to ``slots``."""
    ids = []
    pos = []
    loc = []
    for _, start, tokens, slots in chunks:
        ids += tokens
        pos += range(start, start + len(tokens))
        loc += slots

    def i64(values, dev=device):
        return torch.tensor(values, dtype=torch.int64, device=dev)

    return PrefillStep(i64(ids), i64(pos), i64(loc), i64([c[0] for c in chunks]),
                       i64([c[1] + len(c[2]) for c in chunks], "cpu"), tuple(len(c[2]) for c in chunks), len(chunks))


class PrefillMetadata:
    """Which keys each token of a prefill step sees (module docstring); one per adapter."""

    def __init__(self, cache: PagedCache, max_bs: int, max_num_tokens: int):
        self.cache = cache
        self.rows = torch.zeros(max_bs, dtype=torch.int64, device=cache.device)
        self.token_req = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=cache.device)
        self.requests = 0
        self.length = 1
        self.positions: Optional[torch.Tensor] = None
        self.loc: Optional[torch.Tensor] = None
        self._keys: Optional[Tuple[torch.Tensor, Any]] = None

    def write(self, view: Any, fb: Optional[PrefillStep], length: int) -> None:
        """Point at ``view``'s static positions and slots, and write ``fb``'s requests
        (None: none, a capture's dummy) into the buffers, padded to ``view.batch_size``
        rows (the graph's request slots under ``capture="full"``); ``length``: positions
        gathered per request."""
        n = view.positions.shape[0]
        bs = 0 if fb is None else fb.batch_size
        requests = max(view.batch_size, bs, 1)  # a capture's dummy batch attends over the dummy row
        if requests > self.rows.shape[0] or n > self.token_req.shape[0]:
            raise ValueError(f"prefill metadata for {requests} requests and {n} tokens; it holds "
                             f"{self.rows.shape[0]} and {self.token_req.shape[0]}")
        self.rows[bs:requests].zero_()
        self.token_req[:n].fill_(-1)
        if fb is not None:
            self.rows[:bs].copy_(fb.req_pool_indices, non_blocking=True)
            lens = torch.tensor(fb.extend_seq_lens_cpu)
            self.token_req[:int(lens.sum())].copy_(torch.repeat_interleave(torch.arange(bs), lens), non_blocking=True)
        self.requests = requests
        self.length = length
        self.positions = view.positions
        self.loc = view.out_cache_loc
        self.begin()

    def begin(self) -> None:
        """Forget the keys and mask made so far: the next layer makes them (at the start of
        every run of the stack, so a ``full`` capture makes them inside the graph)."""
        self._keys = None

    def keys_and_mask(self, layer: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[R * L]`` and the additive mask ``[1, 1, T, R * L]`` of ``layer``'s
        kind, made at the first layer that asks after :meth:`write` (inside the graph
        under ``capture="full"``) and shared by the rest."""
        if self._keys is None:
            r = self.requests
            length = self.length
            n = self.positions.shape[0]
            table = self.cache.req_to_token_pool.req_to_token
            slots = table.index_select(0, self.rows[:r])[:, :length].reshape(-1)
            key = torch.arange(r * length, device=slots.device)
            self._keys = slots, self.cache.packed_mask(self.token_req[:n], self.positions, key // length,
                                                      key % length, dtype)
        slots, mask = self._keys
        return slots, (mask[self.cache.layer_kinds[layer][0]] if isinstance(mask, dict) else mask)


class HFLayerStack(nn.Module):
    """The decoder layers of a Llama-like model and its final norm:
    ``(positions [T], hidden [T, H], metadata) -> hidden [T, H]``."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.rotary_emb = base.rotary_emb
        self.layers = base.layers
        self.norm = base.norm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: PrefillMetadata) -> torch.Tensor:
        pos = positions.unsqueeze(0)
        h = hidden.unsqueeze(0)
        rope = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope, graphslot_prefill=meta)
        return self.norm(h)[0]


class HFPrefillAdapter(PrefillAdapter):
    """Prefill runner adapter for a Llama-like causal LM writing into ``cache``."""

    split_ops = (SPLIT_OPS[1],)

    def __init__(self, model: Any, cache: PagedCache):
        family = getattr(model.config, "model_type", None)
        if family not in ROUTED_FAMILIES:
            raise ValueError(f"{type(model).__name__} (model_type {family!r}): the prefill layer stack runs "
                             f"Llama-like decoder layers only ({', '.join(ROUTED_FAMILIES)})")
        if model.training:
            raise ValueError(f"{type(model).__name__} is in training mode; call model.eval() first")
        kinds = rope_types(model)
        if kinds:
            raise ValueError(f"{type(model).__name__}: rope_type {kinds[0]!r} depends on each sequence's length, and "
                             "the prefill layer stack packs every request's tokens in one row, so they would share "
                             "one choice; prefill this model with ContinuousBatcher (longrope is chosen per request "
                             "there)")
        route_attention(model)
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.meta: Optional[PrefillMetadata] = None
        if not cache.geometry_probed:
            cache.probe(model)
        cache.pool  # allocated now: a graph (or a torch.compile trace) reads the pool, never makes it

    def layer_stack(self, model: nn.Module) -> nn.Module:
        return HFLayerStack(model.model)

    def run_layer_stack(self, stack: nn.Module, hidden: torch.Tensor, view: Any) -> torch.Tensor:
        self.meta.begin()
        return stack(view.positions, hidden, self.meta)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.model.dtype

    def embed(self, fb: PrefillStep) -> torch.Tensor:
        return self.model.get_input_embeddings()(fb.input_ids)

    def logits(self, hidden: torch.Tensor, fb: PrefillStep) -> torch.Tensor:
        return self.model.lm_head(hidden)

    def forward_eager(self, fb: PrefillStep) -> torch.Tensor:
        meta = PrefillMetadata(self.cache, fb.batch_size, fb.input_ids.shape[0])
        meta.write(fb, fb, _longest(fb))
        with torch.no_grad():
            hidden = HFLayerStack(self.model.model)(fb.positions, self.embed(fb), meta)
            return self.logits(hidden, fb)

    # -- attention metadata ----------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        meta = self.meta
        # Kept while large enough: graphs already captured read (and their ops find) this one.
        if meta is None or meta.rows.shape[0] < max_bs or meta.token_req.shape[0] < max_num_tokens:
            self.meta = PrefillMetadata(self.cache, max_bs, max_num_tokens)
            op_handle(self.meta)  # what the piecewise op finds it by

    def init_capture_metadata(self, num_tokens: int, view: Any) -> None:
        # Under capture="full" the graph gathers this many positions per request for good.
        self.meta.write(view, None, self.cache.max_context_len)

    def init_replay_metadata(self, num_tokens: int, view: Any, raw_fb: PrefillStep) -> None:
        # Read only where attention runs eagerly (a full graph replays its capture's length).
        self.meta.write(view, raw_fb, _longest(raw_fb))

    def make_dummy_batch(self, num_tokens: int) -> PrefillStep:
        def empty(device=self.device):
            return torch.zeros(0, dtype=torch.int64, device=device)

        return PrefillStep(empty(), empty(), empty(), empty(), empty("cpu"), (), 0)

    def static_tensors(self) -> Iterable[torch.Tensor]:
        yield from self.model.parameters()
        yield from self.model.buffers()
        yield from self.cache.static_tensors()
        if self.meta is not None:
            yield self.meta.rows
            yield self.meta.token_req


def _longest(fb: PrefillStep) -> int:
    return max(fb.seq_lens_cpu.tolist(), default=1)
