"""What a graph runner needs to know about one engine: model, batch type, attention.

The decode and eager runners are written once against :class:`DecodeAdapter`; an
engine supplies a subclass. The hooks follow sglang's ``CudaGraphRunner`` and field
names (``batch_size``, ``forward_mode``, ``global_num_tokens_cpu``), so the defaults
below already fit an sglang-style ``ForwardBatch``; only the abstract ones must be
written.

Runner sequence per captured size ``bs`` (``num_tokens = bs * k``)::

    init_graph_state(max_bs, max_num_tokens)          # once, before any capture
    registry.run_pre_capture(bs, num_tokens, side_inputs())
    set_dp_buffer_len(global_num_tokens_cpu, sum)     # gathered (DP) buffers only
    dummy = make_dummy_batch(bs, num_tokens)          # fills the padded rows only
    init_capture_metadata(bs, num_tokens, view)
    capture(lambda: forward(view))

and per replayed batch ``fb``::

    init_replay_metadata(padded_bs, view, fb); replay; slice_output(out, raw_bs, raw_tokens)
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional

import torch


class DecodeAdapter:
    """Base class of engine adapters; subclass and implement the abstract hooks."""

    #: Device the registry's buffers and the graphs live on.
    device: torch.device = torch.device("cpu")

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
        return int(fb.batch_size)

    def num_tokens(self, fb: Any) -> int:
        return int(fb.input_ids.shape[0])

    def tokens_per_bs(self, fb: Any) -> Optional[int]:
        """Tokens per request if ``fb`` is graph-runnable (decode / verify), else None."""
        mode = fb.forward_mode
        if mode.is_decode():
            return 1
        if mode.is_target_verify():
            return int(fb.num_tokens_per_bs)
        return None

    def global_num_tokens_cpu(self, fb: Any) -> Optional[List[int]]:
        """Per-DP-rank token counts of this step, when the engine runs data parallel."""
        return getattr(fb, "global_num_tokens_cpu", None)

    def slice_output(self, output: Any, raw_bs: int, raw_num_tokens: int) -> Any:
        """The rows of the static outputs that belong to the raw batch."""
        if isinstance(output, torch.Tensor):
            return output[:raw_num_tokens]
        if isinstance(output, (tuple, list)):
            return type(output)(self.slice_output(o, raw_bs, raw_num_tokens) for o in output)
        return output

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

    def static_tensors(self) -> Iterable[torch.Tensor]:
        """Tensors a graph may read that are legitimately static: weights, KV and
        request pools, attention metadata buffers. Anything else a graph reads that
        is not a slot buffer is a stale input (see ``external_inputs``)."""
        return ()
