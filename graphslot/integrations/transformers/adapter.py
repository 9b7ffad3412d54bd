"""The decode runner's adapter for transformers causal LMs whose attention uses the cache.

The model runs unchanged: the adapter calls ``model(input_ids=[B, T],
position_ids=[B, T], attention_mask=<mask>, past_key_values=<PagedCache>)`` on the
view of a step, so the layers' ``past_key_values.update`` calls land in the paged pool
(:mod:`.cache`) and the mask, computed on the device from ``positions``, says what each
row sees. No attention metadata lives outside the graph, so the capture and replay
metadata hooks have nothing to do.

Context buckets: the adapter implements the runner's hooks. ``context_len`` is the
default (the largest ``seq_lens_cpu``); :meth:`HFDecodeAdapter.set_context_bucket`
notes the bucket, and a graph's forward gathers and masks that many positions per row
(``cache.gathering``). An eager forward gathers ``max_context_len``.

Before any capture the adapter probes the model (:meth:`.cache.PagedCache.probe`): one
eager forward of one token learns what each layer writes, so the pool holds the heads
and widths the model really caches, and a family whose layers do not all cache through
``past_key_values.update`` is refused there. While a graph is captured, the forward
runs the family's capturable stand-ins (:func:`.families.capture_shims`).

The families the tests cover are :data:`TESTED_FAMILIES` (tests/test_hf_families.py:
each one's tiny model from :data:`.models.FAMILIES` decodes like transformers and
greedy-generates what ``model.generate`` does); another ``model_type`` is refused
unless ``allow_untested=True``, because a model that builds its own mask or keeps other
state per step would decode wrong without an error. Some families are refused always,
with the reason (:data:`.families.REFUSED`, eager experts, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch

from ...runners.adapter import DecodeAdapter
from .attention import ROUTED_FAMILIES, SPLIT_OPS, inner_implementation, route_attention
from .cache import PagedCache
from .families import capture_shims, family_problem
from .forward import with_cache
from .models import TESTED_FAMILIES
from .rope import per_row_rope, rope_problem
#: Attention implementations that take the cache's additive 4-D mask.
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


@dataclass(frozen=True)
class DecodeStep:
    """One decode step in the decode spec's field names; no ``forward_mode``.

    Frozen: the runner never writes a batch, its views are copies. Token fields are
    request-major (``[batch_size * tokens_per_request]``); ``positions`` is where each
    new token goes (the request's length before the step) and ``seq_lens`` the length
    after it.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    batch_size: int


def check_model(model: Any, allow_untested: bool = False, max_context_len: Optional[int] = None) -> None:
    """Refuse, saying why, a model the adapter would run wrong (or could not capture)."""
    config = model.config
    family = getattr(config, "model_type", None)
    problem = family_problem(model, max_context_len) or rope_problem(model)
    if problem is not None:
        raise ValueError(f"{type(model).__name__}: {problem}")
    if family not in TESTED_FAMILIES and not allow_untested:
        raise ValueError(f"{type(model).__name__} (model_type {family!r}) is not a tested family "
                         f"({', '.join(TESTED_FAMILIES)}); pass allow_untested=True if its attention calls "
                         "past_key_values.update and uses a 4-D attention_mask as given, and compare its "
                         "output with plain transformers decode")
    impl = inner_implementation(config)
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{type(model).__name__} uses attn_implementation {config._attn_implementation!r}; the "
                         f"paged cache's 4-D mask needs one of {', '.join(ATTENTION_IMPLEMENTATIONS)} (load the "
                         "model with attn_implementation='sdpa')")
    if model.training:
        raise ValueError(f"{type(model).__name__} is in training mode (dropout would differ per replay); call "
                         "model.eval() first")


class HFDecodeAdapter(DecodeAdapter):
    """:class:`DecodeGraphRunner` adapter for a transformers causal LM over a :class:`PagedCache`.

    A model of :data:`.attention.ROUTED_FAMILIES` has its attention routed
    (:mod:`.attention`), so breakable and piecewise captures cut there."""

    split_ops = (SPLIT_OPS[0],)

    def __init__(self, model: Any, cache: PagedCache, *, allow_untested: bool = False):
        check_model(model, allow_untested, cache.max_context_len)
        self.model = model
        self.cache = cache
        self.device = cache.device
        self._bucket: Optional[int] = None  # the context bucket of the next capture; None: max_context_len
        if getattr(model.config, "model_type", None) in ROUTED_FAMILIES:
            route_attention(model)
        if not cache.geometry_probed:
            cache.probe(model)
        #: The forward's cache argument, read once (torch.compile would trace the signature probe).
        self._cache_arg = with_cache(model, cache)
        cache.pool  # allocated now: a graph (or a torch.compile trace) reads the pool, never makes it

    def run(self, step: Any) -> torch.Tensor:
        """Logits ``[num_tokens, vocab]`` of a step (a view or a live batch)."""
        bs = self.batch_size(step)
        ids = step.input_ids.view(bs, -1)
        pos = step.positions.view(bs, -1)
        self.cache.bind(step.out_cache_loc, step.req_pool_indices)
        with torch.no_grad(), per_row_rope(self.model):
            out = self.model(input_ids=ids, position_ids=pos, **self._cache_arg, use_cache=True,
                             attention_mask=self.cache.attention_mask(pos, self.model.dtype))
        return out.logits.flatten(0, 1)

    def forward(self, view: Any) -> torch.Tensor:
        """The captured forward: gathers the context bucket set last, runs the family's shims."""
        with self.cache.gathering(self._bucket), capture_shims(self.model):
            return self.run(view)

    def forward_eager(self, fb: Any) -> torch.Tensor:
        return self.run(fb)

    def set_context_bucket(self, context_len: int) -> None:
        self._bucket = context_len

    @property
    def max_context_len(self) -> int:
        return self.cache.max_context_len

    def init_capture_metadata(self, bs: int, num_tokens: int, view: Any) -> None:
        """Nothing: the mask is computed inside the graph from the static positions."""

    def init_replay_metadata(self, bs: int, view: Any, raw_fb: Any) -> None:
        """Nothing: see :meth:`init_capture_metadata`."""

    def make_dummy_batch(self, bs: int, num_tokens: int) -> DecodeStep:
        def empty(device=self.device):
            return torch.zeros(0, dtype=torch.int64, device=device)

        return DecodeStep(empty(), empty(), empty(), empty(), empty(), empty("cpu"), 0)

    def spec_params(self) -> Mapping[str, Any]:
        # Padded rows: length 1 at position 0 of the dummy row, so they see slot 0 only.
        return {"seq_len_fill_value": 1}

    @property
    def max_requests(self) -> Optional[int]:
        return self.cache.max_requests

    def static_tensors(self) -> Iterable[torch.Tensor]:
        yield from self.model.parameters()
        yield from self.model.buffers()
        yield from self.cache.static_tensors()
