"""Decide what generated code does for one (spec, params): :class:`Emitter` resolves the slots (capacities
left symbolic), names them, sorts them into copy groups and has the builders write each piece's lines; the
template only lays the pieces out."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Sequence

from ..spec.dtypes import DTypeName, dtype_name, is_torch_dtype
from ..spec.expr import Expr, python_literal
from ..spec.hooks import BUILTIN_HOOKS, HOOK_SIGNATURES, is_import_reference
from ..spec.model import RegistrySpec
from ..spec.resolve import ResolvedSlot, copied_as_rows, depends_on_capacity, resolve_slot
from . import builders
from .groups import plan_copies
from .layout import normalise
from .names import CAPACITY, RUNTIME_HELPERS, TEMPLATE_HELPERS, SlotNames, runtime_local, slot_idents

PLAN_CACHE_LIMIT = 4096  # distinct step sizes kept; a server sees ~one per captured size


def structural_params(spec: RegistrySpec, params: Mapping[str, Any]) -> Dict[str, Any]:
    """The params baked into generated code: all but ``runtime`` (read when bound) and ``live`` ones."""
    return {k: v for k, v in params.items() if not (spec.params[k].runtime or spec.params[k].live)}


def params_literal(params: Mapping[str, Any]) -> str:
    """Byte-stable one-line source for params (keys sorted, dtypes by name): a compiled module's cache key."""

    def literal(v: Any) -> str:
        return repr(dtype_name(v)) if isinstance(v, DTypeName) or is_torch_dtype(v) else python_literal(v)

    return "{" + ", ".join(f"{k!r}: {literal(v)}" for k, v in sorted(params.items())) + "}"


class Emitter:
    def __init__(self, spec: RegistrySpec, params: Mapping[str, Any], version: str, source: str, skip=frozenset()):
        self.spec, self.params, self.version, self.source_label = spec, dict(params), version, source
        # sorted: the order of a spec's params is no part of its meaning (RegistrySpec.identity)
        self.runtime = sorted(n for n, p in spec.params.items() if p.runtime)
        self.baked = structural_params(spec, self.params)  # folded into the code (not runtime, not live)
        self.slots = [s for s in self._symbolic_slots() if s.enabled]
        self.names = [SlotNames(s, i) for s, i in zip(self.slots, slot_idents(self.slots))]
        # fill_from writes all but ``skip`` (fill_from_skipping's variant); allocate and extract cover all.
        self.fill_names = [n for n in self.names if n.slot.name not in skip]
        self.hooks = {n.slot.name: self._expected_hooks(n.slot) for n in self.names}

    def _symbolic_slots(self) -> List[ResolvedSlot]:
        """The slots resolved with capacities left symbolic (``None``): one module serves every max_bs."""
        slots = []
        for i, spec_slot in enumerate(self.spec.slots):
            fixed = [None if depends_on_capacity(e) else e for e in spec_slot.shape]
            placeholder = spec_slot.model_copy(update={"shape": tuple(1 if e is None else e for e in fixed)})
            resolved = resolve_slot(placeholder, self.params, 1, 1, self.spec.slot_line(i), self.spec.absent_fields)
            shape = tuple(None if e is None else n for e, n in zip(fixed, resolved.shape))
            slots.append(dataclasses.replace(resolved, shape=shape, rows=copied_as_rows(spec_slot)))
        return slots

    def _expected_hooks(self, slot: ResolvedSlot) -> List[str]:
        """Hook kinds this slot will have bound (a built-in with nothing to do for these params is left out)."""
        kinds = []
        for kind in HOOK_SIGNATURES:
            ref = getattr(slot, kind)
            builtin = ref in BUILTIN_HOOKS and not is_import_reference(ref)
            if ref is not None and not (builtin and BUILTIN_HOOKS[ref].factory(self.params, slot.name) is None):
                kinds.append(kind)
        return kinds

    def spec_expr(self, value: Any, keep: Sequence[str]) -> str:
        """A spec value as source: baked params folded in, ``keep`` and runtime params left as names."""
        if not isinstance(value, str):
            return normalise(python_literal(value))
        names = {**{name: name for name in keep}, **{name: runtime_local(name) for name in self.runtime}}
        return normalise(Expr.parse(value).to_python(self.baked, keep=names))

    def extents(self, slot: ResolvedSlot) -> List[str]:
        return [self.spec_expr(e, CAPACITY.values()) for e in self.spec.slot_spec(slot.name).shape]

    def pad_src(self, slot: ResolvedSlot) -> str:
        if slot.padding == "zero":
            return "0"
        return self.spec_expr(self.spec.slot_spec(slot.name).pad_value, ())

    def used_runtime_params(self) -> List[str]:
        """Runtime params some enabled slot's pad value reads (others are not bound)."""
        used = set()
        for n in self.names:
            pad_value = self.spec.slot_spec(n.slot.name).pad_value
            if isinstance(pad_value, str) and n.slot.padding in ("fill_sentinel", "fill_once"):
                used |= Expr.parse(pad_value).names
        return [name for name in self.runtime if name in used]

    def emit(self) -> SimpleNamespace:
        """Every piece the template lays out, and the metadata the banner and the checks read."""
        copies = plan_copies(self)  # before any builder: it takes the hooks it fuses away
        shapes = builders.expected_shapes(self, copies)
        pieces = {
            "allocate_lines": builders.allocate_lines(self),
            "plan_lines": builders.plan_lines(copies, shapes),
            "fill_lines": builders.fill_lines(self, copies, shapes),
            "view_lines": builders.view_lines(self),
            "extract_lines": builders.extract_lines(self),
        }
        pieces["bind_lines"] = builders.bind_lines(self, copies, shapes, sum(pieces.values(), []))
        emitted = "\n".join(line for lines in pieces.values() for line in lines)
        used = [(helper, alias) for helper, alias in RUNTIME_HELPERS if alias in TEMPLATE_HELPERS or alias in emitted]
        imports = sorted(used)
        return SimpleNamespace(
            spec_name=self.spec.name,
            spec_source=self.source_label,
            spec_identity=self.spec.identity,
            version=self.version,
            params=self.baked,
            runtime_params=self.runtime,
            live_params=sorted(n for n, p in self.spec.params.items() if p.live),
            used_runtime_params=[(runtime_local(n), n) for n in self.used_runtime_params()],
            slot_names=[n.slot.name for n in self.names],
            runtime_imports=imports,
            helper_lines=builders.helper_lines(imports),
            constant_lines=builders.constant_lines(self),
            **pieces,
        )
