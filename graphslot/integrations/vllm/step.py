"""One step of vLLM 0.32's V1 runner, as ``_prepare_inputs`` computes it on the host: the batch (``fb``) that
``graphslot/slot_specs/vllm.yaml``'s registry fills from.

:class:`VllmStep` holds what the slots copy (``query_start_loc``, ``seq_lens``, ``discard_request_mask``) and what
the source hooks of :mod:`.hooks` compute from (each token's request and position, the token table, the block
table). It reads the runner's state and writes nothing: the registry's fill does every write. Importing it imports
neither vLLM nor anything of vLLM's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class VllmStep:
    """The host arithmetic of one step (``_prepare_inputs`` up to its first write), for ``R`` requests and ``T``
    scheduled tokens:

    - ``req_indices`` (``[T]``): each token's request row; ``token_positions`` (``[T]``, int64): its position,
      ``num_computed_tokens[req] +`` its index within the request's tokens this step;
    - ``query_start_loc`` (``[R + 1]``, int32): ``0`` then the running sum of ``num_scheduled_tokens``;
    - ``seq_lens`` (``[R]``, int32): ``num_computed_tokens + num_scheduled_tokens``;
    - ``discard_request_mask`` (``[R]``, bool): ``seq_lens`` short of the request's tokens (a prefill chunk);
    - ``token_ids`` (the runner's ``[max_num_reqs, max_model_len]`` token table), ``block_table`` (the KV group's
      host block table, numpy) and ``block_size``, which :mod:`.hooks` read;
    - ``runner``: the runner itself (None for a step made by hand), for the hooks of a slot a fork adds.
    """

    __slots__ = ("num_reqs", "num_tokens", "req_indices", "token_positions", "query_start_loc", "seq_lens",
                 "discard_request_mask", "token_ids", "block_table", "block_size", "runner")

    def __init__(self, num_reqs: int, num_scheduled_tokens: np.ndarray, num_computed_tokens: np.ndarray,
                 request_tokens: np.ndarray, token_ids: torch.Tensor, block_table: np.ndarray, block_size: int):
        scheduled = np.asarray(num_scheduled_tokens)
        if scheduled.shape != (num_reqs,):
            raise ValueError(f"VllmStep: num_scheduled_tokens has shape {scheduled.shape}, expected ({num_reqs},)")
        cumsum = np.cumsum(scheduled)
        total = int(cumsum[-1]) if num_reqs else 0
        self.num_reqs = num_reqs
        self.num_tokens = total
        self.req_indices = np.repeat(np.arange(num_reqs), scheduled)
        within = np.arange(total) - np.repeat(cumsum - scheduled, scheduled)  # 0, 1, .. per request
        computed = np.asarray(num_computed_tokens[:num_reqs])
        self.token_positions = computed[self.req_indices].astype(np.int64) + within
        starts = np.zeros(num_reqs + 1, dtype=np.int32)
        starts[1:] = cumsum
        self.query_start_loc = torch.from_numpy(starts)
        lengths = (computed + scheduled).astype(np.int32)
        self.seq_lens = torch.from_numpy(lengths)
        self.discard_request_mask = torch.from_numpy(lengths < np.asarray(request_tokens[:num_reqs]))
        self.token_ids = token_ids
        self.block_table = block_table
        self.block_size = block_size
        self.runner = None

    @classmethod
    def of_runner(cls, runner: Any, num_scheduled_tokens: np.ndarray) -> "VllmStep":
        """The step ``runner`` (a ``GPUModelRunner``) is about to run: its input batch's first ``num_reqs`` rows
        and the one KV-cache group's block table (the plugin refuses more before it gets here)."""
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        request_tokens = np.array([runner.requests[r].num_tokens for r in batch.req_ids[:num_reqs]], dtype=np.int64)
        group = batch.block_table[0]
        step = cls(num_reqs, num_scheduled_tokens, batch.num_computed_tokens_cpu, request_tokens,
                   batch.token_ids_cpu_tensor, group.block_table.np, group.block_size)
        step.runner = runner
        return step

    def __repr__(self) -> str:
        return f"VllmStep(num_reqs={self.num_reqs}, num_tokens={self.num_tokens})"
