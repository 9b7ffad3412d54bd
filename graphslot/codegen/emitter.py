"""Decide what generated code does for one (spec, params): the emitter layer.

:class:`Emitter` resolves the spec's slots for the params (capacities left symbolic),
names them (:mod:`.names`), sorts them into copy groups (:mod:`.groups`) and has one
builder per emitted piece (:mod:`.builders`) write its lines; the template only lays
the pieces out. Everything is decided here, so the template holds no logic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import AbstractSet, Any, Dict, List, Mapping, Sequence, Tuple

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

__all__ = [
    "PLAN_CACHE_LIMIT",
    "RUNTIME_HELPERS",
    "Emission",
    "Emitter",
    "params_literal",
    "runtime_local",
    "structural_params",
]


def structural_params(spec: RegistrySpec, params: Mapping[str, Any]) -> Dict[str, Any]:
    """The params baked into generated code (everything but ``runtime`` and ``live``
    ones: those are read when bound, or by hooks at fill time)."""
    return {k: v for k, v in params.items() if not (spec.params[k].runtime or spec.params[k].live)}


def params_literal(params: Mapping[str, Any]) -> str:
    """Byte-stable one-line source for a params dict (dtypes by name, keys sorted,
    non-finite floats as ``float('inf')``): the key of a compiled module and of the
    comparison of a module's params with a registry's."""
    items = (
        f"{k!r}: {dtype_name(v)!r}" if isinstance(v, DTypeName) or is_torch_dtype(v) else f"{k!r}: {python_literal(v)}"
        for k, v in sorted(params.items())
    )
    return "{" + ", ".join(items) + "}"


@dataclass
class Emission:
    """Everything the template lays out: the module's metadata and, per piece, its
    lines, indented where the template places them."""

    spec_name: str
    spec_source: str
    spec_identity: str
    version: str
    params: Dict[str, Any]
    runtime_params: List[str]
    live_params: List[str]
    used_runtime_params: List[Tuple[str, str]]  # (local, param name)
    slot_names: List[str]
    runtime_imports: List[Tuple[str, str]]  # (helper, mangled name), only those used
    helper_lines: List[str]
    constant_lines: List[str]
    allocate_lines: List[str]
    bind_lines: List[str]
    plan_lines: List[str]
    fill_lines: List[str]
    view_lines: List[str]
    extract_lines: List[str]


class Emitter:
    def __init__(
        self,
        spec: RegistrySpec,
        params: Mapping[str, Any],
        version: str,
        source_label: str,
        skip: AbstractSet[str] = frozenset(),
    ):
        self.spec, self.params, self.version, self.source_label = spec, dict(params), version, source_label
        # sorted: the order of a spec's params is no part of its meaning (RegistrySpec.identity)
        self.runtime = sorted(n for n, p in spec.params.items() if p.runtime)
        self.baked = structural_params(spec, self.params)  # folded into the code (not runtime, not live)
        self.slots = [s for s in self._symbolic_slots() if s.enabled]
        self.names = [SlotNames(s, i) for s, i in zip(self.slots, slot_idents(self.slots))]
        #: The slots fill_from writes: all but ``skip`` (a variant for staged slots,
        #: SlotRegistry.fill_from_skipping); allocate and extract always cover every slot.
        self.fill_names = [n for n in self.names if n.slot.name not in skip]
        self.hooks = {n.slot.name: self._expected_hooks(n.slot) for n in self.names}

    def _symbolic_slots(self) -> List[ResolvedSlot]:
        """The slots resolved for these params with capacities left symbolic (one
        generated module serves every max_bs): an extent that depends on a capacity
        is ``None`` here, so any shape the interpreter accepts is accepted."""
        slots = []
        for i, spec_slot in enumerate(self.spec.slots):
            fixed = [None if depends_on_capacity(e) else e for e in spec_slot.shape]
            placeholder = spec_slot.model_copy(update={"shape": tuple(1 if e is None else e for e in fixed)})
            resolved = resolve_slot(placeholder, self.params, 1, 1, self.spec.slot_line(i), self.spec.absent_fields)
            shape = tuple(None if e is None else n for e, n in zip(fixed, resolved.shape))
            slots.append(dataclasses.replace(resolved, shape=shape, rows=copied_as_rows(spec_slot)))
        return slots

    def _expected_hooks(self, slot: ResolvedSlot) -> List[str]:
        """Hook kinds this slot will have bound; a built-in that has nothing to do
        with these params is left out of the generated code altogether."""
        kinds = []
        for kind in HOOK_SIGNATURES:
            ref = getattr(slot, kind)
            if ref is None:
                continue
            if ref in BUILTIN_HOOKS and not is_import_reference(ref):
                if BUILTIN_HOOKS[ref].factory(self.params, slot.name) is None:
                    continue
            kinds.append(kind)
        return kinds

    # -- spec values as source -------------------------------------------------------------
    def spec_expr(self, value: Any, keep: Sequence[str]) -> str:
        """A spec value (literal or expression) as source: baked params folded in,
        ``keep`` and runtime params left as names."""
        if isinstance(value, str):
            baked = self.baked
            names = {name: name for name in keep}
            names.update({name: runtime_local(name) for name in self.runtime})
            return normalise(Expr.parse(value).to_python(baked, keep=names))
        return normalise(python_literal(value))

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

    # -- the module ------------------------------------------------------------------------
    def emit(self) -> Emission:
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
        emitted = [line for lines in pieces.values() for line in lines]
        imports = sorted(
            (helper, alias)
            for helper, alias in RUNTIME_HELPERS
            if alias in TEMPLATE_HELPERS or any(alias in line for line in emitted)
        )
        used = self.used_runtime_params()
        return Emission(
            spec_name=self.spec.name,
            spec_source=self.source_label,
            spec_identity=self.spec.identity,
            version=self.version,
            params=self.baked,
            runtime_params=self.runtime,
            live_params=sorted(n for n, p in self.spec.params.items() if p.live),
            used_runtime_params=[(runtime_local(n), n) for n in used],
            slot_names=[n.slot.name for n in self.names],
            runtime_imports=imports,
            helper_lines=builders.helper_lines(imports),
            constant_lines=builders.constant_lines(self),
            **pieces,
        )
