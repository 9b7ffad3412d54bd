"""What the drop-in reads from sglang itself, always looked up when it is used.

sglang's share pool, its parallel state and its index-semantic set belong to sglang's
modules: the drop-in reaches them through ``sys.modules`` at call time, so a test that
clears the pool or patches ``forward_batch_info.get_parallel`` is seen, and importing
``graphslot.integrations.sglang`` never imports sglang.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Tuple

import torch

INPUT_BUFFERS = "sglang.srt.model_executor.input_buffers"
FORWARD_BATCH_INFO = "sglang.srt.model_executor.forward_batch_info"


def sglang_module(name: str) -> Any:
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"graphslot.integrations.sglang needs sglang's {name} here (sglang 0.5.23 installed "
                          f"and importable): {exc}") from exc


class SglangSharePool:
    """graphslot's :class:`~graphslot.SharePool` over sglang's process-wide pool
    (``input_buffers.share_input_buffer``): buffers are shared by (name, numel,
    dtype, device) with sglang's own ``share_buffers()`` callers, the first registrant
    canonical. Every share is *fresh*, so the registry fills the init value after
    sharing, as sglang's ``register_slot`` does (the last registrant's value wins)."""

    def share(self, name: str, tensor: torch.Tensor, init_value: Any = None) -> Tuple[torch.Tensor, bool]:
        return sglang_module(INPUT_BUFFERS).share_input_buffer(name, tensor), True

    def __repr__(self) -> str:
        return "SglangSharePool()"


SGLANG_POOL = SglangSharePool()


def attn_tp_rank(ctx: Any) -> int:
    """Live param provider: this rank in its attention-TP group, from sglang's
    ``forward_batch_info.get_parallel()`` (read only when the count is sharded)."""
    return sglang_module(FORWARD_BATCH_INFO).get_parallel().attn_tp_rank


def attn_tp_size(ctx: Any) -> int:
    """Live param provider: the attention-TP group size (as :func:`attn_tp_rank`)."""
    return sglang_module(FORWARD_BATCH_INFO).get_parallel().attn_tp_size


def index_semantic_buffers() -> frozenset:
    """sglang's ``INDEX_SEMANTIC_BUFFERS``: the slots it resets by index."""
    return frozenset(sglang_module(INPUT_BUFFERS).INDEX_SEMANTIC_BUFFERS)
