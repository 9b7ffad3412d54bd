"""Decide what generated code does for one (spec, params): the emitter layer.

Everything is computed here — names, slice expressions, which copies share one
``_foreach_copy_``, which branches exist — and handed to a thin template as lists of
statements. The plan for a spec with default decode params is, per step:

* one ``_foreach_copy_`` for everything written on the device (:class:`DeviceGroup`):
  dense heads (2-D ones as rows), tail resets whose source is a slice of a constant pad
  tensor, and step-count hooks; mixed dtypes ride as byte-reinterpreted views of one
  integer *carrier* dtype, with a typed fallback when a source's dtype or layout is off;
* host-side (CPU) slots in a group of their own;
* slice views computed once per step size and cached, so a replay slices nothing.
"""

from __future__ import annotations

import builtins
import dataclasses
import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..spec.dtypes import DTypeName, dtype_name, is_torch_dtype
from ..spec.expr import Expr, python_literal
from ..spec.hooks import BUILTIN_HOOKS, HOOK_SIGNATURES, is_import_reference
from ..spec.model import RegistrySpec
from ..spec.resolve import ResolvedSlot, copied_as_rows, depends_on_capacity, resolve_slot

COUNTS = {"bs": ("raw_bs", "padded_bs"), "tokens": ("raw_num_tokens", "padded_num_tokens")}
CAPACITY = {"bs": "max_bs", "tokens": "max_num_tokens"}
PLAN_CACHE_LIMIT = 4096  # distinct step sizes kept; a server sees ~one per captured size


def structural_params(spec: RegistrySpec, params: Mapping[str, Any]) -> Dict[str, Any]:
    """The params baked into generated code (everything but ``runtime`` ones)."""
    return {k: v for k, v in params.items() if not spec.params[k].runtime}


def params_literal(params: Mapping[str, Any]) -> str:
    """Byte-stable source for a params dict (dtypes by name, keys sorted, non-finite
    floats as ``float('inf')``)."""
    items = (f"{k!r}: {dtype_name(v)!r}" if isinstance(v, DTypeName) or is_torch_dtype(v)
             else f"{k!r}: {python_literal(v)}" for k, v in sorted(params.items()))
    return "{" + ", ".join(items) + "}"


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name.replace(".", "__"))


def _by_name(name: str) -> bool:
    """Whether ``obj.name`` is not valid source: a slot may be called ``class`` (the
    interpreter reads and sets it with getattr/setattr)."""
    return keyword.iskeyword(name)


def _get(obj: str, name: str) -> str:
    """Source reading attribute ``name`` of ``obj``."""
    return f"getattr({obj}, {name!r})" if _by_name(name) else f"{obj}.{name}"


# Names the generated module binds or calls in the scopes where runtime params are
# bound (allocate, bind and the closures bind returns). A runtime param named like one
# of them (or like a generated prefix) is bound to ``rt_<name>`` instead, so it can
# neither shadow them nor be shadowed.
_MODULE_NAMES = frozenset({
    "torch", "max_bs", "max_num_tokens", "device", "params", "pool", "source", "buffers", "hooks",
    "plans", "views", "make_plan", "fill_from", "make_views", "extract", "allocate", "bind",
    "make_view", "fields", "exc", "grad", "plan", "entry",
}) | frozenset(dir(builtins))
_GENERATED_PREFIXES = ("rt_", "buf_", "hook_", "pad", "src_", "rows", "head_", "tail_", "dsts", "view_", "__gs_")

# graphslot.codegen.runtime helpers a module may use, with the mangled names it binds
# them under. The template itself always uses the last four.
RUNTIME_HELPERS = (("FillContext", "__gs_FillContext"), ("SourceMismatch", "__gs_Mismatch"),
                   ("foreach_copy", "__gs_foreach_copy"), ("hook", "__gs_hook"),
                   ("allocate_buffer", "__gs_allocate"), ("ViewMaker", "__gs_ViewMaker"),
                   ("grad_enabled", "__gs_grad_enabled"), ("set_grad_enabled", "__gs_set_grad_enabled"))
_TEMPLATE_HELPERS = frozenset({"__gs_allocate", "__gs_ViewMaker", "__gs_grad_enabled", "__gs_set_grad_enabled"})


def runtime_local(name: str) -> str:
    """The local a runtime param is bound to in generated code."""
    if name in _MODULE_NAMES or name.startswith(_GENERATED_PREFIXES):
        return f"rt_{name}"
    return name


@dataclass
class SlotNames:
    """The generated identifiers of one slot (prefixed so no slot name can collide
    with a generated local such as ``fb`` or ``plan``)."""

    slot: ResolvedSlot
    ident: str

    @property
    def buf(self) -> str:
        return f"buf_{self.ident}"

    @property
    def counts(self) -> Optional[Tuple[str, str]]:
        return COUNTS.get(self.slot.axis)

    def narrow(self, start: Optional[str], stop: str) -> str:
        index = f"{start or ''}:{stop}"
        return f"{self.buf}[{':, ' * self.slot.slice_dim}{index}]"

    def head(self) -> str:
        return self.buf if self.counts is None else self.narrow(None, self.counts[0])

    def tail(self) -> str:
        raw, padded = self.counts
        return self.narrow(raw, padded)

    def padded_view(self) -> str:
        return self.buf if self.counts is None else self.narrow(None, self.counts[1])

    @property
    def dense_narrow(self) -> bool:
        """Slicing a contiguous buffer gives a dense view only along its outermost
        non-trivial dimension; ``_foreach_copy_``'s fast path needs dense tensors."""
        return all(n == 1 for n in self.slot.shape[: self.slot.slice_dim])

    @property
    def split(self) -> Optional[int]:
        """L for a slot copied as rows (``mrope_positions``, :attr:`ResolvedSlot.rows`),
        else None."""
        return self.slot.shape[0] if self.slot.rows else None

    def head_rows(self) -> Optional[List[str]]:
        """The dense destinations of the head, or None where it has none."""
        if self.split is not None:
            return [f"{self.buf}[{i}, :{self.counts[0]}]" for i in range(self.split)]
        return [self.head()] if self.dense_narrow else None

    def tail_rows(self) -> Optional[List[str]]:
        """The 1-D destinations of the tail, or None (a wider tail: a constant pad as
        large as the buffer would double its memory)."""
        raw, padded = self.counts
        if self.split is not None:
            return [f"{self.buf}[{i}, {raw}:{padded}]" for i in range(self.split)]
        return [self.tail()] if len(self.slot.shape) == 1 else None

    @property
    def src(self) -> str:
        """The local holding this step's batch field."""
        return f"src_{self.ident}"

    def read_source(self) -> str:
        name = self.slot.name
        value = f"getattr(fb, {name!r}, None)" if self.slot.optional else _get("fb", name)
        return f"{self.src} = {value}"

    def expected_shape(self, extents: List[str]) -> str:
        """Source of the shape a step's source must have: the buffer's, with the raw
        count along the sliced dimension."""
        if self.counts is not None:
            extents = list(extents)
            extents[self.slot.slice_dim] = self.counts[0]
        return "torch.Size((" + ", ".join(extents) + ("," if len(extents) == 1 else "") + "))"


@dataclass
class CopyGroup:
    """One ``_foreach_copy_`` call: heads then 1-D tails, all one dtype on one device."""

    name: str
    host: bool
    dtype: str
    heads: List[SlotNames] = field(default_factory=list)
    optional_heads: List[SlotNames] = field(default_factory=list)
    tails: List[Tuple[SlotNames, str]] = field(default_factory=list)  # (slot, pad constant)


_CARRIERS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _foreach_lines(dsts: str, srcs: str, tails: str, pads: Optional[str],
                   optional: List[Tuple[str, str, str]]) -> List[str]:
    """One ``_foreach_copy_`` over plan lists ``dsts`` (then ``tails``) and sources
    ``srcs`` (then ``pads``, None when there are none); ``optional``: per head whose
    field may be None, (its source local, the statement adding its destination(s), the
    statement adding its source(s))."""
    if not optional:
        return [f"__gs_foreach_copy({dsts}, {srcs}{f' + {pads}' if pads else ''})"]
    lines = [f"dsts, srcs = list({dsts}), {srcs}"]
    for src, add_dst, add_src in optional:
        lines += [f"if {src} is not None:", f"    {add_dst}", f"    {add_src}"]
    if pads:
        return lines + [f"__gs_foreach_copy(dsts + {tails}, srcs + {pads})"]
    return lines + ["if dsts:", "    __gs_foreach_copy(dsts, srcs)"]


def _group_copy(g: CopyGroup) -> List[str]:
    """The statements of one host group's ``_foreach_copy_``."""
    optional = [(n.src, f"dsts.append(head_{n.ident})", f"srcs.append({n.src})") for n in g.optional_heads]
    return _foreach_lines(f"dsts_{g.name}", f"[{', '.join(n.src for n in g.heads)}]", f"tails_{g.name}",
                          f"pads_{g.name}" if g.tails else None, optional)


@dataclass
class DeviceGroup:
    """Everything one step writes on the registry's device, as ONE ``_foreach_copy_``:
    heads (2-D ``[L, capacity]`` ones as L rows), tails copied from constant pads, and
    computed slots whose built-in hook fills them with a step count (a constant per
    step size). CUDA's foreach copy is one kernel for a list of dense tensor pairs of
    one dtype; when the slots have several dtypes, every tensor is reinterpreted as the
    integer dtype of the smallest itemsize among them (the *carrier*): destination and pad views are made once per step
    size, a source's view per step, and only after its dtype was found to be the
    slot's and its layout contiguous with a unit last stride — otherwise the step takes the typed lists, where
    ``copy_`` casts as the contract says (more kernels, same bytes)."""

    heads: List[SlotNames] = field(default_factory=list)
    optional_heads: List[SlotNames] = field(default_factory=list)
    tails: List[Tuple[SlotNames, str]] = field(default_factory=list)  # (slot, pad constant)
    values: List[Tuple[SlotNames, str, str]] = field(default_factory=list)  # (slot, plan constant, count)
    carrier: Optional[str] = None

    def _dtypes(self) -> List[str]:
        members = self.heads + self.optional_heads + [n for n, _ in self.tails] + [n for n, _, _ in self.values]
        return [n.slot.dtype_name for n in members]

    def choose_carrier(self) -> None:
        dtypes = set(self._dtypes())
        if len(dtypes) == 1:
            self.carrier = dtypes.pop()
        elif dtypes:  # an integer dtype (copied bit for bit, unlike bool) of the smallest itemsize
            self.carrier = _CARRIERS[min(d.itemsize for d in dtypes)]

    @property
    def mixed(self) -> bool:
        return len(set(self._dtypes())) > 1

    def dtypes_named(self) -> List[str]:
        """dtypes generated code binds as ``dt_<name>`` locals."""
        if not self.mixed:
            return []
        return sorted({str(self.carrier)} | {str(n.slot.dtype_name) for n in self.heads + self.optional_heads})

    def prefixes(self) -> List[str]:
        """Plan lists: reinterpreted ('') and, for mixed dtypes, typed ('t')."""
        if self.carrier is None:
            return []
        return ["", "t"] if self.mixed else [""]

    def _view(self, n: SlotNames, expr: str, viewed: bool) -> str:
        return f"{expr}.view(dt_{self.carrier})" if viewed and n.slot.dtype_name != self.carrier else expr

    def plan_fields(self, p: str) -> List[Tuple[str, str]]:
        viewed = p == "" and self.mixed
        heads = [self._view(n, d, viewed) for n in self.heads for d in n.head_rows()]
        tails = [self._view(n, d, viewed) for n, _ in self.tails for d in n.tail_rows()]
        tails += [self._view(n, n.buf, viewed) for n, _, _ in self.values]
        pads = [self._view(n, f"{c}[:{n.counts[1]} - {n.counts[0]}]", viewed)
                for n, c in self.tails for _ in n.tail_rows()]
        pads += [self._view(n, c, viewed) for n, c, _ in self.values]
        fields = []
        if self.optional_heads:
            fields += [(f"{p}dsts_dev", f"[{', '.join(heads)}]"), (f"{p}tails_dev", f"[{', '.join(tails)}]")]
        else:
            fields.append((f"{p}dsts_dev", f"[{', '.join(heads + tails)}]"))
        if pads:
            fields.append((f"{p}pads_dev", f"[{', '.join(pads)}]"))
        for n in self.optional_heads:
            fields.append((f"{p}head_{n.ident}", f"[{', '.join(self._view(n, d, viewed) for d in n.head_rows())}]"))
        return fields

    def _src(self, n: SlotNames, viewed: bool) -> str:
        src = self._view(n, n.src, viewed)
        return f"*{src}.unbind(0)" if n.split is not None else src

    def _block(self, p: str, viewed: bool) -> List[str]:
        optional = []
        for n in self.optional_heads:
            src = self._view(n, n.src, viewed)
            optional.append((n.src, f"dsts += {p}head_{n.ident}",
                             f"srcs += {src}.unbind(0)" if n.split is not None else f"srcs.append({src})"))
        return _foreach_lines(f"{p}dsts_dev", f"[{', '.join(self._src(n, viewed) for n in self.heads)}]",
                              f"{p}tails_dev", f"{p}pads_dev" if self.tails or self.values else None, optional)

    def fill_lines(self) -> List[str]:
        if self.carrier is None:
            return []
        if not self.mixed:
            return self._block("", False)
        checks = []
        for n in self.heads + self.optional_heads:
            if n.slot.dtype_name != self.carrier:
                # view(dtype) needs a unit last stride, which is_contiguous() does not
                # promise for a last dimension of size 1 (an expanded [n, 1], say).
                check = (f"{n.src}.dtype is dt_{n.slot.dtype_name} and {n.src}.is_contiguous() "
                         f"and {n.src}.stride(-1) == 1")
                checks.append(f"({n.src} is None or ({check}))" if n.slot.optional else check)
        if not checks:
            return self._block("", True)
        return ([f"if {' and '.join(checks)}:"] + [f"    {line}" for line in self._block("", True)]
                + ["else:  # a source of another dtype or layout: typed copies, cast as copy_ does"]
                + [f"    {line}" for line in self._block("t", False)])


@dataclass
class PadConstant:
    name: str
    host: bool
    dtype: str
    value: str  # source of the value (a literal or a runtime param name)
    length: str  # source of the length (a capacity expression)


@dataclass
class Emission:
    """Everything the template lays out."""

    spec_name: str
    spec_source: str
    spec_identity: str
    version: str
    params: Dict[str, Any]
    runtime_params: List[str]
    used_runtime_params: List[Tuple[str, str]]  # (local, param name)
    slot_names: List[str]
    allocations: List[Tuple[str, str, str, str, str]]  # name, shape, dtype, device, init
    bind_lines: List[str]
    plan_lines: List[str]
    plan_fields: List[str]
    fill_lines: List[str]
    view_fields: List[Tuple[str, str]]  # (local, expression)
    extract_lines: List[str]
    needs_ctx: bool
    runtime_imports: List[Tuple[str, str]]  # (helper, mangled name), only those used


def _dtype_src(dtype: str) -> str:
    return f"torch.{dtype_name(dtype)}"


class Emitter:
    def __init__(self, spec: RegistrySpec, params: Mapping[str, Any], version: str, source_label: str):
        self.spec, self.params, self.version, self.source_label = spec, dict(params), version, source_label
        # sorted: the order of a spec's params is no part of its meaning (RegistrySpec.identity)
        self.runtime = sorted(n for n, p in spec.params.items() if p.runtime)
        self.slots = [s for s in self._symbolic_slots() if s.enabled]
        self.names = self._unique_names()
        self.hooks = {n.slot.name: self._expected_hooks(n.slot) for n in self.names}

    def _symbolic_slots(self) -> List[ResolvedSlot]:
        """The slots resolved for these params with capacities left symbolic (one
        generated module serves every max_bs): an extent that depends on a capacity
        is ``None`` here, so any shape the interpreter accepts is accepted."""
        slots = []
        for i, spec_slot in enumerate(self.spec.slots):
            fixed = [None if depends_on_capacity(e) else e for e in spec_slot.shape]
            placeholder = spec_slot.model_copy(update={"shape": [1 if e is None else e for e in fixed]})
            resolved = resolve_slot(placeholder, self.params, 1, 1, self.spec.slot_line(i))
            shape = tuple(None if e is None else n for e, n in zip(fixed, resolved.shape))
            slots.append(dataclasses.replace(resolved, shape=shape, rows=copied_as_rows(spec_slot)))
        return slots

    def _unique_names(self) -> List[SlotNames]:
        # Slots keep their own identifiers; one that mangles to an identifier already
        # taken gets a suffix — and never one that another slot's name mangles to.
        names, taken = [], {_ident(slot.name) for slot in self.slots}
        seen = set()
        for i, slot in enumerate(self.slots):
            ident = _ident(slot.name)
            if ident in seen:
                ident = f"{ident}_{i}"
                while ident in taken or ident in seen:
                    ident += "_"
            seen.add(ident)
            names.append(SlotNames(slot, ident))
        return names

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

    # -- pieces ------------------------------------------------------------------------
    def _spec_expr(self, value: Any, keep: Sequence[str]) -> str:
        if isinstance(value, str):
            baked = {k: v for k, v in self.params.items() if k not in self.runtime}
            names = {name: name for name in keep}
            names.update({name: runtime_local(name) for name in self.runtime})
            return Expr.parse(value).to_python(baked, keep=names)
        return python_literal(value)

    def _extents(self, slot: ResolvedSlot) -> List[str]:
        return [self._spec_expr(e, CAPACITY.values()) for e in self.spec.slot_spec(slot.name).shape]

    def _shape_src(self, slot: ResolvedSlot) -> str:
        extents = self._extents(slot)
        return "(" + ", ".join(extents) + ("," if len(extents) == 1 else "") + ")"

    def _pad_src(self, slot: ResolvedSlot) -> str:
        if slot.padding == "zero":
            return "0"
        return self._spec_expr(self.spec.slot_spec(slot.name).pad_value, ())

    def _used_runtime_params(self) -> List[str]:
        """Runtime params some enabled slot's pad value reads (others are not bound)."""
        used = set()
        for n in self.names:
            pad_value = self.spec.slot_spec(n.slot.name).pad_value
            if isinstance(pad_value, str) and n.slot.padding in ("fill_sentinel", "fill_once"):
                used |= Expr.parse(pad_value).names
        return [name for name in self.runtime if name in used]

    def allocations(self) -> List[Tuple[str, str, str, str, str]]:
        rows = []
        for n in self.names:
            s = n.slot
            init = self._pad_src(s) if s.fills_at_allocation else "None"
            rows.append((s.name, self._shape_src(s), _dtype_src(s.dtype_name),
                         "'cpu'" if s.host else "device", init))
        return rows

    def _fused_value(self, n: SlotNames) -> Optional[str]:
        """The step count a computed slot is filled with when its only hook is a built-in
        that fills the whole buffer with it (so the device group can write it), else None."""
        s = n.slot
        ref = s.post_fill
        if (s.host or s.copy_from_fb or s.resets_tail or self.hooks[s.name] != ["post_fill"]
                or ref not in BUILTIN_HOOKS or is_import_reference(ref)):
            return None
        return BUILTIN_HOOKS[ref].fills

    def emit(self) -> Emission:
        host_groups: Dict[str, CopyGroup] = {}
        dev = DeviceGroup()
        constants: Dict[Tuple[bool, str, str], PadConstant] = {}
        values: Dict[Tuple[str, str, str], str] = {}  # (shape, dtype, count) -> plan constant
        separate_resets: List[SlotNames] = []
        separate_copies: List[SlotNames] = []
        source_copies: List[SlotNames] = []

        def pad_for(s: ResolvedSlot) -> str:
            value = self._pad_src(s)
            key = (s.host, s.dtype_name, value)
            if key not in constants:
                constants[key] = PadConstant(f"pad{len(constants)}_{s.dtype_name}", s.host, s.dtype_name, value,
                                             CAPACITY[s.axis])
            elif CAPACITY[s.axis] not in constants[key].length:
                constants[key].length = f"max({constants[key].length}, {CAPACITY[s.axis]})"
            return constants[key].name

        for n in self.names:
            s = n.slot
            if s.host:
                group = host_groups.setdefault(s.dtype_name, CopyGroup(f"host_{s.dtype_name}", True, s.dtype_name))
                if s.resets_tail:
                    if len(s.shape) == 1:
                        group.tails.append((n, pad_for(s)))
                    else:
                        separate_resets.append(n)
                if s.copy_from_fb and s.source is None:
                    if n.dense_narrow:
                        (group.optional_heads if s.optional else group.heads).append(n)
                    else:
                        separate_copies.append(n)
                elif s.copy_from_fb:
                    source_copies.append(n)
                continue
            if s.resets_tail:
                if n.tail_rows() is not None:
                    dev.tails.append((n, pad_for(s)))
                else:
                    separate_resets.append(n)
            fills = self._fused_value(n)
            if fills is not None:
                shape_key = (self._shape_src(s), s.dtype_name, fills)
                if shape_key not in values:
                    values[shape_key] = f"val{len(values)}_{s.dtype_name}"
                dev.values.append((n, values[shape_key], fills))
                self.hooks[s.name] = []
            if not s.copy_from_fb:
                continue
            if s.source is not None:
                source_copies.append(n)
            elif n.head_rows() is not None:
                (dev.optional_heads if s.optional else dev.heads).append(n)
            else:
                separate_copies.append(n)
        dev.choose_carrier()
        host_groups = {k: g for k, g in host_groups.items() if g.heads or g.optional_heads or g.tails}

        used = self._used_runtime_params()
        bind_lines = [f"{runtime_local(name)} = params[{name!r}]" for name in used]
        bind_lines += [f"{n.buf} = buffers[{n.slot.name!r}]" for n in self.names]
        for n in self.names:
            for kind in self.hooks[n.slot.name]:
                bind_lines.append(f"hook_{kind}_{n.ident} = __gs_hook(hooks, {n.slot.name!r}, {kind!r})")
        for c in constants.values():
            device = "'cpu'" if c.host else "device"
            bind_lines.append(f"{c.name} = torch.full(({c.length},), {c.value}, dtype={_dtype_src(c.dtype)}, "
                              f"device={device})")
        for n in separate_resets:
            if n.slot.padding == "fill_sentinel":
                bind_lines.append(f"padval_{n.ident} = {self._pad_src(n.slot)}")
        bind_lines += [f"dt_{d} = {_dtype_src(d)}" for d in dev.dtypes_named()]

        # make_plan: every slice, view and expected shape a step of this size needs,
        # computed (and the step's counts checked) once per size.
        plan_lines: List[str] = ["__gs_check.counts(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)"]
        plan_fields: List[str] = []

        def plan(field_name: str, value: str) -> None:
            plan_lines.append(f"{field_name} = {value}")
            plan_fields.append(field_name)

        for (shape, dtype, count), name in values.items():
            plan_lines.append(f"{name} = torch.full({shape}, {count}, dtype={_dtype_src(dtype)}, device=device)")
        for g in host_groups.values():
            heads, tails = [n.head() for n in g.heads], [n.tail() for n, _ in g.tails]
            if g.optional_heads:  # heads whose presence varies go between the others and the tails
                plan(f"dsts_{g.name}", f"[{', '.join(heads)}]")
                plan(f"tails_{g.name}", f"[{', '.join(tails)}]")
            else:
                plan(f"dsts_{g.name}", f"[{', '.join(heads + tails)}]")
            plan(f"pads_{g.name}", f"[{', '.join(f'{c}[:{n.counts[1]} - {n.counts[0]}]' for n, c in g.tails)}]")
            for n in g.optional_heads:
                plan(f"head_{n.ident}", n.head())
        for prefix in dev.prefixes():
            for field_name, value in dev.plan_fields(prefix):
                plan(field_name, value)
        for n in separate_copies:
            plan(f"head_{n.ident}", n.head())
        for n in separate_resets:
            raw, padded = n.counts
            plan(f"tail_{n.ident}", f"{n.tail()} if {raw} < {padded} else None")

        # Each copied field's expected shape: named once per distinct shape, in the
        # plan when it depends on the step's counts, else once in bind.
        copied = [n for g in host_groups.values() for n in g.heads + g.optional_heads]
        copied += dev.heads + dev.optional_heads + separate_copies
        copied.sort(key=self.names.index)
        shape_of: Dict[str, str] = {}  # shape source -> local
        rows: Dict[str, str] = {}  # slot ident -> local of its expected shape
        for n in copied:
            expr = n.expected_shape(self._extents(n.slot))
            if expr not in shape_of:
                shape_of[expr] = f"rows{len(shape_of)}"
                if n.counts is None:
                    bind_lines.append(f"{shape_of[expr]} = {expr}")
                else:
                    plan(shape_of[expr], expr)
            rows[n.ident] = shape_of[expr]

        needs_ctx = any(set(self.hooks[n.slot.name]) - {"pre_capture"} for n in self.names)
        fill_lines: List[str] = []
        if needs_ctx:
            fill_lines.append("ctx = __gs_FillContext(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, "
                              "params, side_inputs)")
        hooked = [n for n in source_copies if "source" in self.hooks[n.slot.name]]
        hook_reads = [f"{n.src} = __gs_check.hook_source({n.slot.name!r}, hook_source_{n.ident}(fb, ctx))"
                      for n in hooked]
        if copied:
            # Read and check every field, then copy; anything that fails is diagnosed
            # slot by slot in the except branch (the happy path pays one shape
            # comparison per field).
            body = [n.read_source() for n in copied]
            mismatches = [f"({n.src} is not None and {n.src}.shape != {rows[n.ident]})" if n.slot.optional
                          else f"{n.src}.shape != {rows[n.ident]}" for n in copied]
            body += [f"{'if (' if i == 0 else '        or '}{m}{'):' if i == len(mismatches) - 1 else ''}"
                     for i, m in enumerate(mismatches)]
            body.append("    raise __gs_Mismatch")
            body += hook_reads  # after the fields, as the interpreter reads them
            for g in host_groups.values():
                body += _group_copy(g)
            body += dev.fill_lines()
            for n in separate_copies:
                copy = f"head_{n.ident}.copy_({n.src})"
                body += [f"if {n.src} is not None:", f"    {copy}"] if n.slot.optional else [copy]
            fill_lines += ["try:"] + [f"    {line}" for line in body]
            fill_lines += ["except Exception as exc:",
                           "    __gs_check.diagnose(fb, raw_bs, raw_num_tokens, exc)"]
        else:  # tails (and computed values) only
            fill_lines += hook_reads
            fill_lines += [f"__gs_foreach_copy(dsts_{g.name}, pads_{g.name})" for g in host_groups.values()
                           if g.tails]
            fill_lines += dev.fill_lines()
        for n in separate_resets:
            op = "zero_()" if n.slot.padding == "zero" else f"fill_(padval_{n.ident})"
            fill_lines += [f"if tail_{n.ident} is not None:", f"    tail_{n.ident}.{op}"]
        for n in hooked:
            d = n.slot.slice_dim
            fill_lines += [f"if {n.src} is not None:", f"    {n.buf}.narrow({d}, 0, {n.src}.shape[{d}]).copy_({n.src})"]
        for n in self.names:
            if "post_fill" in self.hooks[n.slot.name]:
                fill_lines.append(f"hook_post_fill_{n.ident}({n.buf}, fb, ctx)")

        view_fields, fields, extract_lines = [], ["'batch_size': padded_bs"], []
        for n in self.names:
            s = n.slot
            if s.structured:
                continue
            view_fields.append((f"view_{n.ident}", n.padded_view()))
            if s.plain_copy and s.optional:
                extract_lines += [f"if getattr(fb, {s.name!r}, None) is not None:",
                                  f"    fields[{s.name!r}] = view_{n.ident}"]
            else:
                fields.append(f"{s.name!r}: view_{n.ident}")
        extract_lines.insert(0, f"fields = {{{', '.join(fields)}}}")
        extract_lines.append("return make_view(fb, fields)")
        view_names = ("batch_size",) + tuple(n.slot.name for n in self.names if not n.slot.structured)
        bind_lines.append(f"make_view = __gs_ViewMaker({view_names!r}, {self.spec.name!r})")

        emitted = bind_lines + plan_lines + fill_lines + extract_lines
        runtime_imports = sorted((helper, alias) for helper, alias in RUNTIME_HELPERS
                                 if alias in _TEMPLATE_HELPERS or any(alias in line for line in emitted))
        return Emission(
            spec_name=self.spec.name, spec_source=self.source_label, spec_identity=self.spec.identity,
            version=self.version, params=structural_params(self.spec, self.params),
            runtime_params=self.runtime, used_runtime_params=[(runtime_local(n), n) for n in used],
            slot_names=[n.slot.name for n in self.names],
            allocations=self.allocations(), bind_lines=bind_lines, plan_lines=plan_lines,
            plan_fields=plan_fields, fill_lines=fill_lines, view_fields=view_fields,
            extract_lines=extract_lines, needs_ctx=needs_ctx, runtime_imports=runtime_imports,
        )
