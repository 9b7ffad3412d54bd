"""The typed model of a slot spec file (pydantic): only its *shape* (which keys, which kinds of
value); :mod:`.checks` relates keys to each other, so every problem in a file is reported at once."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any, Dict, Literal, Optional, Tuple, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt
from pydantic import model_validator

from .kinds import INDEX_SKIP, Axis, Padding, ResetTo, SlotKind
from .yaml_loader import Locations

AXES = Axis.values()
PADDINGS = Padding.values()
RESET_TO = ResetTo.values()
PARAM_TYPES = ("int", "float", "bool", "dtype", "str")

# Free text, not meaning: left out of a spec's canonical form (a param or preset *named*
# "description" is kept: only these keys of the spec, its params and its slots go).
NOT_MEANING = {"description": True, "params": {"__all__": {"description"}}, "slots": {"__all__": {"description"}}}

# Counts a spec may declare. Validation evaluates every preset against the params and
# the slots, so these keep it fast on hostile input; real specs use a few dozen.
MAX_PARAMS = 1024
MAX_PRESETS = 32
MAX_SLOTS = 4096

# The model keeps the declared strings as Literals (its JSON Schema inlines the choices, and a
# bad one is a `literal_error` the loader words); code compares them with the Axis/Padding enums.


def one_nan(value: Any) -> Any:
    """``value``, or for any NaN the one quiet NaN: YAML's ``.nan`` has its sign bit set, JSON's not,
    and a NaN must be the same bits in generated code and in the interpreter."""
    return math.nan if isinstance(value, float) and value != value else value


# A literal, or a string holding an expression over params (for str/dtype params a
# string default is the value itself).
Scalar = Union[StrictBool, StrictInt, Annotated[StrictFloat, AfterValidator(one_nan)], str]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FrozenDict(dict):
    """A spec's ``params`` and ``presets``: specs are shared (a process-wide cache), so they
    cannot change; a dict subclass, so pydantic dumps it as the dict it is."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a spec cannot be changed: derive one from spec.to_dict() with graphslot.spec_from_dict")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return (type(self), (dict(self),))


class ParamSpec(_Strict):
    type: Literal[PARAM_TYPES] = Field(description="Value type of the param.")  # type: ignore[valid-type]
    default: Scalar = Field(description="A literal, or an expression over other params (int/float/bool params).")
    description: str = ""
    runtime: StrictBool = Field(
        False,
        description="A numeric value generated code keeps as an argument instead of baking it in. "
        "Only pad values may use runtime params.",
    )
    live: StrictBool = Field(
        False,
        description="The value may be a provider (ctx) -> value given at build, evaluated when a hook reads "
        "ctx.params[name] during a fill. Only hooks may read live params.",
    )


class SlotSpec(_Strict, SlotKind):
    name: str = Field(
        description="The batch attribute the slot mirrors; a dotted name is a structured slot and needs `source`."
    )
    shape: Tuple[Union[StrictInt, str], ...] = Field(
        description="Extents: ints or expressions over max_bs, max_num_tokens and params; [] for a 0-d "
        "slot (axis none)."
    )
    dtype: str = Field(description="A torch dtype name (int64, bfloat16, …) or a dtype-typed param.")
    axis: Literal[AXES] = Field(  # type: ignore[valid-type]
        description="bs: sliced by batch size; tokens: by token count; none: never sliced."
    )
    slice_dim: StrictInt = Field(0, description="The dimension the axis slices.")
    device: Optional[Literal["cpu"]] = Field(
        None, description="Omitted: the registry's device. cpu: a host buffer (e.g. seq_lens_cpu)."
    )
    padding: Optional[Union[Literal[PADDINGS], str]] = Field(  # type: ignore[valid-type]
        None,
        description="How the padded tail is made safe: a policy, or a str param whose value is one; required for "
        "bs/tokens axes.",
    )
    pad_value: Optional[Scalar] = Field(
        None, description="Literal or expression; required by fill_sentinel and fill_once."
    )
    index: Union[Literal[INDEX_SKIP], StrictBool] = Field(  # type: ignore[valid-type]
        False,
        description="Values index the KV pool, request pool or rope table: true, padding must be zero (row 0 is "
        "reserved); skip, padding must be fill_sentinel with a negative pad_value (kernels skip those rows).",
    )
    optional: StrictBool = Field(
        False, description="The batch field may be None (or absent) on a step: the copy is then skipped."
    )
    enabled_if: Optional[Union[StrictBool, str]] = Field(
        None, description="Boolean expression over params; a disabled slot is not allocated."
    )
    copy_from_fb: StrictBool = Field(True, description="False for computed or reset-only slots.")
    post_fill: Optional[str] = Field(None, description="Hook (buffer, fb, ctx) run after the copies.")
    source: Optional[str] = Field(None, description="Hook (fb, ctx) -> tensor or None: the copy source.")
    pre_capture: Optional[str] = Field(None, description="Hook (buffer, ctx) run before graph capture.")
    adopt: Literal["allowed", "never"] = Field(
        "allowed", description="never: the registry owns the buffer; build_registry(buffers=<object>) never adopts it."
    )
    extra_rows: StrictInt = Field(
        0,
        description="Rows the head has beyond the step's count (cu_seqlens: 1): the sliced extent is the capacity "
        "plus extra_rows, a step's head [:raw + extra_rows], its view [:padded + extra_rows]. Axes bs and tokens.",
    )
    reset_to: Union[Literal[RESET_TO], str] = Field(  # type: ignore[valid-type]
        "padded",
        description="How far zero, fill_sentinel and repeat_last write the tail: padded (to the padded size) or "
        "capacity (to the end of the buffer); or a str param whose value is one.",
    )
    staged: StrictBool = Field(
        False,
        description="A host buffer (pinned on CUDA) that the fill writes, and a device buffer the graph reads: one "
        "non-blocking copy host to device per fill. Not with device: cpu.",
    )
    description: str = ""


class RegistrySpec(_Strict):
    """A whole spec file: one registry."""

    name: str
    description: str = ""
    params: Dict[str, ParamSpec] = Field(default_factory=dict)
    presets: Dict[str, Dict[str, Any]] = Field(default_factory=dict, description="Named param sets, e.g. `eager`.")
    absent_fields: Literal["error", "skip"] = Field(
        "error",
        description="error: a copied slot's batch field that is None or missing is a SlotError unless the slot is "
        "optional. skip: every slot copied from a batch field is optional (no copy, None carried).",
    )
    slots: Tuple[SlotSpec, ...] = Field(min_length=1)

    _source: str = PrivateAttr("<string>")
    _text: str = PrivateAttr("")
    _locations: Optional[Locations] = PrivateAttr(None)
    _identity: Optional[str] = PrivateAttr(None)
    _by_name: Optional[Tuple[Tuple[SlotSpec, ...], Dict[str, SlotSpec]]] = PrivateAttr(None)

    @model_validator(mode="after")
    def _freeze(self) -> "RegistrySpec":
        # Shared specs never change (slots and shapes are tuples): an identity computed once stays true.
        presets = {k: FrozenDict((n, one_nan(v)) for n, v in values.items()) for k, values in self.presets.items()}
        object.__setattr__(self, "params", FrozenDict(self.params))
        object.__setattr__(self, "presets", FrozenDict(presets))
        return self

    @property
    def path(self) -> str:
        """The file (or label) the spec was read from; errors name it."""
        return self._source

    @property
    def text(self) -> str:
        return self._text

    def canonical(self) -> dict[str, Any]:
        """The spec's meaning as plain data: every default filled in, every ``description`` dropped. Keys
        added after specs had identities leave it at their default, so old identities stay current."""
        data = _lists(self.model_dump(mode="python", exclude=NOT_MEANING))
        for kind, items in (("spec", [data]), ("param", data["params"].values()), ("slot", data["slots"])):
            for item in items:
                for key, default in UNUSED_DEFAULTS[kind].items():
                    if item.get(key) == default:
                        item.pop(key)
        return data

    def canonical_json(self) -> str:
        """:meth:`canonical` as one line of ASCII JSON, sorted keys: the same text for the same meaning."""
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)

    def to_dict(self) -> Dict[str, Any]:
        """The spec as plain data (defaults left out) for :func:`graphslot.spec_from_dict`."""
        return _lists(self.model_dump(mode="python", exclude_defaults=True))

    @property
    def identity(self) -> str:
        """The sha256 of :meth:`canonical_json`: a generated module's ``SPEC_IDENTITY``."""
        if self._identity is None:  # a spec never changes (frozen): computed once
            self._identity = hashlib.sha256(self.canonical_json().encode("ascii")).hexdigest()
        return self._identity

    @property
    def locations(self) -> Locations:
        return self._locations or Locations(self._source)

    def slot_spec(self, name: str) -> SlotSpec:
        if self._by_name is None or self._by_name[0] is not self.slots:  # made once (a copy's slots: again)
            # the first of a name, as a search finds
            self._by_name = (self.slots, {slot.name: slot for slot in reversed(self.slots)})
        return self._by_name[1][name]

    def slot_line(self, index: int, key: Optional[str] = None) -> Optional[int]:
        return self.locations.line(("slots", index) if key is None else ("slots", index, key))

    def param_line(self, name: str) -> Optional[int]:
        return self.locations.line(("params", name))


def _lists(data: Any) -> Any:
    """``model_dump``'s data with its tuples (slots, shapes) as lists: plain data."""
    if isinstance(data, dict):
        return {key: _lists(value) for key, value in data.items()}
    if isinstance(data, (tuple, list)):
        return [_lists(value) for value in data]
    return data


# Keys (and defaults) left out of the canonical form when unused: see canonical.
UNUSED_DEFAULTS = {
    "spec": {"absent_fields": "error"},
    "param": {"live": False},
    "slot": {"adopt": "allowed", "extra_rows": 0, "reset_to": "padded", "staged": False},
}

SLOT_KEYS = tuple(SlotSpec.model_fields)
PARAM_KEYS = tuple(ParamSpec.model_fields)
TOP_KEYS = tuple(RegistrySpec.model_fields)
