"""Decide what generated code does for one (spec, params) and write it: :class:`Emitter` resolves the slots
(capacities left symbolic), names them, sorts them into copy groups; one builder per piece the template lays out
writes its lines. Per step the generated ``fill_from`` looks its step size up in a plan cache (``make_plan``:
every slice computed once per size), reads and checks every field, then issues the groups' ``_foreach_copy_``."""

from __future__ import annotations

import dataclasses
import re
from collections import namedtuple
from typing import Any, Dict, List, Mapping, Sequence, Set, Tuple

from ..spec.dtypes import DTypeName, dtype_name, is_torch_dtype
from ..spec.expr import Expr, python_literal
from ..spec.hooks import BUILTIN_HOOKS, HOOK_SIGNATURES, is_import_reference
from ..spec.model import RegistrySpec
from ..spec.errors import SpecError, SpecIssue
from ..spec.policy import ChoiceError
from ..spec.resolve import ResolvedSlot, copied_as_rows, depends_on_capacity, resolve_slot, tail_problems_of
from .embedded import canonical_parts
from .groups import Copies, plan_copies
from .layout import Chain, Item, assign, call, concatenated, condition, dict_of, flat, layout, method, normalise
from .layout import py_str, subscript, tuple_of
from .names import CAPACITY, RUNTIME_HELPERS, TEMPLATE_HELPERS, SlotNames, dtype_src, runtime_local, shape_name
from .names import shape_src, slot_idents, unique

PLAN_CACHE_LIMIT = 4096  # distinct step sizes kept; a server sees ~one per captured size
# Indentations: a function's body, a closure's, the fill's try block, the inner try that reads and copies.
BODY = 4
CLOSURE = 8
FILL = 12
COPY = 16
STEP_COUNTS = "raw_bs, padded_bs, raw_num_tokens, padded_num_tokens"


def structural_params(spec: RegistrySpec, params: Mapping[str, Any]) -> Dict[str, Any]:
    """The params baked into generated code: all but ``runtime`` (read when bound) and ``live`` ones."""
    return {k: v for k, v in params.items() if not (spec.params[k].runtime or spec.params[k].live)}


def value_source(value: Any) -> str:
    """A param value as byte-stable source: dtypes by name, non-finite floats as ``float('inf')``."""
    return repr(dtype_name(value)) if isinstance(value, DTypeName) or is_torch_dtype(value) else python_literal(value)


def params_literal(params: Mapping[str, Any]) -> str:
    """Params as one line of source (keys sorted): a compiled module's cache key."""
    return "{" + ", ".join(f"{k!r}: {value_source(v)}" for k, v in sorted(params.items())) + "}"


class Emitter:
    def __init__(self, spec: RegistrySpec, params: Mapping[str, Any], version: str, source: str, skip=frozenset()):
        self.spec = spec
        self.params = dict(params)
        self.version = version
        self.source_label = source
        # sorted: the order of a spec's params is no part of its meaning (RegistrySpec.identity)
        self.runtime = sorted(n for n, p in spec.params.items() if p.runtime)
        self.baked = structural_params(spec, self.params)  # folded into the code (not runtime, not live)
        self.slots = [s for s in self._symbolic_slots() if s.enabled]
        self.names = [SlotNames(s, i) for s, i in zip(self.slots, slot_idents(self.slots))]
        self.viewed = [n for n in self.names if not n.slot.structured]  # what extract sets (dotted slots: never)
        # fill_from writes all but ``skip`` (fill_from_skipping's variant); allocate and extract cover all.
        self.skip = skip
        self.fill_names = [n for n in self.names if n.slot.name not in skip]
        self.hooks = {n.slot.name: self._expected_hooks(n.slot) for n in self.names}

    def _symbolic_slots(self) -> List[ResolvedSlot]:
        """The slots resolved with capacities left symbolic (``None``): one module serves every max_bs."""
        slots = []
        issues = []
        for i, spec_slot in enumerate(self.spec.slots):
            fixed = [None if depends_on_capacity(e) else e for e in spec_slot.shape]
            placeholder = spec_slot.model_copy(update={"shape": tuple(1 if e is None else e for e in fixed)})
            try:  # a choice (padding, reset_to) a param makes is checked with these params, as a build checks it
                resolved = resolve_slot(placeholder, self.params, 1, 1, self.spec.slot_line(i), self.spec.absent_fields)
            except ChoiceError as exc:
                issues.append(SpecIssue(self.spec.path, self.spec.slot_line(i, exc.key), str(exc), spec_slot.name))
                continue
            problems = tail_problems_of(spec_slot, resolved, self.params) if resolved.enabled else []
            issues += [SpecIssue(self.spec.path, self.spec.slot_line(i, k), m, spec_slot.name) for k, m in problems]
            shape = tuple(None if e is None else n for e, n in zip(fixed, resolved.shape))
            slots.append(dataclasses.replace(resolved, shape=shape, rows=copied_as_rows(spec_slot)))
        if issues:
            raise SpecError(issues)
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
        return "0" if slot.padding == "zero" else self.spec_expr(self.spec.slot_spec(slot.name).pad_value, ())

    def runtime_binds(self, body: List[str]) -> List[str]:
        """Bind from ``params`` the runtime params ``body`` reads, of those a pad value reads."""
        pads = [self.spec.slot_spec(n.slot.name).pad_value for n in self.names if n.slot.padding.needs_pad_value]
        used = set().union(*(Expr.parse(p).names for p in pads if isinstance(p, str)))
        in_body = _used_names(body)
        bound = [(runtime_local(n), n) for n in self.runtime if n in used]
        return [" " * BODY + f"{local} = params[{py_str(n)}]" for local, n in bound if local in in_body]

    def emit(self) -> "Emitter":
        """Write every piece the template lays out (the ``*_lines``) and pick the runtime helpers; returns self."""
        copies = plan_copies(self)  # before any builder: it takes the hooks it fuses away
        shapes = expected_shapes(self, copies)
        self.allocate_lines = allocate_lines(self)
        self.plan_lines = plan_lines(copies, shapes)
        self.fill_lines, self.extract_lines = fill_lines(self, copies, shapes), extract_lines(self)
        self.view_lines = assign("entry", tuple_of([n.padded_view() for n in self.viewed]), CLOSURE)  # make_views
        others = self.allocate_lines + self.plan_lines + self.fill_lines + self.view_lines + self.extract_lines
        self.bind_lines = bind_lines(self, copies, shapes, others)
        emitted = "\n".join(others + self.bind_lines)
        imports = sorted(h for h in RUNTIME_HELPERS if h[1] in TEMPLATE_HELPERS or h[1] in emitted)
        # torch and the runtime helpers the module uses, bound after the handshake
        self.helper_lines = ["torch = __gs_rt.torch"] + [f"{alias} = __gs_rt.{helper}" for helper, alias in imports]
        self.constant_lines = constant_lines(self)
        return self


def constant_lines(em: Emitter) -> List[str]:
    """The constants, SPEC_NAME to the embedded spec (SPEC_SOURCE, SPEC_JSON)."""
    plain = (("SPEC_NAME", em.spec.name), ("SPEC_IDENTITY", em.spec.identity), ("GRAPHSLOT_VERSION", em.version))
    params = dict_of([(py_str(k), normalise(value_source(v))) for k, v in sorted(em.baked.items())])
    lines = [f"{k} = {py_str(v)}" for k, v in plain] + assign("PARAMS", params, 0)
    lines += assign("RUNTIME_PARAMS", tuple_of([py_str(n) for n in em.runtime]), 0)
    lines += assign("SLOTS", tuple_of([py_str(n.slot.name) for n in em.names]), 0)
    return lines + [f"SPEC_SOURCE = {py_str(em.source_label)}"] + concatenated("SPEC_JSON", canonical_parts(em.spec))


_NAME = re.compile(r"(?<![\w\"'])[^\W\d]\w*(?![\w\"'])")


def _used_names(lines: List[str]) -> Set[str]:
    """The names ``lines`` use (not in a string, nor parts of longer names), in one pass."""
    return set(_NAME.findall("\n".join(lines)))


def allocate_lines(em: Emitter) -> List[str]:
    """``allocate`` after its ``new_buffer``: the runtime params pad values read, one buffer per slot."""
    entries = []
    for s in (n.slot for n in em.names):
        where = py_str("cpu") if s.host else "device"
        args = [py_str(s.name), shape_src(em.extents(s)), dtype_src(s.dtype_name), where]
        if s.staged:  # (host, device): a runtime helper, so a module without staged slots reads as before
            args += [em.pad_src(s) if s.fills_at_allocation else "None", "pool", "source" if s.adopt else "None"]
            entries.append((py_str(s.name), call("__gs_allocate_staged", *args)))
            continue
        args += [em.pad_src(s)] if s.fills_at_allocation else []
        args += [] if s.adopt else ["adopt=False"]  # `adopt: never`: registry-owned whatever adopt= holds
        entries.append((py_str(s.name), call("new_buffer", *args)))
    body = layout(dict_of(entries), BODY, "return ")
    return em.runtime_binds(body) + body


# One local per distinct expected shape of a copied field (``of``: slot ident -> local), made in the plan when
# it depends on the counts, else in bind (``in_plan``, ``in_bind``: (local, extents)).
Shapes = namedtuple("Shapes", "of in_plan in_bind")


def expected_shapes(em: Emitter, copies: Copies) -> Shapes:
    shapes = Shapes({}, [], [])
    names = {}
    for n in copies.copied(em.fill_names):
        extents = em.extents(n.slot)
        if n.counts is not None:
            extents[n.slot.slice_dim] = n.counts[0]
        name = unique(names, shape_name(extents), repr(extents))
        if name not in shapes.of.values():
            (shapes.in_bind if n.counts is None else shapes.in_plan).append((name, extents))
        shapes.of[n.ident] = name
    return shapes


def bind_lines(em: Emitter, copies: Copies, shapes: Shapes, others: List[str]) -> List[str]:
    """``bind``'s own statements: runtime params, the buffers ``others`` use, hooks, constants, the view maker."""
    lines = []
    used = _used_names(others)
    for n in em.names:
        if n.slot.staged and {n.buf, n.view_buf} & used:  # a staged slot's buffers: (host, device)
            lines += assign(f"{n.buf}, {n.view_buf}", subscript("buffers", py_str(n.slot.name)), BODY)
        elif n.buf in used:
            lines += assign(n.buf, subscript("buffers", py_str(n.slot.name)), BODY)
    for n in em.names:
        for kind in em.hooks[n.slot.name]:
            hook = call("__gs_hook", "hooks", py_str(n.slot.name), py_str(kind))
            if kind == "pre_capture":  # run by the runner at capture: only checked to be bound here
                lines += layout(hook, BODY)
            elif n.slot.name not in em.skip:
                lines += assign(f"hook_{kind}_{n.ident}", hook, BODY)
    for c in copies.constants:
        where = py_str("cpu") if c.host else "device"
        full = call("torch.full", f"({c.length},)", c.value, f"dtype={dtype_src(c.dtype)}", f"device={where}")
        lines += assign(c.name, full, BODY)
    sentinels = [n for n in copies.separate_resets if n.slot.padding == "fill_sentinel"]
    lines += [" " * BODY + f"padval_{n.ident} = {em.pad_src(n.slot)}" for n in sentinels]
    lines += [" " * BODY + f"dt_{d} = {dtype_src(d)}" for d in copies.dev.dtypes_named()]
    if copies.dev.dtypes_named():  # one copy kernel for every dtype: worth the views where kernels launch
        lines += [" " * BODY + 'dt_carrier = device.type == "cuda"']
    for name, extents in shapes.in_bind:
        lines += assign(name, call("torch.Size", shape_src(extents)), BODY)
    view_names = [py_str("batch_size")] + [py_str(n.slot.name) for n in em.viewed]
    maker = call("__gs_ViewMaker", tuple_of(view_names), py_str(em.spec.name))
    lines += assign("make_view", maker, BODY)
    return em.runtime_binds(lines) + lines


def plan_fields(copies: Copies, shapes: Shapes) -> List[Tuple[str, Item]]:
    """(name, value) of everything a plan holds: the groups' lists, other heads and tails, the shapes."""
    fields = [f for g in copies.groups for p in g.prefixes() for f in g.plan_fields(p)]
    fields += [(f"head_{n.ident}", n.head()) for n in copies.separate_copies]
    fields += [(f"tail_{n.ident}", n.narrow(n.counts[0], n.tail_end)) for n in copies.separate_resets]
    fields += [field for n in copies.repeats for field in _repeat_fields(n)]
    fields += [field for n in copies.staged for field in _stage_fields(n)]
    return fields + [(name, call("torch.Size", shape_src(extents))) for name, extents in shapes.in_plan]


def _repeat_fields(n: SlotNames) -> List[Tuple[str, Item]]:
    """A repeat_last tail and what it copies: the head's last row expanded (an empty head: zeros)."""
    dst = f"rep_dst_{n.ident}"
    start = n.counts[0]
    k = n.slot.extra_rows
    raw = n.pad_counts[0]
    # the head's last row: start - 1, that is raw + k - 1
    if k == 1:
        before = raw
    elif k:
        before = f"{raw} + {k - 1}"
    else:
        before = f"{raw} - 1"
    last = method(n.narrow(before, start), "expand_as", dst)
    src = last if k else f"{flat(last)} if {raw} else torch.zeros_like({dst})"
    return [(dst, n.narrow(start, n.tail_end)), (f"rep_src_{n.ident}", src)]


def _stage_fields(n: SlotNames) -> List[Tuple[str, Item]]:
    """A staged slot's copy: the device rows and the host rows (``[:padded]``, or whole under reset_to: capacity)."""
    whole = n.counts is None or n.slot.to_capacity

    def rows(buf: str) -> Item:
        return buf if whole else n.narrow(None, n.counts[1], buf=buf)

    return [(f"stage_dst_{n.ident}", rows(n.view_buf)), (f"stage_src_{n.ident}", rows(n.buf))]


def _guards(copies: Copies) -> Dict[str, str]:
    """Plan fields that are None on a step where they have nothing to do: the condition under which they are set."""
    guards = {f"tail_{n.ident}": f"{n.counts[0]} < {n.tail_end}" for n in copies.separate_resets}
    for n in copies.repeats:
        for name in (f"rep_dst_{n.ident}", f"rep_src_{n.ident}"):
            guards[name] = f"{n.counts[0]} < {n.tail_end}"
    for n in copies.staged:  # one tensor for both buffers: staged in name only, no copy
        for name in (f"stage_dst_{n.ident}", f"stage_src_{n.ident}"):
            guards[name] = f"{n.buf} is not {n.view_buf}"
    return guards


def plan_lines(copies: Copies, shapes: Shapes) -> List[str]:
    """``make_plan``'s body up to the cache: the counts checked, computed values, every field, ``plan``."""
    lines = [" " * CLOSURE + f"__gs_check.counts({STEP_COUNTS})"]
    for name, extents, dtype, count in copies.values:
        value = call("torch.full", shape_src(extents), count, f"dtype={dtype_src(dtype)}", "device=device")
        lines += assign(name, value, CLOSURE)
    guards = _guards(copies)
    for name, value in plan_fields(copies, shapes):
        if name in guards:  # None when the step has nothing for it to do, so the fill skips it
            lines += [" " * CLOSURE + f"{name} = None", " " * CLOSURE + f"if {guards[name]}:"]
        lines += assign(name, value, CLOSURE + 4 if name in guards else CLOSURE)
    return lines + assign("plan", tuple_of([name for name, _ in plan_fields(copies, shapes)]), CLOSURE)


def _shape_checks(copied: List[SlotNames], shapes: Shapes) -> List[str]:
    """The happy path pays one shape comparison per field; a mismatch is diagnosed slot by slot."""
    raises = " " * (COPY + 4) + "raise __gs_Mismatch"
    required = tuple(f"{n.src}.shape != {shapes.of[n.ident]}" for n in copied if not n.slot.optional)
    lines = condition("if", Chain("or", required), COPY) + [raises] if required else []
    for n in copied:
        if n.slot.optional:
            checks = (f"{n.src} is not None", f"{n.src}.shape != {shapes.of[n.ident]}")
            lines += condition("if", Chain("and", checks), COPY) + [raises]
    return lines


def _diagnosed(body: List[str]) -> List[str]:
    """``body`` in a try block whose except branch raises what the interpreter would (``StepChecker.diagnose``)."""
    pad = " " * FILL
    diagnose = [pad + "except Exception as exc:", pad + "    __gs_check.diagnose(fb, raw_bs, raw_num_tokens, exc)"]
    return [pad + "try:"] + body + diagnose


def fill_lines(em: Emitter, copies: Copies, shapes: Shapes) -> List[str]:
    """``fill_from``'s body after the plan lookup: read and check every field, check the source hooks' results,
    then copy, as interpreted; a field's or a copy's failure is diagnosed in an except branch, a source hook's is
    its own."""
    pad = " " * FILL
    fields = tuple_of([name for name, _ in plan_fields(copies, shapes)])
    lines = layout(fields, FILL, "", " = plan") if fields.items else []
    if any(set(em.hooks[n.slot.name]) - {"pre_capture"} for n in em.fill_names):
        lines += assign("ctx", call("__gs_context", *STEP_COUNTS.split(", "), "params", "side_inputs"), FILL)
    hooked = [n for n in copies.source_copies if "source" in em.hooks[n.slot.name]]
    copied = copies.copied(em.fill_names)
    at = COPY if copied else FILL  # no field read (tails and computed values only): no try block
    reads = [line for n in copied for line in n.read_source(COPY)] + _shape_checks(copied, shapes)
    hook_reads = []
    for n in hooked:  # after the fields, as the interpreter reads them; outside the try: its failure is its own
        read = call("__gs_check.hook_source", py_str(n.slot.name), call(f"hook_source_{n.ident}", "fb", "ctx"))
        hook_reads += assign(n.src, read, FILL)
    writes = []
    for g in copies.groups:
        writes += g.fill_lines(at)
    for n in copies.separate_copies:
        guard = [f"{' ' * COPY}if {n.src} is not None:"] if n.slot.optional else []
        writes += guard + layout(call(f"head_{n.ident}.copy_", n.src), COPY + 4 if guard else COPY)
    if copied and hook_reads:  # read the fields, run the source hooks, copy: a field's failure is diagnosed
        lines += _diagnosed(reads) + hook_reads + _diagnosed(writes)
    elif copied:
        lines += _diagnosed(reads + writes)
    else:
        lines += hook_reads + writes
    for n in copies.separate_resets:
        zero = n.slot.padding == "zero"
        reset = call(f"tail_{n.ident}.zero_") if zero else call(f"tail_{n.ident}.fill_", f"padval_{n.ident}")
        lines += [f"{pad}if tail_{n.ident} is not None:"] + layout(reset, FILL + 4)
    for n in hooked:  # a source gives any row count up to the capacity (a 0-d slot: its one value)
        d = n.slot.slice_dim
        narrow = call(f"{n.buf}.narrow", str(d), "0", f"{n.src}.shape[{d}]") if n.slot.shape else n.buf
        lines += [f"{pad}if {n.src} is not None:"] + layout(method(narrow, "copy_", n.src), FILL + 4)
    for n in em.fill_names:
        if "post_fill" in em.hooks[n.slot.name]:
            lines += layout(call(f"hook_post_fill_{n.ident}", n.buf, "fb", "ctx"), FILL)
    for n in copies.repeats:  # after every hook: a computed head is repeated too
        lines += [f"{pad}if rep_dst_{n.ident} is not None:"]
        lines += layout(call(f"rep_dst_{n.ident}.copy_", f"rep_src_{n.ident}"), FILL + 4)
    for n in copies.staged:  # last: the host buffer as the fill left it
        lines += [f"{pad}if stage_dst_{n.ident} is not None:"]
        lines += layout(call(f"stage_dst_{n.ident}.copy_", f"stage_src_{n.ident}", "non_blocking=True"), FILL + 4)
    return lines


def extract_lines(em: Emitter) -> List[str]:
    """``extract`` after the view lookup: the batch's fields, set on a copy of it."""
    lines = layout(tuple_of([f"view_{n.ident}" for n in em.viewed]), CLOSURE, "", " = entry") if em.viewed else []
    sometimes = [n for n in em.viewed if n.slot.plain_copy and n.slot.optional]
    always = [n for n in em.viewed if not (n.slot.plain_copy and n.slot.optional)]
    entries = [(py_str("batch_size"), "padded_bs")] + [(py_str(n.slot.name), f"view_{n.ident}") for n in always]
    lines += assign("fields", dict_of(entries), CLOSURE)
    for n in sometimes:  # optional fields: set only when the batch has them
        lines += condition("if", f"getattr(fb, {py_str(n.slot.name)}, None) is not None", CLOSURE)
        lines += assign(f"fields[{py_str(n.slot.name)}]", f"view_{n.ident}", CLOSURE + 4)
    return lines + [" " * CLOSURE + "return make_view(fb, fields)"]
