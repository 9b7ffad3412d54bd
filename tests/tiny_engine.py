"""A tiny engine of its own, as an adopter writes one: its own spec, batch dataclass,
torch model (weights and a buffer) and :class:`DecodeAdapter`, nothing of the
reference package. The adapter declares nothing static and sets no device: the model
being an attribute is all it says."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import graphslot as gs
from graphslot.runners import DecodeAdapter, DecodeGraphRunner

SPEC = gs.parse_spec("""
name: tiny_decode
slots:
  - {name: input_ids, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: foreach_copy}
  - {name: positions, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: zero, index: true}
  - {name: seq_lens, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: 1}
""", path="tests/tiny_engine.py")


@dataclass
class Step:
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor


def step(n: int, first: int = 3) -> Step:
    ids = torch.arange(first, first + n)
    return Step(n, ids, ids % 8, ids % 8 + 1)


class Model(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("scale", torch.full((hidden,), 0.5))

    def forward(self, ids, positions, lens):
        h = self.embed(ids) * self.scale + positions.unsqueeze(1) / lens.unsqueeze(1)
        return self.head(h)


class Adapter(DecodeAdapter):
    def __init__(self, model: nn.Module):
        self.model = model

    def forward(self, b):
        return self.model(b.input_ids, b.positions, b.seq_lens)

    forward_eager = forward

    def make_dummy_batch(self, bs, num_tokens):
        return step(0)

    def init_capture_metadata(self, bs, num_tokens, view):
        pass

    def init_replay_metadata(self, bs, view, raw_fb):
        pass


def runner(max_bs: int = 4, **overrides) -> DecodeGraphRunner:
    overrides.setdefault("progress", False)
    return DecodeGraphRunner(Adapter(Model()), spec=SPEC, max_bs=max_bs, backend="cpu", **overrides)
