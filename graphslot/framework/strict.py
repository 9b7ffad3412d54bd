"""Strict mode: check a step's sources before anything is copied.

``Tensor.copy_`` broadcasts and casts silently, so a batch field of the wrong length or
dtype would corrupt a buffer without an error. Strict mode turns each such mismatch
into a ``SlotError`` naming the slot, what was expected and what came. It is chosen at
build time, so a registry that is not strict pays nothing for it.
"""

from __future__ import annotations

import torch

from .errors import SlotError


def _fail(slot, what: str) -> None:
    raise SlotError(f"slot '{slot.name}': {what}")


def _check_counts(registry, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens) -> None:
    for axis, raw, padded, capacity in (("bs", raw_bs, padded_bs, registry.max_bs),
                                        ("tokens", raw_num_tokens, padded_num_tokens, registry.max_num_tokens)):
        if not 0 <= raw <= padded <= capacity:
            raise SlotError(f"{axis} counts must satisfy 0 <= raw <= padded <= capacity, got raw={raw}, "
                            f"padded={padded}, capacity={capacity} (registry '{registry.spec.name}')")


def _check_tensor(slot, src, expected_shape) -> None:
    buffer = slot.buffer
    if not isinstance(src, torch.Tensor):
        _fail(slot, f"expected a torch.Tensor, got {type(src).__name__}")
    if src.dtype != buffer.dtype:
        _fail(slot, f"expected dtype {buffer.dtype}, got {src.dtype} (copy_ would cast silently)")
    if src.device != buffer.device:
        _fail(slot, f"expected device {buffer.device}, got {src.device}")
    if tuple(src.shape) != tuple(expected_shape):
        _fail(slot, f"expected shape {list(expected_shape)}, got {list(src.shape)} (copy_ would broadcast "
                    "or fail)")


def check_fill(registry, fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> None:
    _check_counts(registry, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
    ctx = registry.fill_context(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)
    for slot in registry.active:
        spec = slot.spec
        if not spec.copy_from_fb:
            continue
        shape = list(slot.buffer.shape)
        if spec.source is not None:
            hook = slot.hooks.get("source")
            src = hook(fb, ctx) if hook is not None else None
            if src is None:
                continue
            if isinstance(src, torch.Tensor) and src.dim() == len(shape):
                n = src.shape[spec.slice_dim]
                if n > shape[spec.slice_dim]:
                    _fail(slot, f"source returned {n} rows, more than the capacity {shape[spec.slice_dim]}")
                shape[spec.slice_dim] = n
            _check_tensor(slot, src, shape)
            continue
        src = getattr(fb, spec.name, None)
        if src is None:
            if spec.optional:
                continue
            _fail(slot, "the batch field is None, but the slot is not optional; set it on the batch, or "
                        "declare `optional: true` in the spec")
        count = slot.count(raw_bs, raw_num_tokens)
        if count is not None:
            shape[spec.slice_dim] = count
        _check_tensor(slot, src, shape)
