"""Data-parallel (DP) attention for the reference model, over ``torch.distributed``.

As in sglang's DP attention, each DP rank runs attention on its own requests, and the
MLP runs on the tokens of every rank: before each MLP, the ranks' hidden states are
all-gathered into one gathered buffer of ``global_dp_buffer_len`` rows (sized by the
runner through :meth:`DPAttention.set_dp_buffer_len`); after it, each rank takes its own
rows back (``dp_scatter``). The padding is sglang's ``MAX_LEN`` mode, the one CUDA graphs
use: every rank contributes the same number of rows ``L`` (its tokens, then zero rows),
so the gather is one ``all_gather_into_tensor`` of ``N * L`` rows and rank ``r``'s rows
start at ``r * L``.

The collective is called as the ops themselves (``torch.ops._c10d_functional``), which
both graph backends capture. The MLP weights are replicated, not sharded, so every row
comes out of the MLP as it would in one process: the DP model gives the single-process
model's logits, bit for bit where the matmul is batch-invariant (``numerics.py``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .adapter import ReferenceDecodeAdapter
from .forward_batch import ForwardBatch
from .model import ReferenceRuntime, TinyLlama


class DPAttention:
    """This rank's place in the DP group and the gather of the current step."""

    def __init__(self, group: Optional[Any] = None):
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.global_num_tokens: List[int] = []
        self.buffer_len = 0
        #: (this rank's rows, the gathered buffer) of the last gather that Python ran.
        self.last_gather: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def set_dp_buffer_len(self, global_num_tokens: List[int], global_dp_buffer_len: int) -> None:
        if len(global_num_tokens) != self.size or len(set(global_num_tokens)) != 1 \
                or global_dp_buffer_len != sum(global_num_tokens):
            raise ValueError(f"DP gather (MAX_LEN padding): expected one equal count per rank ({self.size}) "
                             f"summing to the buffer length, got {global_num_tokens} and {global_dp_buffer_len}")
        self.global_num_tokens = list(global_num_tokens)
        self.buffer_len = global_dp_buffer_len

    @property
    def local_len(self) -> int:
        return self.buffer_len // self.size

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` rows of this rank -> ``[N * L, H]`` rows of all ranks."""
        n = local.shape[0]
        rows = self.local_len
        if not 0 <= n <= rows:
            raise ValueError(f"DP gather: this rank has {n} rows, the buffer holds {rows} per rank; "
                             "set_dp_buffer_len was not called for this step")
        if n < rows:  # eager only: a graph always runs the agreed padded count
            local = torch.cat([local, local.new_zeros(rows - n, local.shape[1])])
        ops = torch.ops._c10d_functional
        gathered = ops.wait_tensor(ops.all_gather_into_tensor(local.contiguous(), self.size, self.group.group_name))
        self.last_gather = (local, gathered)
        return gathered

    def scatter(self, gathered: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's ``n`` rows of a gathered buffer."""
        start = self.rank * self.local_len
        return gathered[start:start + n]


def dp_forward(model: TinyLlama, dp: DPAttention, fb: ForwardBatch) -> torch.Tensor:
    """The reference model's forward with attention local and the MLP over all ranks."""
    hidden = fb.input_embeds if fb.input_embeds is not None else model.embed(fb.input_ids)
    n = hidden.shape[0]
    for layer in model.layers:
        if n:  # an idle rank (no requests) runs no attention, but joins every gather
            hidden = hidden + layer.self_attn(fb.positions, layer.input_layernorm(hidden), fb)
        gathered = dp.gather(layer.post_attention_layernorm(hidden))
        hidden = hidden + dp.scatter(layer.mlp(gathered), n)
    return model.logits(hidden)


class ReferenceDPDecodeAdapter(ReferenceDecodeAdapter):
    """The reference adapter with the DP model: the decode spec's gathered (DP) params on."""

    def __init__(self, runtime: ReferenceRuntime, dp: DPAttention):
        super().__init__(runtime)
        self.dp = dp
        #: Gathered buffer length -> the last layer's (rows, gathered buffer) of the graph
        #: captured for it: a replay rewrites both in place.
        self.graph_gathers: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        out = dp_forward(self.runtime.model, self.dp, fb)
        self.graph_gathers[self.dp.buffer_len] = self.dp.last_gather  # the capture runs last
        return out

    @torch.no_grad()
    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.batch_size:
            self.runtime.attn_backend.init_forward_metadata(fb)
        return dp_forward(self.runtime.model, self.dp, fb)

    def set_dp_buffer_len(self, global_num_tokens_cpu: List[int], global_dp_buffer_len: int) -> None:
        super().set_dp_buffer_len(global_num_tokens_cpu, global_dp_buffer_len)
        self.dp.set_dp_buffer_len(global_num_tokens_cpu, global_dp_buffer_len)

    def spec_params(self) -> Mapping[str, Any]:
        return {**super().spec_params(), "require_gathered_buffer": True, "require_mlp_tp_gather": True,
                "dp_size": self.dp.size}
