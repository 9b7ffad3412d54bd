"""Hooks: what a spec names for what plain copying cannot express (a ``build_registry(hooks=...)`` name, a
built-in or ``package.module:function``). Built-ins are factories: given the params they return the callable
to run, or None when there is nothing to do: generated code leaves that call out, the interpreter runs the same."""

from __future__ import annotations

import importlib
import inspect
import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from .errors import SlotError, did_you_mean, shorten
from .live import Live, naming_slot

# How each kind of hook is called; a user hook must accept these arguments.
HOOK_SIGNATURES = {"post_fill": ("buffer", "fb", "ctx"), "source": ("fb", "ctx"), "pre_capture": ("buffer", "ctx")}


@dataclass(frozen=True)
class FillContext:
    """What a ``post_fill`` / ``source`` hook learns about the step."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    params: Mapping[str, Any]
    side_inputs: Any = None


@dataclass(frozen=True)
class CaptureContext:
    """What a ``pre_capture`` hook learns about the graph about to be captured."""

    bs: int
    num_tokens: int
    params: Mapping[str, Any]
    side_inputs: Any = None


def _is_tensor(value: Any) -> bool:
    """``isinstance(value, torch.Tensor)`` without importing torch (the spec layer runs factories without it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class BuiltinHook:
    kind: str
    factory: Callable[[Mapping[str, Any], str], Optional[Callable]]
    #: For a ``post_fill`` hook that only fills its whole buffer with one of the step's
    #: counts (``"raw_num_tokens"``, ``"padded_num_tokens"``): generated code writes that
    #: value through the step's grouped copy instead of calling the hook.
    fills: Optional[str] = None


class HookError(ValueError):
    """A hook reference that cannot be used; wrapped into a SpecIssue by callers."""


def is_import_reference(ref: str) -> bool:
    return ":" in ref


#: What to do when a hook's module is not installed where it is being checked (validate).
NOT_INSTALLED = (
    "; install it (and what it imports) into this environment -- for a pre-commit hook, list it under "
    "additional_dependencies or use a `repo: local` hook -- or check hooks here without importing them "
    "(no --import-hooks, import_hooks = false)"
)


def import_hook(ref: str, when_missing: str = "") -> Callable:
    """The function ``ref`` (``package.module:function``) names. ``when_missing``: what to
    do when its module (or one it imports) is not installed, added to that error."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HookError(
            f"cannot import module '{module_name}' for hook '{ref}': no module named '{exc.name or module_name}' in "
            f"this Python environment ({sys.executable}){when_missing}"
        ) from None
    except ImportError as exc:
        raise HookError(f"cannot import module '{module_name}' for hook '{ref}': {exc}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise HookError(
                f"module '{module_name}' has no attribute '{attr}' (hook '{ref}')" + did_you_mean(part, dir(target))
            )
        target = getattr(target, part)
    if not callable(target):
        raise HookError(f"hook '{ref}' is not callable")
    return target


def check_signature(fn: Callable, kind: str, ref: str) -> None:
    params = HOOK_SIGNATURES[kind]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    try:
        signature.bind(*params)
    except TypeError:
        raise HookError(
            f"{kind} hook '{ref}' has signature {signature}, but {kind} hooks are called as ({', '.join(params)})"
        ) from None


def check_reference(ref: str, kind: str) -> None:
    """What can be checked without the user's ``hooks=`` (other plain names are left to ``build_registry``)."""
    if is_import_reference(ref):
        check_signature(import_hook(ref, NOT_INSTALLED), kind, ref)
    elif ref in BUILTIN_HOOKS and BUILTIN_HOOKS[ref].kind != kind:
        raise HookError(f"built-in hook '{ref}' is a {BUILTIN_HOOKS[ref].kind} hook and cannot be used as {kind}")


def bind_hook(ref: str, kind: str, slot_name: str, params: Mapping[str, Any], user_hooks: Mapping[str, Callable]):
    """The callable a reference stands for with these params (None: nothing to do)."""
    if ref in user_hooks or is_import_reference(ref):
        fn = user_hooks[ref] if ref in user_hooks else import_hook(ref)
        check_signature(fn, kind, ref)
        return fn
    if ref in BUILTIN_HOOKS:
        check_reference(ref, kind)
        return BUILTIN_HOOKS[ref].factory(params, slot_name)
    known = list(user_hooks) + [n for n, h in BUILTIN_HOOKS.items() if h.kind == kind]
    raise HookError(
        f"unknown {kind} hook '{ref}': pass it in build_registry(hooks={{'{ref}': fn}}), "
        f"use a built-in {kind} hook, or write 'package.module:function'" + did_you_mean(ref, known)
    )


SHARD_PARAMS = ("attn_tp_sharded", "attn_tp_rank", "attn_tp_size")


def _shard(get, fail):
    """``(rank, size)`` of this rank's slice of the padded tokens, ``(0, 1)`` when not sliced: sglang's
    ``not enable_prefill_cp and attn_tp_sharded_fn(n)``, read as sglang reads it (rank and size only when sharded)."""
    if get("enable_prefill_cp", False):
        return 0, 1
    sharded = get("attn_tp_sharded", None)
    if not (get("require_gathered_buffer", False) if sharded is None else sharded):
        return 0, 1
    rank = int(get("attn_tp_rank", 0))
    size = int(get("attn_tp_size", 1))
    if not (size >= 1 and 0 <= rank < size):
        raise fail(
            f"attn_tp_rank={rank} must lie in [0, attn_tp_size={size}) when the "
            "non-padded count is sharded (attn_tp_sharded)"
        )
    return rank, size


def _local_bounds(params, slot_name):
    """``ctx -> (tokens_per_rank, rank_offset)``: this rank's slice of the padded bucket (all of it
    when replicated), sharded once here from fixed params, or at every fill when one of them is live."""
    live = any(isinstance(params.get(name), Live) for name in SHARD_PARAMS)
    fixed = None if live else _shard(params.get, HookError)

    def bounds(ctx):
        rank, size = (
            fixed
            if fixed is not None
            else _shard(ctx.params.get, lambda message: SlotError(f"slot '{slot_name}': {message}"))
        )
        per_rank = ctx.padded_num_tokens // size
        return per_rank, per_rank * rank

    return naming_slot(bounds, slot_name) if live else bounds


def _count(value: Any, field: str, slot_name: str) -> int:
    """A host count read off the batch as an int (an int, a numpy int), else a SlotError naming slot and field."""
    try:
        return operator.index(value)
    except TypeError:
        raise SlotError(
            f"slot '{slot_name}': fb.{field} is {type(value).__name__} {shorten(value)}; a count is an int or a tensor"
        ) from None


def _local_num_token_non_padded(params, slot_name):
    """Real tokens of the step: fb.global_num_token_non_padded clamped to this rank's slice of the padded
    tokens, else fb.num_token_non_padded copied, else nothing (slot_specs/README.md)."""
    bounds = _local_bounds(params, slot_name)

    def post_fill(buffer, fb, ctx):
        global_count = getattr(fb, "global_num_token_non_padded", None)
        if global_count is None:
            # Batches that bypass the global count (sub-batches, dense drafts) carry the
            # local one themselves; without either the buffer keeps its last value.
            local = getattr(fb, "num_token_non_padded", None)
            if _is_tensor(local):
                buffer.copy_(local.reshape(buffer.shape))
            elif local is not None:
                buffer.fill_(_count(local, "num_token_non_padded", slot_name))
            return
        per_rank, offset = bounds(ctx)
        if _is_tensor(global_count):
            # Never `out=buffer`: a 0-d count would resize the static [1] buffer. Each op
            # costs a dispatch on the hot path: no subtraction of 0, no reshape where
            # copy_ broadcasts (a 0-d count into [1]).
            local = (global_count - offset if offset else global_count).clamp(0, per_rank)
            buffer.copy_(local.reshape(buffer.shape) if local.dim() > buffer.dim() else local)
        else:
            count = _count(global_count, "global_num_token_non_padded", slot_name)
            buffer.fill_(min(max(count - offset, 0), per_rank))

    return post_fill


def _local_num_token_non_padded_cpu(params, slot_name):
    """Real tokens of the padded bucket: the host int fb.global_num_token_non_padded_cpu clamped to this
    rank's slice of the bucket, else the raw token count of the step (slot_specs/README.md)."""
    bounds = _local_bounds(params, slot_name)

    def post_fill(buffer, fb, ctx):
        global_count = getattr(fb, "global_num_token_non_padded_cpu", None)
        if global_count is None:
            buffer.fill_(ctx.raw_num_tokens)
            return
        per_rank, offset = bounds(ctx)
        count = _count(global_count, "global_num_token_non_padded_cpu", slot_name)
        buffer.fill_(min(max(count - offset, 0), per_rank))

    return post_fill


def _count_non_padded_tokens(params, slot_name):
    """Write the raw token count of the step (tokens of the padded bucket that are real)."""
    return lambda buffer, fb, ctx: buffer.fill_(ctx.raw_num_tokens)


def _global_num_tokens(params, slot_name):
    """With gathered (DP) buffers (require_gathered_buffer) every rank runs the padded token count: fill it."""
    if params.get("require_gathered_buffer"):
        return lambda buffer, fb, ctx: buffer.fill_(ctx.padded_num_tokens)
    return None


def _dotted_field(params, slot_name):
    """Read a structured slot's dotted name off the batch (`a.b` → fb.a.b); None when any part
    is missing."""
    parts = slot_name.split(".")

    def source(fb, ctx):
        value = fb
        for part in parts:
            value = getattr(value, part, None)
            if value is None:
                return None
        return value

    return source


def _register_swa_out_cache_loc(params, slot_name):
    """Register the static out_cache_loc_swa buffer with side_inputs['token_to_kv_pool'], so the capture
    records the fast path that writes into it."""

    def pre_capture(buffer, ctx):
        side = ctx.side_inputs or {}
        pool = side.get("token_to_kv_pool") if isinstance(side, Mapping) else None
        if pool is None or not hasattr(pool, "register_out_cache_loc_swa"):
            raise RuntimeError(
                f"slot '{slot_name}': pre_capture hook register_swa_out_cache_loc needs "
                "side_inputs['token_to_kv_pool'] with a register_out_cache_loc_swa(buffer) method"
            )
        pool.register_out_cache_loc_swa(buffer)

    return pre_capture


# The built-in hooks by name, each documented by its factory's docstring (and graphslot/slot_specs/README.md).
BUILTIN_HOOKS: Dict[str, BuiltinHook] = {
    "local_num_token_non_padded": BuiltinHook("post_fill", _local_num_token_non_padded),
    "local_num_token_non_padded_cpu": BuiltinHook("post_fill", _local_num_token_non_padded_cpu),
    "count_non_padded_tokens": BuiltinHook("post_fill", _count_non_padded_tokens, fills="raw_num_tokens"),
    "global_num_tokens": BuiltinHook("post_fill", _global_num_tokens, fills="padded_num_tokens"),
    "dotted_field": BuiltinHook("source", _dotted_field),
    "register_swa_out_cache_loc": BuiltinHook("pre_capture", _register_swa_out_cache_loc),
}
