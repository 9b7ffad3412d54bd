"""``build_registry``: from a spec and params to a live registry (``build``: the same with the knobs
graphslot's runners and integrations need)."""

from __future__ import annotations

import inspect
import operator
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
from .registry.buffers import SharePool, check_given_buffers
from .registry.base import SlotRegistry
from .registry.interpreter import InterpretedRegistry
from .spec.resolve import resolve_params, resolve_slots
from . import env


def bind_slot_hooks(spec: RegistrySpec, slots: list, params: Mapping[str, Any], user_hooks: Mapping[str, Callable]):
    """Each enabled slot's hooks as callables (one with nothing to do left out); with live params, a hook not
    built in names its slot when a provider it reads fails."""
    bound: Dict[str, Dict[str, Callable]] = {}
    live = any(isinstance(value, Live) for value in params.values())
    taken = "passed in build_registry(hooks=...) is the name of a built-in hook"
    fix = "rename yours (e.g. 'my_{}') and use that name in the spec"
    names = sorted(set(user_hooks) & set(BUILTIN_HOOKS))
    issues = [SpecIssue("<hooks=>", None, f"hook name '{name}' {taken}; {fix.format(name)}") for name in names]
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
                issues.append(SpecIssue(spec.path, spec.slot_line(index, kind), str(exc), slot.name))
                continue
            if fn is not None:
                named = live and ref not in BUILTIN_HOOKS  # a built-in reading live params names its slot
                bound.setdefault(slot.name, {})[kind] = naming_slot(fn, slot.name) if named else fn
    if issues:
        raise SpecError(issues)
    return bound


def is_pool(buffers: Any) -> bool:
    """Whether ``buffers=`` is a pool (it has a callable ``share``) rather than something to adopt from. Looked up
    statically: an engine object's ``__getattr__`` or property is not run (it may raise, or be a slot's tensor)."""
    share = inspect.getattr_static(buffers, "share", None)
    return callable(share) or isinstance(share, (staticmethod, classmethod))


def as_count(value: Any) -> Any:
    """A capacity that is an int in all but type (a numpy integer: ``operator.index`` takes it) as that int; a
    bool, a float or anything else as it is, for ``resolve_slots`` to refuse in one line naming the argument."""
    if isinstance(value, (bool, int)) or not hasattr(type(value), "__index__"):
        return value
    return operator.index(value)


def build_registry(
    spec: Union[RegistrySpec, str, os.PathLike, types.ModuleType],
    *,
    device: Union[str, torch.device],
    max_bs: int,
    max_num_tokens: int,
    params: Optional[Mapping[str, Any]] = None,
    buffers: Any = None,
    hooks: Optional[Mapping[str, Callable]] = None,
    impl: Any = "generated",
) -> SlotRegistry:
    """Allocate (or take) a registry's static buffers and bind its ``fill_from`` / ``extract``; the arguments are
    described in docs/api.md ("The registry"). Strict checks and the byte cap are per process (graphslot.env)."""
    pool = buffers if is_pool(buffers) else None
    options = dict(device=device, max_bs=max_bs, max_num_tokens=max_num_tokens, params=params, hooks=hooks, impl=impl)
    return build(spec, **options, pool=pool, adopt=None if pool is not None else buffers)


def build(
    spec: Union[RegistrySpec, str, os.PathLike, types.ModuleType],
    *,
    device: Union[str, torch.device],
    max_bs: int,
    max_num_tokens: int,
    params: Optional[Mapping[str, Any]] = None,
    hooks: Optional[Mapping[str, Callable]] = None,
    impl: Any = "generated",
    pool: Optional[SharePool] = None,
    adopt: Any = None,
    bind: Optional[Mapping[str, Any]] = None,
    preset: Optional[str] = None,
    strict: bool = False,
    max_bytes: Optional[int] = None,
    context: Optional[Callable[..., Any]] = None,
) -> SlotRegistry:
    """:func:`build_registry` with the knobs graphslot's own runners and integrations need (not public API):
    ``bind`` exactly these tensors, ``preset`` by name, ``strict`` (or ``GRAPHSLOT_STRICT``), ``max_bytes`` (default
    ``GRAPHSLOT_MAX_BUFFER_BYTES``, else 4 GiB), ``context(*counts, params, side_inputs)`` (default FillContext)."""
    if isinstance(spec, types.ModuleType):
        from .codegen.embedded import module_params, module_spec

        module = spec
        spec = module_spec(spec)
        if preset is None:
            params = {**module_params(module), **(params or {})}
        if isinstance(impl, str) and impl == "generated":
            impl = module
    elif not isinstance(spec, (RegistrySpec, str, os.PathLike)):
        kinds = "a RegistrySpec, a spec name or path, or a generated module"
        raise TypeError(f"build_registry: spec must be {kinds}, got {type(spec).__name__}")
    if not isinstance(spec, RegistrySpec):
        spec = load_spec(spec)
    max_bs = as_count(max_bs)
    max_num_tokens = as_count(max_num_tokens)
    resolved_params = resolve_params(spec, params, preset)
    slots = resolve_slots(spec, resolved_params, max_bs, max_num_tokens)
    sizes = ((s.name, s.nbytes) for s in slots if s.enabled)
    check_buffer_bytes(spec.name, sizes, f"max_bs={max_bs}, max_num_tokens={max_num_tokens}", max_bytes)
    bound = bind_slot_hooks(spec, slots, resolved_params, hooks or {})
    if bind is not None:
        bind = check_given_buffers(spec.name, slots, bind, torch.device(device))
    kwargs = dict(max_bs=max_bs, max_num_tokens=max_num_tokens, device=torch.device(device), pool=pool, buffers=bind)
    kwargs.update(strict=strict or env.STRICT.enabled(), context=context)  # GRAPHSLOT_STRICT: on for every registry
    if impl == "interpreted":
        return InterpretedRegistry(spec, slots, bound, resolved_params, adopt=adopt, **kwargs)
    from .codegen.inprocess import build_generated_registry

    # codegen passes it on to a generated module's allocate(), whose argument is `source`.
    return build_generated_registry(spec, slots, bound, resolved_params, mode=impl, source=adopt, **kwargs)
