"""What a transformers model's ``forward`` takes: :func:`forward_takes` reads its
signature, :func:`with_cache` names the keyword the KV cache goes under."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict


def forward_takes(model: Any, name: str) -> bool:
    """Whether ``model.forward`` declares the argument ``name``. The signature is read
    once per forward function: :func:`with_cache` asks on every forward call."""
    forward = model.forward
    return name in _arguments(getattr(forward, "__func__", forward))


@functools.lru_cache(maxsize=None)
def _arguments(function: Any) -> frozenset:
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return frozenset()


def with_cache(model: Any, cache: Any) -> Dict[str, Any]:
    """The forward's keyword argument for the KV cache: ``cache`` from transformers 5.24,
    which deprecates ``past_key_values`` (a FutureWarning every call), else
    ``past_key_values``."""
    return {"cache" if forward_takes(model, "cache") else "past_key_values": cache}
