"""Hooks that test specs name as ``hooks_for_tests:<function>`` (tests/ is on sys.path)."""

from __future__ import annotations

import torch

CALLS: list = []  # (hook name, ...) appended by the recording hooks below


def post_fill_fits(buffer, fb, ctx):
    CALLS.append(("post_fill_fits", ctx.raw_bs, ctx.padded_bs))


def post_fill_too_few(buffer):
    """Wrong signature for a post_fill hook: it is called as (buffer, fb, ctx)."""


def source_fits(fb, ctx):
    return torch.arange(ctx.raw_bs)


def pre_capture_fits(buffer, ctx):
    CALLS.append(("pre_capture_fits", ctx.bs, ctx.num_tokens))


NOT_A_FUNCTION = 42
