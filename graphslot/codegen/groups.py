"""Which copies share one ``_foreach_copy_`` (:class:`CopyGroup`): one for everything on the device, one per
dtype for host-side slots; a ``copy_`` / ``fill_`` for what no group takes (a wide tail, a strided head).
:func:`plan_copies` sorts the slots; the groups write their plan fields and fill lines."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from ..spec.hooks import BUILTIN_HOOKS, is_import_reference
from .layout import Chain, Item, Operand, assign, call, condition, flat, layout, list_of, method, subscript
from .names import CAPACITY, SlotNames, pad_name, unique, value_name

if TYPE_CHECKING:
    from .emitter import Emitter

_CARRIERS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def foreach(dsts: str, srcs: str, indent: int) -> List[str]:
    return layout(call("__gs_foreach_copy", dsts, srcs), indent)


# A constant tensor tails are copied from: its value's source (a literal or a runtime param's local), as long
# as its axis' capacity.
PadConstant = namedtuple("PadConstant", "name host dtype value length")


@dataclass
class CopyGroup:
    """What a step writes on the device (host-side: per dtype) as ONE ``_foreach_copy_``: heads (``[L, capacity]``
    ones as L rows), tails from constant pads, computed slots a built-in fills with a step count. CUDA's foreach is
    one kernel per dtype, so mixed dtypes are reinterpreted as the integer *carrier* of the smallest itemsize,
    on CUDA only (a CPU's foreach is a loop of copies the views only slow) and only for sources of the slot's
    dtype with a unit last stride; else the typed lists, where ``copy_`` casts as the contract says."""

    name: str = "dev"
    heads: List[SlotNames] = field(default_factory=list)
    optional_heads: List[SlotNames] = field(default_factory=list)
    tails: List[Tuple[SlotNames, Item]] = field(default_factory=list)  # (slot, its pad constant's tail slice)
    values: List[Tuple[SlotNames, str]] = field(default_factory=list)  # (slot, plan constant)
    carrier: Optional[str] = None
    mixed: bool = False

    def choose_carrier(self) -> None:
        """One dtype: itself; several: an integer dtype (copied bit for bit, unlike bool) of the smallest itemsize."""
        members = self.heads + self.optional_heads + [n for n, _ in self.tails + self.values]
        dtypes = {n.slot.dtype_name for n in members}
        self.mixed = len(dtypes) > 1
        self.carrier = _CARRIERS[min(d.itemsize for d in dtypes)] if self.mixed else next(iter(dtypes), None)

    def dtypes_named(self) -> List[str]:  # bound as ``dt_<name>`` locals
        named = {str(self.carrier)} | {str(n.slot.dtype_name) for n in self.heads + self.optional_heads}
        return sorted(named) if self.mixed else []

    def prefixes(self) -> List[str]:
        """Plan lists: reinterpreted ('') and, for mixed dtypes, typed ('t')."""
        return [] if self.carrier is None else ["", "t"] if self.mixed else [""]

    def _view(self, n: SlotNames, expr: Item, viewed: bool) -> Item:
        """``expr`` as the carrier dtype where ``viewed`` (a 0-d tensor first as 1-D: itemsizes need a dim)."""
        if not viewed or n.slot.dtype_name == self.carrier:
            return expr
        return method(method(expr, "view", "1") if not n.slot.shape else expr, "view", f"dt_{self.carrier}")

    def plan_fields(self, p: str) -> List[Tuple[str, Item]]:
        viewed = p == "" and self.mixed
        heads = [self._view(n, d, viewed) for n in self.heads for d in n.head_rows()]
        tails = [self._view(n, d, viewed) for n, _ in self.tails for d in n.tail_rows()]
        tails += [self._view(n, n.buf, viewed) for n, _ in self.values]
        pads = [self._view(n, c, viewed) for n, c in self.tails for _ in n.tail_rows()]
        pads += [self._view(n, c, viewed) for n, c in self.values]
        if self.optional_heads:
            fields = [(f"{p}dsts_{self.name}", list_of(heads)), (f"{p}tails_{self.name}", list_of(tails))]
        else:
            fields = [(f"{p}dsts_{self.name}", list_of(heads + tails))]
        if pads:
            fields.append((f"{p}pads_{self.name}", list_of(pads)))
        for n in self.optional_heads:
            fields.append((f"{p}head_{n.ident}", list_of([self._view(n, d, viewed) for d in n.head_rows()])))
        return fields

    def _source(self, n: SlotNames, viewed: bool) -> Item:
        src = self._view(n, n.src, viewed)
        return f"*{flat(src)}.unbind(0)" if n.split is not None else src

    def _block(self, p: str, viewed: bool, indent: int) -> List[str]:
        """One ``_foreach_copy_``: the heads (then the tails) from their sources (then the pads)."""
        dsts = f"{p}dsts_{self.name}"
        tails = f"{p}tails_{self.name}"
        pad = " " * indent
        pads = f"{p}pads_{self.name}" if self.tails or self.values else None
        sources = [self._source(n, viewed) for n in self.heads]
        if not self.optional_heads:
            if not sources:
                return foreach(dsts, pads, indent)
            srcs = f"srcs + {pads}" if pads else "srcs"
            return assign("srcs", list_of(sources), indent) + foreach(dsts, srcs, indent)
        lines = [f"{pad}dsts = list({dsts})"] + assign("srcs", list_of(sources), indent)
        for n in self.optional_heads:  # added when the batch has them
            src = self._view(n, n.src, viewed)
            lines += [f"{pad}if {n.src} is not None:"] + assign("dsts", f"{p}head_{n.ident}", indent + 4, "+=")
            if n.split is not None:
                lines += assign("srcs", method(src, "unbind", "0"), indent + 4, "+=")
            else:
                lines += layout(call("srcs.append", src), indent + 4)
        if pads:
            return lines + foreach(f"dsts + {tails}", f"srcs + {pads}", indent)
        return lines + [f"{pad}if dsts:"] + foreach("dsts", "srcs", indent + 4)

    def _viewable(self) -> List[Operand]:
        """Each source of its slot's dtype with a unit last stride (view(dtype) needs one; is_contiguous() does
        not promise it for a last dimension of size 1, an expanded [n, 1] say)."""
        operands: List[Operand] = []
        for n in self.heads + self.optional_heads:
            if n.slot.dtype_name == self.carrier:
                continue
            checks = (f"{n.src}.dtype is dt_{n.slot.dtype_name}", f"{n.src}.is_contiguous()")
            checks += (f"{n.src}.stride(-1) == 1",) if n.slot.shape else ()  # a 0-d source has no strides
            operands += [Chain("or", (f"{n.src} is None", Chain("and", checks)))] if n.slot.optional else checks
        return operands

    def fill_lines(self, indent: int) -> List[str]:
        if self.carrier is None:
            return []
        if not self.mixed:
            return self._block("", False, indent)
        # on CUDA only, and then only for sources the views take (none to check: the heads are of the carrier dtype)
        pad = " " * indent
        lines = condition("if", Chain("and", ("dt_carrier",) + tuple(self._viewable())), indent)
        lines += self._block("", True, indent + 4)
        lines += [f"{pad}else:", f"{pad}    # the CPU, another dtype or layout: typed copies (copy_ casts)"]
        return lines + self._block("t", False, indent + 4)


@dataclass
class Copies:
    """How one step writes every slot."""

    groups: List[CopyGroup]  # the host-side ones, then the device's
    dev: CopyGroup
    constants: List[PadConstant]
    values: List[Tuple[str, Tuple[str, ...], str, str]]  # (name, shape extents, dtype, count)
    separate_resets: List[SlotNames]  # tails no group takes: their own fill_
    separate_copies: List[SlotNames]  # heads no group takes: their own copy_
    source_copies: List[SlotNames]  # heads a source hook gives
    repeats: List[SlotNames] = field(default_factory=list)  # repeat_last tails: one copy_ each, after the hooks
    staged: List[SlotNames] = field(default_factory=list)  # staged slots: one copy_ host to device each, last

    def copied(self, order: List[SlotNames]) -> List[SlotNames]:
        """The slots whose batch field is read and checked, in slot order."""
        heads = [n for g in self.groups for n in g.heads + g.optional_heads] + self.separate_copies
        position = {n.slot.name: i for i, n in enumerate(order)}  # not order.index: linear in slots
        return sorted(heads, key=lambda n: position[n.slot.name])


def plan_copies(em: "Emitter") -> Copies:
    """Sort the slots into copy groups; a computed slot the device group fills drops its hook from ``em.hooks``."""
    host: Dict[str, CopyGroup] = {}
    dev = CopyGroup()
    constants = {}
    names = {}
    values: Dict[str, Tuple[str, Tuple[str, ...], str, str]] = {}
    resets = []
    copies = []
    sourced = []
    for n in em.fill_names:
        s = n.slot
        # the fill writes a staged slot's host buffer: it joins the host-side copies
        group = host.setdefault(s.dtype_name, CopyGroup(f"host_{s.dtype_name}")) if s.fills_host else dev
        if s.resets_tail and n.tail_rows() is not None:  # from a constant as long as the axis' capacity
            value = em.pad_src(s)
            key = (s.fills_host, s.dtype_name, s.axis, value)
            name = unique(names, pad_name(*key), repr(key))
            constants.setdefault(name, PadConstant(name, s.fills_host, s.dtype_name, value, CAPACITY[s.axis]))
            group.tails.append((n, subscript(name, f"{n.pad_counts[0]}:{n.pad_end}")))
        elif s.resets_tail:
            resets.append(n)
        # a computed slot whose only hook, a built-in, fills it with a step count: the device group writes it
        fused = em.hooks[s.name] == ["post_fill"] and not (s.fills_host or s.copy_from_fb or s.resets_tail)
        builtin = BUILTIN_HOOKS.get(s.post_fill) if fused and not is_import_reference(s.post_fill) else None
        count = builtin.fills if builtin else None
        if count is not None:
            extents = tuple(em.extents(s))
            name = unique(names, value_name(s.dtype_name, count, extents), repr((s.dtype_name, count, extents)))
            values.setdefault(name, (name, extents, s.dtype_name, count))
            dev.values.append((n, name))
            em.hooks[s.name] = []
        if not s.copy_from_fb:
            continue
        if s.source is not None:
            sourced.append(n)
        elif n.head_rows() is not None:
            (group.optional_heads if s.optional else group.heads).append(n)
        else:
            copies.append(n)
    groups = [g for g in host.values() if g.heads or g.optional_heads or g.tails] + [dev]
    for g in groups:
        g.choose_carrier()
    repeats = [n for n in em.fill_names if n.slot.repeats_last]
    staged = [n for n in em.fill_names if n.slot.staged]
    return Copies(
        groups, dev, list(constants.values()), list(values.values()), resets, copies, sourced, repeats, staged
    )
