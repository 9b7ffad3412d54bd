"""What a prefill graph runner needs to know about one engine.

The prefill runner captures the *layer stack* only, over token-padded static buffers
(in the breakable and piecewise capture modes the graph never depends on the batch
size; under ``full`` it is keyed by the padded request count too). The engine
names that boundary explicitly through :meth:`PrefillAdapter.layer_stack`; the runner
never guesses it from attribute names.

Runner sequence per token bucket ``n`` (largest first)::

    init_graph_state(max_bs, max_num_tokens)          # once, before any capture
    registry.run_pre_capture(0, n, side_inputs())
    dummy = make_dummy_batch(n)                       # fills the padded rows only
    init_capture_metadata(n, view)
    capture(lambda: run_layer_stack(stack, view.input_embeds, view))

and per replayed batch ``fb`` (``raw_tokens <= n``)::

    fill registry; input_embeds[:raw_tokens] = embed(fb)
    init_replay_metadata(n, view, fb)                 # EVERY replay, on the live batch
    replay; logits(hidden[:raw_tokens], fb)           # eager tail, live metadata
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from .batch import count_requests
from .contract import AdapterStatics


class LayerStackError(TypeError):
    """The adapter does not name the layer stack a prefill runner captures."""


class PrefillAdapter(AdapterStatics):
    """Base class of prefill adapters; subclass and implement :attr:`REQUIRED_HOOKS`
    (``model``, ``hidden_size`` and ``hidden_dtype`` may be attributes or properties)."""

    #: What a subclass must provide; a runner names every one missing at once.
    REQUIRED_HOOKS = ("model", "layer_stack", "hidden_size", "hidden_dtype", "embed", "logits", "forward_eager",
                      "make_dummy_batch", "init_capture_metadata", "init_replay_metadata")

    #: Device the registry's buffers and the graphs live on. Not set: the device of the
    #: model's weights; neither is an error at construction.
    device: torch.device
    #: The custom ops (``"ns::name"``) ``capture="piecewise"`` splits the compiled layer
    #: stack at, unless its config names them; None: none.
    split_ops: Optional[Sequence[str]] = None

    # -- the capture boundary ------------------------------------------------------
    #: The model (an attribute or a property); its weights are static by default.
    model: nn.Module

    def layer_stack(self, model: nn.Module) -> nn.Module:
        """The module whose forward is the captured layer stack. Required: no default."""
        raise NotImplementedError

    def run_layer_stack(self, stack: nn.Module, hidden: torch.Tensor, view: Any) -> torch.Tensor:
        """Run the stack on ``hidden`` ``[padded_tokens, H]`` of a padded view batch."""
        return stack(view.positions, hidden, view)

    #: Width of the hidden states the stack takes and returns (``H``).
    hidden_size: int
    #: Their dtype (the static ``input_embeds`` buffer's).
    hidden_dtype: torch.dtype

    # -- the eager head and tail ---------------------------------------------------
    def embed(self, fb: Any) -> torch.Tensor:
        """Embeddings of the raw batch's tokens, ``[raw_tokens, H]`` (eager)."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor, fb: Any) -> Any:
        """The eager tail on the raw rows of the stack's output."""
        raise NotImplementedError

    def forward_eager(self, fb: Any) -> Any:
        """The full eager forward of any batch (the fallback)."""
        raise NotImplementedError

    # -- attention metadata --------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the attention backend's static metadata buffers."""

    def init_capture_metadata(self, num_tokens: int, view: Any) -> None:
        """Metadata for the all-padding dummy batch about to be captured."""
        raise NotImplementedError

    def init_replay_metadata(self, num_tokens: int, view: Any, raw_fb: Any) -> None:
        """Metadata of the live batch ``raw_fb`` padded to ``num_tokens`` rows; runs
        before every replay."""
        raise NotImplementedError

    def make_dummy_batch(self, num_tokens: int) -> Any:
        """A batch with no requests and no tokens (the registry fill pads everything)."""
        raise NotImplementedError

    # -- reading a batch -----------------------------------------------------------
    def is_prefill(self, fb: Any) -> bool:
        """Whether ``fb`` is a prefill: an sglang-style ``forward_mode`` (one with
        ``is_extend()``) says so; a batch type without one is taken for a prefill, as
        the engine is what hands it to a prefill runner (override to refuse some)."""
        mode = getattr(fb, "forward_mode", None)
        if mode is not None and hasattr(mode, "is_extend"):
            return bool(mode.is_extend())
        return True

    def batch_size(self, fb: Any) -> int:
        """Requests in ``fb``: ``fb.batch_size``, else the rows of ``fb.seq_lens``."""
        return count_requests(self, "PrefillAdapter", fb)

    def num_tokens(self, fb: Any) -> int:
        return int(fb.input_ids.shape[0])

    # -- the rest of the engine ----------------------------------------------------
    def spec_params(self) -> Mapping[str, Any]:
        """Prefill spec params this engine implies (runner config overrides them)."""
        return {}

    def side_inputs(self) -> Mapping[str, Any]:
        return {}


def resolve_layer_stack(adapter: PrefillAdapter) -> nn.Module:
    """The adapter's layer stack, or a :class:`LayerStackError` saying what to write."""
    hint = (f"{type(adapter).__name__} must implement layer_stack(model) and return the "
            "nn.Module whose forward is the model's layer stack (the capture boundary); "
            "the runner does not guess it from attribute names such as model.layers")
    try:
        stack = adapter.layer_stack(adapter.model)
    except NotImplementedError:
        raise LayerStackError(f"no layer stack: {hint}") from None
    if not isinstance(stack, nn.Module):
        raise LayerStackError(f"layer_stack() returned {type(stack).__name__}, not an nn.Module: {hint}")
    if isinstance(stack, (nn.ModuleList, nn.ModuleDict)):
        raise LayerStackError(f"layer_stack() returned an {type(stack).__name__}, which has no forward; "
                              "wrap it in a module that runs the layers in order")
    return stack
