"""Generated registries: compile the generated source in process (cached), or use a
checked-in generated module, and bind it to a registry's buffers."""

from __future__ import annotations

import linecache
import types
from typing import Any, Dict, List, Mapping

import torch

from ..framework.errors import SpecError, SpecIssue
from ..framework.model import RegistrySpec
from ..framework.registry import SlotRegistry
from ..framework.resolve import ResolvedSlot
from .emitter import params_literal, structural_params
from .generator import render_module

_MODULES: Dict[tuple, types.ModuleType] = {}


def compile_module(spec: RegistrySpec, params: Mapping[str, Any]) -> types.ModuleType:
    """The generated module for (spec, params), compiled once per process.

    Its source is registered with ``linecache`` under a readable name, so tracebacks
    and pdb show the generated lines.
    """
    baked = structural_params(spec, params)
    key = (spec.sha256, spec.source, params_literal(baked))
    module = _MODULES.get(key)
    if module is not None:
        return module
    source = render_module(spec, params)
    filename = f"<graphslot-generated {spec.name}-{spec.sha256[:8]}-{len(_MODULES)}.py>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(f"graphslot_generated_{spec.name}")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    _MODULES[key] = module
    return module


def check_module(module: Any, spec: RegistrySpec, params: Mapping[str, Any]) -> None:
    """A checked-in module must come from this very spec and these params."""
    name = getattr(module, "__name__", repr(module))
    problems = []
    if getattr(module, "SPEC_SHA256", None) != spec.sha256:
        problems.append(f"generated module '{name}' was generated from another version of {spec.source} "
                        f"(sha256 {str(getattr(module, 'SPEC_SHA256', '?'))[:12]}…, the spec is now "
                        f"{spec.sha256[:12]}…); run `graphslot generate`")
    expected = {k: params_literal({k: v}) for k, v in structural_params(spec, params).items()}
    got = {k: params_literal({k: v}) for k, v in getattr(module, "PARAMS", {}).items()}
    differing = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
    if differing:
        shown = ", ".join(f"{k} (module: {_value(got, k)}, registry: {_value(expected, k)})" for k in differing)
        problems.append(f"generated module '{name}' was generated for other params: {shown}; "
                        "declare an output with these params and run `graphslot generate`")
    if problems:
        raise SpecError([SpecIssue(spec.source, None, p) for p in problems])


def _value(literals: Mapping[str, str], key: str) -> str:
    return literals[key].split(": ", 1)[1].rstrip("}") if key in literals else "absent"


class GeneratedRegistry(SlotRegistry):
    """A registry whose ``fill_from`` / ``extract`` are generated code.

    The generated closures are set as instance attributes, so a call costs no method
    binding and no wrapper; strict mode wraps ``fill_from`` only when asked for.
    """

    mode = "generated"

    def __init__(self, module, spec, slots, hooks, params, **kwargs):
        device = torch.device(kwargs["device"])
        buffers = module.allocate(kwargs["max_bs"], kwargs["max_num_tokens"], device, params,
                                  kwargs.pop("pool"), kwargs.pop("source"))
        super().__init__(spec, slots, hooks, params, buffers=buffers, **kwargs)
        self.module = module
        for slot in self.active:
            if tuple(slot.buffer.shape) != slot.spec.shape or slot.buffer.dtype != slot.spec.dtype:
                raise SpecError([SpecIssue(spec.source, slot.spec.line, "generated allocate() disagrees with "
                                           "the spec; regenerate the module (graphslot generate)", slot.name)])
        fill_from, extract = module.bind(buffers, hooks, self.params, self.max_bs, self.max_num_tokens, device)
        self.extract = extract
        if self.strict:
            def checked_fill_from(fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None):
                self.check_fill(fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)
                fill_from(fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs)

            self.fill_from = checked_fill_from
        else:
            self.fill_from = fill_from


def build_generated_registry(
    spec: RegistrySpec, slots: List[ResolvedSlot], hooks, params, *, mode: Any = "generated", **kwargs
) -> GeneratedRegistry:
    if mode == "generated":
        module = compile_module(spec, params)
    elif isinstance(mode, types.ModuleType):
        module = mode
    elif callable(mode):
        module = mode(spec, params)
    else:
        raise ValueError(f"mode must be 'generated', 'interpreted', a generated module or a loader "
                         f"function, got {mode!r}")
    check_module(module, spec, params)
    return GeneratedRegistry(module, spec, slots, hooks, params, **kwargs)
