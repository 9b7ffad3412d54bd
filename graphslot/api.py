"""``build_registry``: from a spec and a param set to a live registry."""

from __future__ import annotations

import os
import types
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch

from .spec.budget import check_buffer_bytes
from .spec.errors import SpecError, SpecIssue
from .spec.hooks import BUILTIN_HOOKS, HOOK_SIGNATURES, HookError, bind_hook
from .spec.live import Live, naming_slot
from .spec.loading import load_spec
from .spec.model import RegistrySpec
from .registry.buffers import check_given_buffers
from .registry.pool import GLOBAL_POOL, SharePool
from .registry.base import SlotRegistry
from .registry.interpreter import InterpretedRegistry
from .spec.resolve import resolve_params, resolve_slots
from . import env


def strict_from_env() -> bool:
    """``GRAPHSLOT_STRICT`` (:mod:`graphslot.env`): on for every registry built."""
    return env.STRICT.enabled()


def bind_slot_hooks(
    spec: RegistrySpec, slots: list, params: Mapping[str, Any], user_hooks: Mapping[str, Callable]
) -> Dict[str, Dict[str, Callable]]:
    """Each enabled slot's hooks as callables; a hook with nothing to do is left out.
    With live params, a hook not built in names its slot when a provider it reads fails."""
    bound: Dict[str, Dict[str, Callable]] = {}
    live = any(isinstance(value, Live) for value in params.values())
    issues = [SpecIssue("<hooks=>", None, f"hook name '{name}' passed in build_registry(hooks=...) is the name "
                        f"of a built-in hook; rename yours (e.g. 'my_{name}') and use that name in the spec")
              for name in sorted(set(user_hooks) & set(BUILTIN_HOOKS))]
    for index, slot in enumerate(slots):
        if not slot.enabled:
            continue
        for kind in HOOK_SIGNATURES:
            ref = getattr(slot, kind)
            if ref is None:
                continue
            try:
                fn = bind_hook(ref, kind, slot.name, params, user_hooks)
            except HookError as exc:
                issues.append(SpecIssue(spec.source, spec.slot_line(index, kind), str(exc), slot.name))
                continue
            if fn is not None:
                named = live and ref not in BUILTIN_HOOKS  # a built-in reading live params names its slot
                bound.setdefault(slot.name, {})[kind] = naming_slot(fn, slot.name) if named else fn
    if issues:
        raise SpecError(issues)
    return bound


def build_registry(
    spec: Union[RegistrySpec, str, os.PathLike, types.ModuleType],
    max_bs: int,
    max_num_tokens: int,
    device: Union[str, torch.device] = "cpu",
    params: Optional[Mapping[str, Any]] = None,
    mode: Any = "generated",
    share_pool: Union[bool, SharePool] = False,
    source: Any = None,
    hooks: Optional[Mapping[str, Callable]] = None,
    strict: bool = False,
    preset: Optional[str] = None,
    max_bytes: Optional[int] = None,
    *,
    adopt: Any = None,
    buffers: Optional[Mapping[str, Any]] = None,
    context: Optional[Callable[..., Any]] = None,
) -> SlotRegistry:
    """Allocate a registry's buffers and bind its ``fill_from`` / ``extract``.

    ``spec`` is a RegistrySpec, a spec name (the project's own spec of that name first,
    then a shipped one) or a YAML path, or a generated module: that module then runs
    with the spec embedded in it (no YAML is read) and, unless ``params`` or ``preset``
    say otherwise, the params it was generated for.

    ``mode`` is the registry's implementation: ``"generated"`` (specialised code
    compiled in process, the default), ``"interpreted"`` (the reference semantics), or
    a checked-in generated module. ``adopt`` is an object (attributes, mapping keys or
    dotted paths by slot name) whose tensors become the slots' buffers instead of new
    ones, each checked for shape and dtype (``adopt: never`` slots are left out);
    ``source=`` is its older spelling, kept working (give one of them). ``max_bytes``
    caps the bytes of the enabled slots' buffers, checked before any is allocated
    (default: ``GRAPHSLOT_MAX_BUFFER_BYTES``, else 4 GiB; :mod:`graphslot.spec.budget`).
    ``share_pool``: ``True`` (graphslot's process-wide :class:`BufferPool`) or any
    object with its ``share`` method (:class:`SharePool`). ``buffers``: bind to these
    tensors (one per enabled slot, shape, dtype and device checked) instead of
    allocating. ``context``: makes each fill's hook context, called as
    ``context(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, params,
    side_inputs)`` (default :class:`FillContext`).
    """
    if source is not None:
        if adopt is not None:
            raise TypeError("build_registry: give adopt= or source= (its older spelling), not both")
        adopt = source
    if isinstance(spec, types.ModuleType):
        from .codegen.embedded import module_params, module_spec

        module, spec = spec, module_spec(spec)
        if preset is None:
            params = {**module_params(module), **(params or {})}
        if isinstance(mode, str) and mode == "generated":
            mode = module
    elif not isinstance(spec, (RegistrySpec, str, os.PathLike)):
        raise TypeError(f"build_registry: spec must be a RegistrySpec, a spec name or path, or a generated module, "
                        f"got {type(spec).__name__}")
    if not isinstance(spec, RegistrySpec):
        spec = load_spec(spec)
    resolved_params = resolve_params(spec, params, preset)
    slots = resolve_slots(spec, resolved_params, max_bs, max_num_tokens)
    check_buffer_bytes(spec.name, ((s.name, s.nbytes) for s in slots if s.enabled),
                       f"max_bs={max_bs}, max_num_tokens={max_num_tokens}", max_bytes)
    bound = bind_slot_hooks(spec, slots, resolved_params, hooks or {})
    pool = GLOBAL_POOL if share_pool is True else (share_pool or None)
    if pool is not None and not callable(getattr(pool, "share", None)):
        raise TypeError(f"build_registry: share_pool= takes True, False or a pool with a share(name, tensor, "
                        f"init_value) -> (tensor, fresh) method (graphslot.SharePool), got {type(pool).__name__}")
    if buffers is not None:
        if pool is not None or adopt is not None:
            raise ValueError("build_registry: buffers= binds existing tensors; it cannot be combined with "
                             "share_pool= or adopt=")
        buffers = check_given_buffers(spec.name, slots, buffers, torch.device(device))
    kwargs = dict(max_bs=max_bs, max_num_tokens=max_num_tokens, device=torch.device(device), pool=pool,
                  strict=strict or strict_from_env(), buffers=buffers, context=context)
    if mode == "interpreted":
        return InterpretedRegistry(spec, slots, bound, resolved_params, adopt=adopt, **kwargs)
    from .codegen.inprocess import build_generated_registry

    # codegen passes it on to a generated module's allocate(), whose argument is `source`.
    return build_generated_registry(spec, slots, bound, resolved_params, mode=mode, source=adopt, **kwargs)
