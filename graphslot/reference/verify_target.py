"""The reference model as a ``graphslot verify`` target: what the command runs with no
code of yours (``graphslot verify`` / ``--reference``)."""

from __future__ import annotations

import random
from typing import Any

import torch

from ..runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from ..tools.verify import VerifyTarget
from .adapter import ReferenceDecodeAdapter
from .model import TinyConfig, build_reference_model
from .scheduler import make_decode_batch, make_extend_batch


def reference_target(backend: str = "auto", max_bs: int = 8, spec: Any = "decode", seed: int = 0,
                     config: TinyConfig = None) -> VerifyTarget:
    """The reference model behind a decode runner, with ``max_bs`` requests prefilled;
    ``make_batch(n)`` decodes one token for the first ``n`` of them."""
    cuda = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    rt = build_reference_model(config, device="cuda" if cuda else "cpu", seed=seed, max_num_reqs=max_bs)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), DecodeRunnerConfig(
        max_bs=max_bs, spec=spec, backend=backend, progress=False))
    rng = random.Random(seed)
    vocab, ctx = rt.config.vocab_size, rt.config.max_context_len
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, ctx // 2))] for _ in range(max_bs)]
    rpi = rt.req_to_token_pool.alloc(max_bs)
    rt.forward(make_extend_batch(rt, rpi, [0] * max_bs, prompts))
    lens = [len(p) for p in prompts]

    def make_batch(raw_bs: int) -> Any:
        return make_decode_batch(rt, rpi[:raw_bs], lens[:raw_bs], [rng.randrange(1, vocab) for _ in range(raw_bs)])

    def release(fb: Any) -> None:
        rt.token_to_kv_pool.free(fb.out_cache_loc)

    name = spec if isinstance(spec, str) else getattr(spec, "name", "spec")
    return VerifyTarget(runner, make_batch, release, label=f"reference model, spec {name}, max_bs {max_bs}")
