"""What a step's inputs must satisfy: one ``StepChecker`` per registry raises every per-step ``SlotError``, so the
interpreter and generated code raise the same ones (``graphslot/slot_specs/README.md``, "Slot semantics").
No field check reads the padded counts, so :meth:`StepChecker.sources` runs before they are known (the DP runner).
"""

from __future__ import annotations

import bisect
import itertools
from typing import AbstractSet, Any, Iterable, Iterator, Optional, Tuple

import torch

from ..spec.errors import SlotError, shorten
from ..spec.kinds import Axis

SIZE_MEMO_LIMIT = 4096  # sizes remembered; a server sees about one per captured size
_MISSING = object()


def describe(value: Any) -> str:
    """What came, in a few words (never a whole tensor)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)} on {value.device}"
    return f"{type(value).__name__} {shorten(value, 61)}"


class StepChecker:
    """The checks of one registry; built once, called per step or only on failure."""

    def __init__(self, spec_name: str, slots: Iterable[Any], max_bs: int, max_num_tokens: int, strict: bool):
        self.spec_name = spec_name
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.strict = strict
        self.slots = {slot.name: slot for slot in slots}  # enabled ``Slot`` objects with buffers
        self.plain = tuple(s for s in self.slots.values() if s.resolved.copy_from_fb and s.resolved.source is None)
        self._extents = extent_tables((s.name, b) for s in self.slots.values() for b in s.buffers())
        # what _once remembers
        self._seen_steps = {}
        self._seen_views = {}
        self._seen_raw = {}

    def without(self, names: AbstractSet[str]) -> "StepChecker":
        """The checker of a fill leaving the slots ``names`` alone; aliasing is still judged on every buffer."""
        other = StepChecker(self.spec_name, self.slots.values(), self.max_bs, self.max_num_tokens, self.strict)
        other.plain = tuple(s for s in self.plain if s.name not in names)
        return other

    def fail(self, slot: Optional[str], message: str) -> SlotError:
        where = f"spec '{self.spec_name}', slot '{slot}'" if slot else f"spec '{self.spec_name}'"
        return SlotError(f"{where}: {message}")

    def counts(self, raw_bs: Any, padded_bs: Any, raw_num_tokens: Any, padded_num_tokens: Any) -> None:
        """Raise unless ``0 <= raw <= padded <= capacity`` for both axes, all ints."""
        self._bounds(("raw", "padded"), (raw_bs, padded_bs), (raw_num_tokens, padded_num_tokens))

    def view_counts(self, padded_bs: Any, padded_num_tokens: Any) -> None:
        """``extract``'s counts: ints within ``0 <= padded <= capacity``."""
        self.counts(0, padded_bs, 0, padded_num_tokens)

    def _bounds(self, names: Tuple[str, ...], bs: tuple, tokens: tuple) -> None:
        """Raise unless each axis's counts (named ``names``) are ints, ascending from 0 up to its capacity."""
        for axis, counts, capacity in ((Axis.BS, bs, self.max_bs), (Axis.TOKENS, tokens, self.max_num_tokens)):
            if type(counts[0]) is not int or type(counts[-1]) is not int:  # raw and padded (or raw alone)
                what, n = next((what, n) for what, n in zip(names, counts) if type(n) is not int)
                raise self.fail(None, f"{what} {axis} count must be an int, got {describe(n)}")
            if not 0 <= counts[0] <= counts[-1] <= capacity:
                got = ", ".join(f"{what}={n}" for what, n in zip(names + ("capacity",), counts + (capacity,)))
                raise self.fail(None, f"{axis} counts must satisfy 0 <= {' <= '.join(names)} <= capacity, got {got}")

    def sources(self, fb: Any, raw_bs: Any, raw_num_tokens: Any) -> None:
        """Raise the SlotError a fill of ``fb`` at these raw counts would raise for them or a batch field, whatever
        its padded counts; write nothing, run no source hook (``SlotRegistry.check_step``)."""
        shapes = self._once(self._seen_raw, (raw_bs, raw_num_tokens), self._raw_shapes)  # as generated fills
        for slot, shape in shapes:
            src = getattr(fb, slot.name, None)
            if self.strict or not (isinstance(src, torch.Tensor) and src.shape == shape):
                self.plain_source(slot, fb, raw_bs, raw_num_tokens)  # None for an absent optional field, else raises

    def step(self, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens) -> Tuple[int, int, int, int]:
        """The interpreter's count check, once per step size as generated plans'; the sizes as checked."""
        key = (raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
        return self._once(self._seen_steps, key, lambda *k: self.counts(*k) or k)

    def view(self, padded_bs, padded_num_tokens) -> Tuple[int, int]:
        return self._once(self._seen_views, (padded_bs, padded_num_tokens), lambda *k: self.view_counts(*k) or k)

    def _raw_shapes(self, raw_bs: Any, raw_num_tokens: Any) -> tuple:
        self._bounds(("raw",), (raw_bs,), (raw_num_tokens,))
        return tuple((slot, self.expected_shape(slot, raw_bs, raw_num_tokens)) for slot in self.plain)

    def _once(self, seen: dict, key: tuple, make) -> Any:
        """``make(*key)``, remembered per key (strict mode: made on every call)."""
        value = None if self.strict else seen.get(key)
        if value is None:
            if len(seen) >= SIZE_MEMO_LIMIT:
                seen.clear()
            value = seen[key] = make(*key)
        return value

    def expected_shape(self, slot, raw_bs: int, raw_num_tokens: int) -> Tuple[int, ...]:
        shape = list(slot.buffer.shape)
        count = slot.count(raw_bs, raw_num_tokens)
        if count is not None:
            shape[slot.resolved.slice_dim] = count
        return torch.Size(shape)

    def plain_source(self, slot, fb: Any, raw_bs: int, raw_num_tokens: int) -> Optional[torch.Tensor]:
        """The batch field to copy into ``slot``'s head, ``None`` for an absent optional one; else raise."""
        src = getattr(fb, slot.name, _MISSING)
        if slot.resolved.skip_absent and not isinstance(src, torch.Tensor):
            return None  # absent_fields: skip: a missing, None or non-tensor field is no copy
        if src is _MISSING or src is None:
            if slot.resolved.optional:
                return None
            what = f"the batch has no field '{slot.name}'" if src is _MISSING else "the batch field is None"
            fix = "set it on the batch, or declare `optional: true` in the spec"
            raise self.fail(slot.name, f"{what}, but the slot is not optional; {fix}")
        self._tensor(slot, src)
        expected = self.expected_shape(slot, raw_bs, raw_num_tokens)
        if src.shape != expected:
            got = f"got {list(src.shape)} (copy_ would broadcast or fail)"
            raise self.fail(slot.name, f"expected shape {list(expected)}, {got}")
        if self.strict:
            self._strict(slot, src, head=slot.head(slot.count(raw_bs, raw_num_tokens)))
        return src

    def hook_source(self, name: str, src: Any) -> Optional[torch.Tensor]:
        """A ``source`` hook's result: ``None`` (no copy) or a tensor that fits."""
        if src is None:
            return None
        slot = self.slots[name]
        self._tensor(slot, src)
        shape = list(slot.buffer.shape)
        d = slot.resolved.slice_dim
        if src.dim() == len(shape) and shape:  # a 0-d slot takes a 0-d source
            if src.shape[d] > shape[d]:
                raise self.fail(name, f"source returned {src.shape[d]} rows, more than the capacity {shape[d]}")
            shape[d] = src.shape[d]
        if list(src.shape) != shape:
            raise self.fail(name, f"expected shape {shape}, got {list(src.shape)} (copy_ would broadcast or fail)")
        if self.strict:
            self._strict(slot, src, head=slot.head(src.shape[d] if shape else None))
        return src

    def diagnose(
        self, fb: Any, raw_bs: int, raw_num_tokens: int, exc: BaseException, skip: AbstractSet[str] = frozenset()
    ) -> None:
        """A failed fill's except branch: the interpreter's SlotError, else the SlotError naming a source that
        aliases a slot buffer (what strict mode refuses; a copy torch refuses for overlap names no slot), else
        ``exc``. ``skip``: slots the fill left alone."""
        sources = []  # each field read once: every field's own check comes before any aliasing
        for slot in self.plain:
            if slot.name not in skip:
                try:
                    sources.append((slot, self.plain_source(slot, fb, raw_bs, raw_num_tokens)))
                except SlotError as error:
                    raise error from exc
        for slot, src in sources:
            error = None if src is None else self._aliasing(slot, src, slot.head(slot.count(raw_bs, raw_num_tokens)))
            if error is not None:
                raise error from exc
        raise exc

    def strict_fill(self, fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens) -> None:
        """Strict mode's check before generated code runs (hook sources are checked where evaluated)."""
        self.counts(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
        for slot in self.plain:
            self.plain_source(slot, fb, raw_bs, raw_num_tokens)

    def _tensor(self, slot, src: Any) -> None:
        if not isinstance(src, torch.Tensor):
            raise self.fail(slot.name, f"expected a torch.Tensor, got {describe(src)}")

    def _strict(self, slot, src: torch.Tensor, head: torch.Tensor) -> None:
        buffer = slot.filled  # a staged slot's sources are copied into its host buffer
        if src.dtype != buffer.dtype:
            raise self.fail(slot.name, f"expected dtype {buffer.dtype}, got {src.dtype} (copy_ would cast silently)")
        if src.device != buffer.device:
            raise self.fail(slot.name, f"expected device {buffer.device}, got {src.device}")
        error = self._aliasing(slot, src, head)
        if error is not None:
            raise error

    def _aliasing(self, slot, src: torch.Tensor, head: torch.Tensor) -> Optional[SlotError]:
        """The SlotError of a source overlapping a slot buffer other than exactly its own head, or None."""
        if (src.data_ptr(), src.shape, src.stride()) == (head.data_ptr(), head.shape, head.stride()):
            return None  # exactly its own head, however it was made: copies onto itself
        starts, reach = self._extents.get(src.device, ((), ()))
        start, end = byte_extent(src)
        i = bisect.bisect_left(starts, end)  # the buffers starting before the source's end
        if end > start and i and reach[i - 1][0] > start:
            view = "(a view of a static buffer other than this slot's own head)"
            fix = "copy it first, or pass the batch's own tensor"
            return self.fail(slot.name, f"the source aliases the buffer of slot '{reach[i - 1][1]}' {view}; {fix}")
        return None


def byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """``[first, end)``: the addresses of the bytes ``t``'s elements span (``(0, 0)`` when none), from its own
    pointer, sizes and strides (so a DLPack, numpy or ``as_strided`` view is placed where its bytes are)."""
    if t.numel() == 0:
        return 0, 0
    spans = [(size - 1) * stride for size, stride in zip(t.shape, t.stride())]
    low = sum(d for d in spans if d < 0)
    high = sum(d for d in spans if d > 0)
    start = t.data_ptr()
    item = t.element_size()
    return start + low * item, start + (high + 1) * item


def sorted_extents(buffers: Iterable[Tuple[str, torch.Tensor]]) -> dict:
    """Per device, the buffers' non-empty byte extents as ``(start, end, name)``, in address order (ties in the
    order given)."""
    by_device: dict = {}
    for name, buffer in buffers:
        start, end = byte_extent(buffer)
        if end > start:
            by_device.setdefault(buffer.device, []).append((start, end, name))
    for extents in by_device.values():
        extents.sort(key=lambda extent: extent[:2])
    return by_device


def extent_tables(buffers: Iterable[Tuple[str, torch.Tensor]]) -> dict:
    """Per device, the buffers' byte extents as ``(starts, reach)``: starts sorted, and with each the farthest
    ``(end, name)`` so far, so which buffer a tensor's bytes overlap is one bisection."""
    tables = {}
    for device, extents in sorted_extents(buffers).items():
        reach = list(itertools.accumulate(((end, name) for _, end, name in extents), max))
        tables[device] = ([start for start, _, _ in extents], reach)
    return tables


#: Past this many elements in two tensors whose spans cross, the bytes their spans share stand for the bytes
#: their elements share (counting those takes memory in proportion to the elements).
EXACT_ELEMENTS = 1 << 20


def covered_bytes(t: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """The addresses in ``[low, high)`` of the bytes ``t``'s elements cover (int64, unique)."""
    starts = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        starts = starts.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    item = t.element_size()
    covered = (starts.reshape(-1, 1) * item + (t.data_ptr() + torch.arange(item, dtype=torch.int64))).reshape(-1)
    return covered[(covered >= low) & (covered < high)].unique()


def shared_bytes(a: torch.Tensor, b: torch.Tensor, low: int, high: int) -> int:
    """How many bytes both ``a``'s and ``b``'s elements cover, their spans crossing on ``[low, high)``: two
    interleaved strided views (the columns of one tensor) share none."""
    if a.numel() + b.numel() > EXACT_ELEMENTS:
        return high - low
    return int(torch.isin(covered_bytes(a, low, high), covered_bytes(b, low, high)).sum())


def overlaps(buffers: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, str, int]]:
    """Every two of ``buffers`` on one device whose elements share bytes: the one earlier in address order, the
    other and how many bytes they share. Meta tensors have no memory to share: left out."""
    tensors = dict(buffers)
    for device, extents in sorted_extents(tensors.items()).items():
        if device.type == "meta":
            continue
        for index, (_, end, owner) in enumerate(extents):
            for start, other_end, name in itertools.takewhile(lambda e: e[0] < end, extents[index + 1 :]):
                shared = shared_bytes(tensors[owner], tensors[name], start, min(end, other_end))
                if shared:
                    yield owner, name, shared
