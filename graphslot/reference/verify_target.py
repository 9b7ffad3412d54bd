"""The reference model as a ``graphslot verify`` target: what the command runs with no
code of yours (``graphslot verify`` / ``--reference``), and its prefill runner
(:func:`reference_prefill_target`)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from ..runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from ..runners.prefill import PrefillGraphRunner, PrefillRunnerConfig
from ..spec.errors import SlotError
from ..spec.loading import load_spec
from ..spec.resolve import resolve_params, resolve_slots
from ..tools.verify import TargetError, VerifyTarget
from .adapter import ReferenceDecodeAdapter
from .forward_batch import ForwardBatch
from .model import TinyConfig, build_reference_model
from .prefill_adapter import ReferencePrefillAdapter
from .scheduler import make_decode_batch, make_extend_batch


def reference_target(backend: str = "auto", max_bs: int = 8, spec: Any = "decode", seed: int = 0,
                     config: TinyConfig = None) -> VerifyTarget:
    """The reference model behind a decode runner, with ``max_bs`` requests prefilled;
    ``make_batch(n)`` decodes one token for the first ``n`` of them."""
    spec = decode_spec(spec)
    cuda = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    rt = build_reference_model(config, device="cuda" if cuda else "cpu", seed=seed, max_num_reqs=max_bs)
    try:
        runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), DecodeRunnerConfig(
            max_bs=max_bs, spec=spec, backend=backend, progress=False))
    except SlotError as exc:
        unknown(spec, exc)
        raise
    rng = random.Random(seed)
    vocab = rt.config.vocab_size
    ctx = rt.config.max_context_len
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, ctx // 2))] for _ in range(max_bs)]
    rpi = rt.req_to_token_pool.alloc(max_bs)
    rt.forward(make_extend_batch(rt, rpi, [0] * max_bs, prompts))
    lens = [len(p) for p in prompts]

    def make_batch(raw_bs: int) -> Any:
        return make_decode_batch(rt, rpi[:raw_bs], lens[:raw_bs], [rng.randrange(1, vocab) for _ in range(raw_bs)])

    def release(fb: Any) -> None:
        rt.token_to_kv_pool.free(fb.out_cache_loc)

    return VerifyTarget(runner, make_batch, release, label=f"reference model, spec {spec.name}, max_bs {max_bs}")


def reference_prefill_target(backend: str = "auto", capture: str = "full", max_bs: int = 4,
                             token_buckets: Any = (16, 32), seed: int = 0, config: TinyConfig = None) -> VerifyTarget:
    """The reference model behind a prefill runner (``capture``, ``token_buckets``);
    ``make_batch(n)`` prefills ``n`` new tokens, split over up to ``max_bs`` requests, some
    after a cached prefix (`graphslot verify graphslot.reference.verify_target:reference_prefill_target`)."""
    cuda = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    rt = build_reference_model(config, device="cuda" if cuda else "cpu", seed=seed, max_num_reqs=max_bs)
    runner = PrefillGraphRunner(ReferencePrefillAdapter(rt), PrefillRunnerConfig(
        max_bs=max_bs, token_buckets=list(token_buckets), capture=capture, backend=backend, progress=False))
    rng = random.Random(seed)
    vocab = rt.config.vocab_size
    rpi = rt.req_to_token_pool.alloc(max_bs)
    prefixes = [rng.randrange(0, 4) for _ in range(max_bs)]  # cached tokens before the chunk (chunked prefill)
    rt.forward(make_extend_batch(rt, rpi, [0] * max_bs, [[rng.randrange(1, vocab) for _ in range(p)] or [1]
                                                          for p in prefixes]))
    prefixes = [max(p, 1) for p in prefixes]

    def make_batch(num_tokens: int) -> Any:
        requests = min(max_bs, num_tokens)
        lens = [num_tokens // requests + (i < num_tokens % requests) for i in range(requests)]
        prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lens]
        return make_extend_batch(rt, rpi[:requests], prefixes[:requests], prompts)

    def release(fb: Any) -> None:
        rt.token_to_kv_pool.free(fb.out_cache_loc)

    return VerifyTarget(runner, make_batch, release,
                        label=f"reference model, {capture} prefill, token buckets {list(runner.buckets)}")


class NotADecodeSpec(TargetError):
    """The spec given for the reference model lacks the params of its decode runner."""


def decode_spec(spec: Any) -> Any:
    """``spec`` (a shipped name, a YAML path, or a parsed spec), loaded; NotADecodeSpec
    when it does not declare the params the reference model's decode adapter sets."""
    spec = load_spec(spec) if isinstance(spec, str) else spec
    missing = [name for name in ReferenceDecodeAdapter.SPEC_PARAMS if name not in spec.params]
    if missing:
        raise NotADecodeSpec(
            f"spec '{spec.name}' ({spec.path}) is not a decode spec: it declares no param "
            f"{' or '.join(map(repr, missing))}, which the reference model's decode runner sets; give a decode spec "
            "(the shipped 'decode', or a copy of it)")
    return spec


def unknown(spec: Any, error: SlotError) -> None:
    """A TargetError, when ``spec`` copies fields the reference model's batches lack (a
    project spec with a slot of its own): only the engine's own runner can verify it."""
    known = {f.name for f in dataclasses.fields(ForwardBatch)}
    enabled = {r.name for r in resolve_slots(spec, resolve_params(spec), 1, 1) if r.enabled}
    added = [s.name for s in spec.slots
             if s.name in enabled and s.copy_from_fb and s.source is None and s.name not in known]
    if added:
        names = ", ".join(f"'{name}'" for name in added)
        raise TargetError(
            f"spec '{spec.name}' ({spec.path}) copies {names}, which the reference model's batches do not have "
            "and its model does not read; verify the spec on your own runner, whose batches set "
            f"{'them' if len(added) > 1 else 'it'}: `graphslot verify yourpackage.module:make_target` "
            "(docs/engine.md, \"Checking your runner\")") from error
