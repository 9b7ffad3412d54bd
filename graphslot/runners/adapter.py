"""What a graph runner needs to know about one engine: model, batch type, attention.

The decode and eager runners are written once against :class:`DecodeAdapter`; an
engine supplies a subclass. The hooks follow sglang's ``CudaGraphRunner`` and field
names (``batch_size``, ``forward_mode``, ``global_num_tokens_cpu``), so the defaults
below already fit an sglang-style ``ForwardBatch``; only the abstract ones must be
written. No default needs an sglang-only field: each reader says what it falls back
to on a batch type without it (a plain dataclass of tensors is enough).

Runner sequence per captured size ``bs`` (``num_tokens = bs * k``)::

    init_graph_state(max_bs, max_num_tokens)          # once, before any capture
    registry.run_pre_capture(bs, num_tokens, side_inputs())
    set_dp_buffer_len(global_num_tokens_cpu, sum)     # gathered (DP) buffers only
    dummy = make_dummy_batch(bs, num_tokens)          # fills the padded rows only
    init_capture_metadata(bs, num_tokens, view)
    capture(lambda: forward(view))

and per replayed batch ``fb``::

    init_replay_metadata(padded_bs, view, fb); replay
    slice_output(out, raw_bs, raw_tokens, padded_bs=..., padded_num_tokens=...)

With context buckets (``DecodeRunnerConfig.context_buckets``) a graph is captured per
``(bs, L)``: ``set_context_bucket(L)`` comes first in the capture sequence above, and per
step the runner reads ``context_len(fb)`` (host data only), picks the bucket ``L`` and
calls ``set_context_bucket(L)`` before the fill and ``init_replay_metadata``. Both hooks
have defaults, so an adapter that knows nothing of buckets runs unchanged.

When a runner is built it first checks the contract (:mod:`graphslot.runners.contract`):
every hook in :attr:`DecodeAdapter.REQUIRED_HOOKS` the subclass does not implement is
named in one error, and ``device`` is the adapter's or its model's. Before any capture
it checks that ``make_dummy_batch`` has every field the spec copies, and that the
readers below work on it (:mod:`graphslot.runners.batch`).

What a graph may read without its being a stale input: the slot buffers,
``static_tensors()`` and the parameters and buffers of ``static_modules()`` (by default
the adapter's ``nn.Module`` attributes, so ``self.model`` is declared by being there).
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

import torch

from .batch import count_requests
from .contract import AdapterStatics
from .outputs import slice_rows


class DecodeAdapter(AdapterStatics):
    """Base class of engine adapters; subclass and implement :attr:`REQUIRED_HOOKS`."""

    #: The hooks a subclass must implement; a runner names every one missing at once.
    REQUIRED_HOOKS = ("forward", "forward_eager", "make_dummy_batch", "init_capture_metadata",
                      "init_replay_metadata")

    #: Device the registry's buffers and the graphs live on. Not set: the device of the
    #: model's weights (``static_modules()``); neither is an error at construction.
    device: torch.device
    #: The custom ops (``"ns::name"``) ``capture="piecewise"`` splits the compiled forward
    #: at, unless the runner's config names them; None: none.
    split_ops: Optional[Sequence[str]] = None

    # -- what the graph runs -------------------------------------------------------
    def forward(self, fb: Any) -> Any:
        """The captured computation on a padded view batch; returns static outputs.

        Must read attention metadata prepared by the metadata hooks, never compute it.
        """
        raise NotImplementedError

    def forward_eager(self, fb: Any) -> Any:
        """The eager forward of any batch (metadata computed on the spot)."""
        raise NotImplementedError

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the attention backend's static metadata buffers."""

    def init_capture_metadata(self, bs: int, num_tokens: int, view: Any) -> None:
        """Write metadata for the dummy batch about to be captured."""
        raise NotImplementedError

    def init_replay_metadata(self, bs: int, view: Any, raw_fb: Any) -> None:
        """Rewrite the static metadata in place for a padded view of ``bs`` rows."""
        raise NotImplementedError

    def make_dummy_batch(self, bs: int, num_tokens: int) -> Any:
        """A batch of the engine's type whose registry fill (raw size 0) is all padding."""
        raise NotImplementedError

    # -- reading a batch -----------------------------------------------------------
    def batch_size(self, fb: Any) -> int:
        """Requests in ``fb``: ``fb.batch_size``, else the rows of ``fb.seq_lens``."""
        return count_requests(self, "DecodeAdapter", fb)

    def num_tokens(self, fb: Any) -> int:
        return int(fb.input_ids.shape[0])

    def tokens_per_bs(self, fb: Any) -> Optional[int]:
        """Tokens per request if ``fb`` is graph-runnable (decode / verify), else None.

        A batch with an sglang-style ``forward_mode`` (one with ``is_decode()``) is
        judged by it: decode is 1, target-verify ``fb.num_tokens_per_bs``, the rest
        None. A batch type without one is taken for a decode step, so the rule is
        ``num_tokens // batch_size`` when that divides evenly (1 for plain decode), else
        None. An engine whose batches without a mode can also be prefills of one token
        per request, where that is not the same computation as a decode step, must
        override this.
        """
        mode = getattr(fb, "forward_mode", None)
        if mode is not None and hasattr(mode, "is_decode"):
            if mode.is_decode():
                return 1
            is_verify = getattr(mode, "is_target_verify", None)
            if is_verify is not None and is_verify():
                return int(fb.num_tokens_per_bs)
            return None
        bs = self.batch_size(fb)
        n = self.num_tokens(fb)
        if bs < 1 or n < bs or n % bs:
            return None
        return n // bs

    def context_len(self, fb: Any) -> int:
        """The longest context among ``fb``'s requests (the positions a row's attention
        reads in this step, its ``seq_len`` after it), from host data only: never read
        device memory here, it runs every step. Default: the largest of
        ``fb.seq_lens_cpu`` over the batch's rows (0 for a batch without rows). Read only
        when the runner has context buckets."""
        lens = getattr(fb, "seq_lens_cpu", None)
        if lens is None:
            raise AttributeError(f"a batch of type {type(fb).__name__} has no `seq_lens_cpu`; context buckets need "
                                 "each step's longest context from the host: override DecodeAdapter.context_len")
        if isinstance(lens, torch.Tensor):
            if lens.device.type != "cpu":
                raise ValueError(f"{type(fb).__name__}.seq_lens_cpu is on {lens.device}; reading it would wait for "
                                 "the device every step: keep a host copy, or override DecodeAdapter.context_len")
            lens = lens.tolist()
        return max(lens[:self.batch_size(fb)], default=0)

    def set_context_bucket(self, context_len: int) -> None:
        """The context bucket the next capture or replayed step runs at (context buckets
        only): called before a ``(bs, L)`` graph is captured and before each replayed
        step's fill and ``init_replay_metadata``. Size what the forward gathers and masks
        to ``context_len`` positions per row. Default: nothing."""

    @property
    def max_context_len(self) -> Optional[int]:
        """The longest context a request can have (what ``context_buckets="auto"`` ladders
        up to), or None when the adapter cannot say."""
        return None

    def global_num_tokens_cpu(self, fb: Any) -> Optional[List[int]]:
        """Per-DP-rank token counts of this step, when the engine runs data parallel."""
        return getattr(fb, "global_num_tokens_cpu", None)

    def slice_output(self, output: Any, raw_bs: int, raw_num_tokens: int, *,
                     padded_bs: int, padded_num_tokens: int) -> Any:
        """The rows of the static outputs that belong to the raw batch.

        Every tensor in tensors, tuples, lists, mappings and dataclasses (transformers'
        ``ModelOutput`` too) is cut along dim 0: ``padded_num_tokens`` rows to
        ``raw_num_tokens``, ``padded_bs`` rows to ``raw_bs``. Anything it cannot cut is
        an error naming the type and where it is (:mod:`graphslot.runners.outputs`):
        padded rows are never handed back.
        """
        return slice_rows(output, raw_bs, raw_num_tokens, padded_bs, padded_num_tokens)

    # -- the rest of the engine ----------------------------------------------------
    def spec_params(self) -> Mapping[str, Any]:
        """Decode spec params this engine implies (runner config overrides them)."""
        return {}

    @property
    def max_requests(self) -> Optional[int]:
        """How many requests a batch can ever hold (the request pool), or None."""
        return None

    def side_inputs(self) -> Mapping[str, Any]:
        """What slot hooks get as ``ctx.side_inputs`` (e.g. ``token_to_kv_pool``)."""
        return {}

    def set_dp_buffer_len(self, global_num_tokens_cpu: List[int], global_dp_buffer_len: int) -> None:
        """Size the DP gather buffers before capture (sglang's ``set_dp_buffer_len``)."""
