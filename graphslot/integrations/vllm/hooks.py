"""The source hooks of ``graphslot/slot_specs/vllm.yaml``: what vLLM 0.32's ``_prepare_inputs`` computes per
token, computed on the host from a :class:`~.step.VllmStep` (``fb``) and copied into the slot's host buffer by the
fill. vLLM computes ``positions`` and ``slot_mapping`` on the device; the values are the same (docs/vllm.md).

Each is ``source(fb, ctx) -> tensor`` of the step's ``T`` rows. Importing this module imports neither vLLM nor
anything of vLLM's (``graphslot validate --import-hooks`` imports it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def input_ids(fb: Any, ctx: Any) -> torch.Tensor:
    """Each token's id: ``token_ids[req, position]``, gathered from the flat token table as vLLM's
    ``torch.index_select`` does (int32, the table's dtype)."""
    flat = fb.token_positions + fb.req_indices * fb.token_ids.shape[1]
    return torch.index_select(fb.token_ids.flatten(), 0, torch.from_numpy(flat))


def positions(fb: Any, ctx: Any) -> torch.Tensor:
    """Each token's position (int64): ``num_computed_tokens[req]`` plus its index among the request's tokens."""
    return torch.from_numpy(fb.token_positions)


def slot_mapping(fb: Any, ctx: Any) -> torch.Tensor:
    """The KV slot each token writes (int64): ``block_table[req, pos // block_size] * block_size + pos %
    block_size``, read from the host block table (the rows the fill stages to the device this step)."""
    size = fb.block_size
    blocks = fb.block_table[fb.req_indices, fb.token_positions // size].astype(np.int64)
    return torch.from_numpy(blocks * size + fb.token_positions % size)
