"""The spec's closed vocabularies, defined once: a slot's axis, its padding policy, and what
kind of slot it is. ``Axis`` and ``Padding`` are ``str`` enums (``Axis.BS == "bs"``, hashes,
prints and dumps as ``"bs"``): code comparing plain strings keeps working. Torch-free."""

from __future__ import annotations

from enum import Enum
from typing import Optional, Tuple


class _StrEnum(str, Enum):
    """Prints, formats and reprs as its value on every Python (3.10 has no ``enum.StrEnum``, 3.11
    formats a mixed-in member as ``Class.NAME``): generated source sees the string."""

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__

    @classmethod
    def values(cls) -> Tuple[str, ...]:
        return tuple(member.value for member in cls)


class Axis(_StrEnum):
    """What a slot's sliced dimension counts: requests, tokens, or nothing (never sliced)."""

    BS = "bs"
    TOKENS = "tokens"
    NONE = "none"

    @property
    def capacity(self) -> Optional[str]:
        """The capacity the sliced extent must be: ``max_bs``, ``max_num_tokens``, None."""
        return _CAPACITY[self]

    @property
    def counts(self) -> Optional[Tuple[str, str]]:
        """The names of a step's raw and padded counts along this axis (None: unsliced)."""
        return _COUNTS[self]

    @property
    def sliced(self) -> bool:
        return self is not Axis.NONE

    def select(self, bs: int, num_tokens: int) -> Optional[int]:
        """The rows of the sliced dimension a step uses (None: the whole buffer)."""
        return bs if self is Axis.BS else num_tokens if self is Axis.TOKENS else None


_CAPACITY = {Axis.BS: "max_bs", Axis.TOKENS: "max_num_tokens", Axis.NONE: None}
_COUNTS = {Axis.BS: ("raw_bs", "padded_bs"), Axis.TOKENS: ("raw_num_tokens", "padded_num_tokens"), Axis.NONE: None}
#: The capacities a shape may name: ``("max_bs", "max_num_tokens")``.
CAPACITY_NAMES: Tuple[str, ...] = tuple(c for c in _CAPACITY.values() if c is not None)


class Padding(_StrEnum):
    """How the padded tail ``[raw:padded]`` of a sliced slot is made safe."""

    ZERO = "zero"
    FILL_SENTINEL = "fill_sentinel"
    KEEP_PAD = "keep_pad"
    FOREACH_COPY = "foreach_copy"
    FILL_ONCE = "fill_once"
    REPEAT_LAST = "repeat_last"

    @property
    def resets_tail(self) -> bool:
        """Every fill resets the tail to a value (zeros or the pad value), with the heads (step 2 of the fill)."""
        return self in (Padding.ZERO, Padding.FILL_SENTINEL)

    @property
    def writes_tail(self) -> bool:
        """Every fill writes the tail: a reset, or ``repeat_last`` (the head's last row, after every hook)."""
        return self.resets_tail or self is Padding.REPEAT_LAST

    @property
    def needs_pad_value(self) -> bool:
        """Takes a ``pad_value``, written at allocation (and by fill_sentinel each fill)."""
        return self in (Padding.FILL_SENTINEL, Padding.FILL_ONCE)

    @classmethod
    def of(cls, declared: Optional[str]) -> "Padding":
        """A declared policy, or the default (keep_pad) when none is declared."""
        return cls.KEEP_PAD if declared is None else cls(declared)


class ResetTo(_StrEnum):
    """How far a tail-writing policy writes: to the padded size, or to the end of the buffer."""

    PADDED = "padded"
    CAPACITY = "capacity"


#: ``index: skip``: an index slot whose kernels skip rows holding a negative sentinel (vLLM's PAD_SLOT_ID).
INDEX_SKIP = "skip"


class SlotKind:
    """What kind of slot this is, for ``SlotSpec`` and ``ResolvedSlot`` alike."""

    __slots__ = ()

    @property
    def structured(self) -> bool:
        """A dotted name (``spec_info.ids``): read through a ``source`` hook, never set on a view."""
        return "." in self.name  # type: ignore[attr-defined]

    @property
    def computed(self) -> bool:
        """Written by a hook or reset only, not copied from the batch field."""
        return self.post_fill is not None or not self.copy_from_fb  # type: ignore[attr-defined]

    is_structured = structured  # the spelling SlotSpec had
