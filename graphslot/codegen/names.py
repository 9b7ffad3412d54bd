"""The identifiers generated code uses, each named by what it holds (``pad_dev_int64_bs_zero``,
``shape_tokens``), never by a position: adding a slot adds lines to a module and renames nothing."""

from __future__ import annotations

import builtins
import hashlib
import keyword
import re
from typing import Dict, List, Optional, Sequence, Tuple

from ..spec.dtypes import dtype_name
from ..spec.resolve import ResolvedSlot
from .layout import Item, assign, call, py_str, subscript

COUNTS = {"bs": ("raw_bs", "padded_bs"), "tokens": ("raw_num_tokens", "padded_num_tokens")}
CAPACITY = {"bs": "max_bs", "tokens": "max_num_tokens"}

# Names generated code binds where runtime params are bound: a runtime param named like one (or a generated
# prefix, or ambiguous to pycodestyle, E741) is bound to ``rt_<name>`` so it neither shadows nor is shadowed.
_MODULE_NAMES = frozenset(
    "torch max_bs max_num_tokens device params pool source buffers hooks plans views make_plan fill_from make_views "
    "extract allocate bind make_view fields exc grad plan entry new_buffer l O I".split()
) | frozenset(dir(builtins))
_GENERATED_PREFIXES = tuple(
    "rt_ buf_ hook_ pad src shape_ val_ dt_ head_ tail_ dsts view_ host_ rep_ stage_ __gs_".split()
)

# graphslot.codegen.runtime helpers a module may use, (name, the mangled name it binds); the template always
# uses the last four.
RUNTIME_HELPERS = tuple(
    tuple(pair.split(":"))
    for pair in "SourceMismatch:__gs_Mismatch foreach_copy:__gs_foreach_copy hook:__gs_hook allocate_buffer:"
    "__gs_allocate ViewMaker:__gs_ViewMaker grad_enabled:__gs_grad_enabled "
    "set_grad_enabled:__gs_set_grad_enabled allocate_staged:__gs_allocate_staged".split()
)
TEMPLATE_HELPERS = frozenset({"__gs_allocate", "__gs_ViewMaker", "__gs_grad_enabled", "__gs_set_grad_enabled"})


def runtime_local(name: str) -> str:
    """The local a runtime param is bound to in generated code."""
    return f"rt_{name}" if name in _MODULE_NAMES or name.startswith(_GENERATED_PREFIXES) else name


def dtype_src(dtype: str) -> str:
    return f"torch.{dtype_name(dtype)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]


# Tags are a fixed word, digits, or ``x`` and a digest, so a joined tag reads back one way only.
_EXTENT_TAGS = {"raw_bs": "bs", "raw_num_tokens": "tokens", "max_bs": "max_bs", "max_num_tokens": "max_tokens"}
_NUMBER = re.compile(r"(-?)([0-9]+)(?:\.([0-9]+))?(?:e(-?)([0-9]+))?")
_SPECIAL = {"0": "zero", "True": "true", "False": "false"}
_SPECIAL.update({f'float("{v}")': v.replace("-", "neg") for v in ("inf", "-inf", "nan", "-nan")})
_RESERVED_TAG = re.compile(r"zero|true|false|inf|neginf|nan|negnan|neg[0-9].*|x[0-9a-f]{10}")


def _extent_tag(source: str) -> str:
    count, plus, extra = source.partition(" + ")  # a count with extra rows: ``raw_bs + 1`` -> ``bs_plus1``
    if plus and count in _EXTENT_TAGS and extra.isdigit():
        return f"{_EXTENT_TAGS[count]}_plus{extra}"
    return _EXTENT_TAGS.get(source) or (source if source.isdigit() else "x" + _digest(source))


def _value_tag(source: str) -> str:
    """``0`` -> ``zero``, ``-1`` -> ``neg1``, ``0.5`` -> ``0p5``, ``1e-05`` -> ``1em05``, a name as is, else a hash."""
    if source in _SPECIAL:
        return _SPECIAL[source]
    number = _NUMBER.fullmatch(source)
    if number:
        sign, whole, fraction, exp_sign, exponent = number.groups()
        tag = ("neg" if sign else "") + whole + (f"p{fraction}" if fraction is not None else "")
        return tag + (f"e{'m' if exp_sign else ''}{exponent}" if exponent is not None else "")
    if source.isidentifier() and not _RESERVED_TAG.fullmatch(source):
        return source
    return "x" + _digest(source)


def pad_name(host: bool, dtype: str, axis: str, value: str) -> str:
    """``pad_dev_int64_bs_zero``, ``pad_host_int64_bs_seq_len_fill_value``."""
    return f"pad_{'host' if host else 'dev'}_{dtype}_{axis}_{_value_tag(value)}"


def shape_name(extents: Sequence[str]) -> str:
    """A source's expected shape: ``shape_tokens`` (``(raw_num_tokens,)``), ``shape_3_tokens``."""
    return "shape_" + ("_".join(_extent_tag(e) for e in extents) or "scalar")


def value_name(dtype: str, count: str, extents: Sequence[str]) -> str:
    """A constant a computed slot is filled with per step size: ``val_int32_padded_tokens_1``."""
    return f"val_{dtype}_{count.replace('num_', '')}_" + "_".join(_extent_tag(e) for e in extents)


def unique(names: Dict[str, str], name: str, key: str) -> str:
    """``name``, recorded for ``key``; two keys sharing a name (a digest collision) are refused."""
    if names.setdefault(name, key) != key:
        raise RuntimeError(
            f"graphslot internal error: generated name {name!r} stands for both {names[name]!r} and {key!r}"
        )
    return name


def slot_idents(slots: Sequence[ResolvedSlot]) -> List[str]:
    """Each slot's name, mangled (``a.b`` -> ``a__b``); a mangled name two slots give gets a digest of its own."""
    mangled = [re.sub(r"\W", "_", slot.name.replace(".", "__")) for slot in slots]
    taken = set(mangled)
    idents = []
    for slot, ident in zip(slots, mangled):
        if ident != slot.name and mangled.count(ident) > 1:
            ident = f"{ident}_{_digest(slot.name)}"
            while ident in taken:
                ident += "_"
        taken.add(ident)
        idents.append(ident)
    return idents


class SlotNames:
    """One slot's generated identifiers and slices (prefixed: no slot name can be a local like ``plan``)."""

    def __init__(self, slot: ResolvedSlot, ident: str):
        self.slot = slot
        self.ident = ident
        self.src = f"src_{ident}"
        # The buffer the graph reads (views, a staging copy's target) and the one the fill writes: a staged
        # slot's host buffer.
        self.view_buf = f"buf_{ident}"
        self.buf = f"host_{ident}" if slot.staged else self.view_buf
        steps = COUNTS.get(slot.axis)
        k = slot.extra_rows
        #: The counts along the sliced dimension, extra rows included: the head ``[:raw + k]``, the view
        #: ``[:padded + k]``; ``pad_counts``: the same without them (a pad constant's slice, as long as the tail).
        self.counts: Optional[Tuple[str, str]] = steps if steps is None or not k else tuple(f"{c} + {k}" for c in steps)
        self.pad_counts = steps
        #: Where a written tail ends: the padded count, or the buffer's end under ``reset_to: capacity``.
        self.tail_end: Optional[str] = None
        self.pad_end: Optional[str] = None
        if steps is not None and slot.to_capacity:
            capacity = CAPACITY[slot.axis]
            self.pad_end = capacity
            self.tail_end = f"{capacity} + {k}" if k else capacity
        elif steps is not None:
            self.pad_end = steps[1]
            self.tail_end = self.counts[1]
        self.split = slot.shape[0] if slot.rows else None  # L for a slot copied as rows (``mrope_positions``)
        # A head is dense (as ``_foreach_copy_``'s fast path needs) only when sliced on the outermost dimension.
        self.dense_narrow = all(n == 1 for n in slot.shape[: slot.slice_dim])

    def narrow(self, start: Optional[str], stop: str, row: Optional[int] = None, buf: Optional[str] = None) -> Item:
        """The buffer the fill writes (or ``buf``) sliced along its sliced dimension (in row ``row`` of a slot
        copied as rows)."""
        lead = f"{row}, " if row is not None else ":, " * self.slot.slice_dim
        return subscript(buf or self.buf, f"{lead}{start or ''}:{stop}")

    def head(self) -> Item:
        return self.buf if self.counts is None else self.narrow(None, self.counts[0])

    def padded_view(self) -> Item:
        return self.view_buf if self.counts is None else self.narrow(None, self.counts[1], buf=self.view_buf)

    def head_rows(self) -> Optional[List[Item]]:
        """The dense destinations of the head, or None where it has none."""
        if self.split is not None:
            return [self.narrow(None, self.counts[0], i) for i in range(self.split)]
        return [self.head()] if self.dense_narrow else None

    def tail_rows(self) -> Optional[List[Item]]:
        """The 1-D tail rows, or None (a wider tail's constant pad would double its memory)."""
        if self.split is not None:
            return [self.narrow(self.counts[0], self.tail_end, i) for i in range(self.split)]
        return [self.narrow(self.counts[0], self.tail_end)] if len(self.slot.shape) == 1 else None

    def read_source(self, indent: int) -> List[str]:
        """``src_<slot> = fb.<slot>``; getattr where the field may be absent or is a keyword."""
        name = self.slot.name
        pad = " " * indent
        if self.slot.skip_absent or self.slot.optional:
            read = assign(self.src, call("getattr", "fb", py_str(name), "None"), indent)
            if self.slot.skip_absent:  # absent_fields: skip: anything but a tensor is no copy
                read += [f"{pad}if not isinstance({self.src}, torch.Tensor):", f"{pad}    {self.src} = None"]
            return read
        if keyword.iskeyword(name):
            return assign(self.src, call("getattr", "fb", py_str(name)), indent)
        return assign(self.src, f"fb.{name}", indent)


def shape_src(extents: Sequence[str]) -> str:
    return "(" + ", ".join(extents) + ("," if len(extents) == 1 else "") + ")"
