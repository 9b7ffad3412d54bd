"""Generated code is the interpreter, bit for bit.

The interpreted registry (``mode="interpreted"``) is the executable definition of the
slot semantics (graphslot/slot_specs/README.md, "Slot semantics"); the generated ``fill_from`` / ``extract``
are an optimisation of it and must be indistinguishable from it. These tests build the
same spec in both modes, feed both the same batches, and require:

* bit-identical buffers after allocation and after every fill, whatever the buffers
  held before (they are poisoned with random values, the same in both); bit for bit, so
  NaN pad values compare equal and -0.0 differs from 0.0;
* ``extract`` views with the same attributes, the same tensors (values, shape, dtype),
  each a view of its own registry's buffer, the same non-tensor values, and
  ``batch_size`` set to the padded size;
* the template batch left exactly as it was;
* for a batch the contract rejects (a required field None, missing or not a tensor, a
  field of another row count, a 0-d value, an impossible step size; in strict mode
  another dtype or a source aliasing a buffer), the same error in both modes — same
  class, same message — and, for a ``SlotError``, untouched buffers. Batches may also
  pass a slot's own buffer back (its head view, or rows overlapping it), strict or not.

The specs are random *valid* spec files (hypothesis), covering every padding policy,
every axis, bool/int/float dtypes, ``slice_dim: 1`` with a leading extent, trailing
dimensions, host (``device: cpu``) slots, optional fields, computed slots, ``source``
hooks on dotted and plain names, index slots, runtime params used as pad values and a
bool param gating slots through ``enabled_if``; plus the shipped decode and prefill
specs with the param sets engines use.
"""

from __future__ import annotations

import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import graphslot as gs
from graphslot.api import build

# --- what a random spec is made of -------------------------------------------------------

DTYPES = ["bool", "int32", "int64", "float32", "bfloat16", "dt"]  # dt: a dtype param
INT_DTYPES = ("int32", "int64", "dt")
FLOAT_DTYPES = ("float32", "bfloat16")

# Plain slot names, several of which are names the generated code itself uses
# (locals, arguments, module globals) or a Python keyword, and names whose generated
# identifiers could collide ('a.b' and 'a__b' both mangle to a__b).
PLAIN_NAMES = [
    "input_ids", "positions", "seq_lens", "x", "x_1", "fb", "ctx", "src", "srcs", "dsts", "plan",
    "view", "entry", "torch", "params", "device", "hooks", "buffers", "plans", "views", "raw_bs",
    "padded_num_tokens", "side_inputs", "class", "lambda", "None", "a__b", "a__b_1", "a__b_2",
    "len",
]
# Dotted (structured) names; their heads ('a', 'outer') are never plain slot names.
DOTTED_NAMES = ["a.b", "a.b_1", "outer.inner", "outer.deep.leaf"]

# Names for the runtime (pad-value) params: ordinary ones, and ones that are also
# names the generated module binds (arguments, locals, builtins it calls).
RUNTIME_NAMES = [
    "fill", "sentinel", "device", "torch", "params", "hooks", "buffers", "pool", "source", "plans",
    "len", "max", "rt_device", "pad0_int64", "buf_x",
]

# The policies the str param `pol` names (a slot's `padding: pol`): those that take no pad value.
STR_POLICIES = ["zero", "keep_pad", "foreach_copy", "repeat_last"]

# How a slot's head gets its value each step.
FEEDS = [
    "plain",          # copied from the same-named batch field
    "optional",       # idem, and the field may be None / absent / not a tensor
    "user_source",    # a user `source` hook (plain name)
    "dotted_source",  # the built-in dotted_field source on a plain name
    "computed",       # copy_from_fb: false, reset only
    "computed_hook",  # copy_from_fb: false + a post_fill hook
    "copied_hook",    # copied, then a post_fill hook (like num_token_non_padded)
]


@dataclass
class SlotPlan:
    name: str
    feed: str
    doc: Dict[str, Any]  # the slot's YAML mapping


@dataclass
class Step:
    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    seed: int
    poison: bool
    presence: Dict[str, str]  # slot name -> tensor | cast | none | absent | other
    rows: Dict[str, int]      # slot name -> rows a source returns (taken modulo extent + 1)
    bias: int                 # side_inputs["bias"], seen by the post_fill hook
    plain_class: bool         # a plain class or a SimpleNamespace batch
    skip: frozenset = frozenset()  # slots this fill leaves alone (fill_from_skipping)


@dataclass
class Case:
    text: str
    slots: List[SlotPlan]
    params: Dict[str, Any]
    runtime: List[str]
    max_bs: int
    max_num_tokens: int
    strict: bool = False
    steps: List[Step] = field(default_factory=list)
    own_context: bool = False  # build_registry(context=OwnContext.make): an engine's own context type


def _pad_value(draw, dtype: str, runtime: List[str]):
    rt = draw(st.sampled_from(runtime))
    if dtype == "bool":
        return draw(st.sampled_from([True, False, "flag", "not flag"]))
    if dtype in INT_DTYPES:
        return draw(st.one_of(
            st.integers(-3, 50),
            st.sampled_from([rt, f"{rt} + 1", f"max({rt}, 2)", f"{rt} if flag else 7", "width * 3",
                             f"{rt} - 70", f"{rt} // 2"]),
        ))
    return draw(st.one_of(
        st.sampled_from([-2.5, 0.5, 1.25, 3.0, 0.1, -1e-3, 3.3, float("-inf"), float("inf"), float("nan"), -0.0]),
        st.integers(-3, 50),
        st.sampled_from([rt, f"{rt} + 0.5", f"{rt} % 7", f"{rt} * 0.1"]),
    ))


def _extent(draw):
    return draw(st.sampled_from([1, 2, 3, "width", "width + 1"]))


@st.composite
def slot_plans(draw, name: str, runtime: List[str]) -> SlotPlan:
    structured = "." in name
    axis = draw(st.sampled_from(["bs", "tokens", "none"]))
    dtype = draw(st.sampled_from(DTYPES))
    doc: Dict[str, Any] = {"name": name}

    if axis == "none":
        shape = [_extent(draw) for _ in range(draw(st.integers(0, 2)))]  # [] : a 0-d slot
        slice_dim = draw(st.integers(0, max(len(shape) - 1, 0)))
        padding = draw(st.sampled_from([None, "keep_pad", "foreach_copy", "fill_once"]))
    else:
        capacity = "max_bs" if axis == "bs" else "max_num_tokens"
        layout = draw(st.sampled_from(["1d", "1d", "trailing", "leading", "leading_trailing"]))
        lead = [draw(st.sampled_from([1, 2, 3, "width"]))] if layout.startswith("leading") else []
        trail = [_extent(draw) for _ in range(draw(st.integers(1, 2)))] if layout.endswith("trailing") else []
        extra = draw(st.sampled_from([0, 0, 0, 1, 2]))  # extra_rows: a head of raw + extra rows
        shape = lead + [f"{capacity} + {extra}" if extra else capacity] + trail
        if extra:
            doc["extra_rows"] = extra
        slice_dim = len(lead)
        padding = draw(st.sampled_from(["zero", "fill_sentinel", "keep_pad", "foreach_copy", "fill_once",
                                        "repeat_last", "pol"]))  # pol: a str param naming the policy
    doc.update(shape=shape, dtype=dtype, axis=axis)
    if slice_dim:
        doc["slice_dim"] = slice_dim
    if padding is not None:
        doc["padding"] = padding
    if padding == "zero" and draw(st.booleans()):
        doc["index"] = True
    if padding == "repeat_last" and doc.get("extra_rows") and draw(st.booleans()):
        doc["index"] = True  # cu_seqlens-style offsets: allowed with extra rows
    if padding in ("fill_sentinel", "fill_once"):
        doc["pad_value"] = _pad_value(draw, dtype, runtime)
    if padding == "fill_sentinel" and dtype in INT_DTYPES and draw(st.integers(0, 2)) == 0:
        doc["index"] = "skip"  # a negative sentinel: a literal, or one a runtime param makes
        doc["pad_value"] = draw(st.sampled_from([-1, -7, f"-1 - {draw(st.sampled_from(runtime))}"]))
    if padding in ("zero", "fill_sentinel", "repeat_last"):
        reset_to = draw(st.sampled_from([None, None, "padded", "capacity", "reset"]))  # reset: a str param
        if reset_to is not None:
            doc["reset_to"] = reset_to
    if draw(st.integers(0, 4)) == 0:
        doc["device"] = "cpu"
    elif draw(st.integers(0, 3)) == 0:
        doc["staged"] = True
    enabled_if = draw(st.sampled_from([None, None, None, True, False, "flag", "not flag", "width > 1"]))
    if enabled_if is not None:
        doc["enabled_if"] = enabled_if

    if structured:
        feed = "structured"
        doc["source"] = draw(st.sampled_from(["dotted_field", "dotted_field", f"feed_{name}"]))
        if draw(st.booleans()):
            doc["post_fill"] = "stamp"
    else:
        feed = draw(st.sampled_from(FEEDS))
        if feed == "optional" or (feed in ("computed", "computed_hook", "copied_hook") and draw(st.booleans())):
            doc["optional"] = True
        if feed == "user_source":
            doc["source"] = f"feed_{name}"
        elif feed == "dotted_source":
            doc["source"] = "dotted_field"
        elif feed in ("computed", "computed_hook"):
            doc["copy_from_fb"] = False
        if feed in ("computed_hook", "copied_hook"):
            doc["post_fill"] = "stamp"
        if feed in ("user_source", "dotted_source") and draw(st.booleans()):
            doc["optional"] = True  # meaningless for a source slot, but allowed
    return SlotPlan(name, feed, doc)


@st.composite
def cases(draw) -> Case:
    runtime = draw(st.lists(st.sampled_from(RUNTIME_NAMES), min_size=1, max_size=2, unique=True))
    names = draw(st.lists(st.sampled_from(PLAIN_NAMES + DOTTED_NAMES), min_size=1, max_size=6, unique=True))
    slots = [draw(slot_plans(name, runtime)) for name in names]
    params_doc: Dict[str, Any] = {
        "flag": {"type": "bool", "default": draw(st.booleans())},
        "width": {"type": "int", "default": 2},
        "dt": {"type": "dtype", "default": "int32"},
        "lv": {"type": "int", "default": 3, "live": True},  # read by the stamp hook
        "pol": {"type": "str", "default": draw(st.sampled_from(STR_POLICIES))},  # padding: pol
        "reset": {"type": "str", "default": draw(st.sampled_from(["padded", "capacity"]))},  # reset_to: reset
    }
    for name in runtime:
        params_doc[name] = {"type": "int", "default": draw(st.integers(0, 60)), "runtime": True}
    doc = {"name": "random", "params": params_doc, "slots": [s.doc for s in slots]}
    if draw(st.integers(0, 2)) == 0:
        doc["absent_fields"] = "skip"
    text = yaml.safe_dump(doc, sort_keys=False)

    params: Dict[str, Any] = {}
    if draw(st.booleans()):
        params["flag"] = draw(st.booleans())
    if draw(st.booleans()):
        params["width"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        params["dt"] = draw(st.sampled_from(["int32", "int64"]))
    for name in runtime:
        if draw(st.booleans()):
            params[name] = draw(st.integers(0, 60))
    if draw(st.booleans()):
        params["pol"] = draw(st.sampled_from(STR_POLICIES))
    if draw(st.booleans()):
        params["reset"] = draw(st.sampled_from(["padded", "capacity"]))
    lv = draw(st.sampled_from([None, 5, "provider"]))
    if lv is not None:
        params["lv"] = live_provider if lv == "provider" else lv

    max_bs = draw(st.integers(1, 16))
    max_num_tokens = draw(st.integers(1, 32))
    case = Case(text, slots, params, runtime, max_bs, max_num_tokens, strict=draw(st.integers(0, 3)) == 0,
                own_context=draw(st.integers(0, 3)) == 0)
    for i in range(draw(st.integers(1, 4))):
        if i and draw(st.integers(0, 3)) == 0:  # the same sizes again: cached plans and views
            last = case.steps[-1]
            raw_bs, padded_bs, raw_nt, padded_nt = (last.raw_bs, last.padded_bs, last.raw_num_tokens,
                                                    last.padded_num_tokens)
        else:
            padded_bs = draw(st.integers(0, max_bs))
            padded_nt = draw(st.integers(0, max_num_tokens))
            raw_bs, raw_nt = draw(st.integers(0, padded_bs)), draw(st.integers(0, padded_nt))
            if draw(st.integers(0, 15)) == 0:  # an impossible step size: an error in both modes
                raw_bs, padded_bs, raw_nt, padded_nt = draw(st.sampled_from([
                    (padded_bs + 1, padded_bs, raw_nt, padded_nt), (raw_bs, max_bs + 1, raw_nt, padded_nt),
                    (raw_bs, padded_bs, -1, padded_nt), (raw_bs, padded_bs, raw_nt, max_num_tokens + 2)]))
        case.steps.append(Step(
            raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_nt, padded_num_tokens=padded_nt,
            seed=draw(st.integers(0, 2**31 - 1)),
            poison=draw(st.booleans()),
            presence={s.name: draw(st.sampled_from(PRESENCE)) for s in slots},
            rows={s.name: draw(st.integers(0, 64)) for s in slots},
            bias=draw(st.integers(0, 9)),
            plain_class=draw(st.booleans()),
            skip=frozenset(draw(st.lists(st.sampled_from(names), max_size=2))) if draw(st.integers(0, 3)) == 0
            else frozenset(),
        ))
    return case


# What a step's batch holds for a slot: mostly a good tensor, else something the
# contract skips (an optional None) or rejects, or a view of the slot's own buffer.
PRESENCE = (["tensor"] * 8 + ["cast", "none", "absent", "other", "one_row", "zero_d"]
            + ["own_head", "own_shifted"] * 2)


# --- hooks: deterministic functions of their inputs ---------------------------------------


def stamp(buffer, fb, ctx):
    """A computed slot: the step's sizes, the side input and the params, into the first
    and last element (the rest keeps what the copy and the reset left)."""
    flat = buffer.view(-1)
    runtime = sum(v for v in ctx.params.values() if type(v) is int)
    flat[0] = ctx.raw_bs + ctx.padded_num_tokens + ctx.side_inputs["bias"]
    flat[-1] = (ctx.raw_num_tokens * 3 + ctx.padded_bs + runtime) % 97


@dataclass
class OwnContext:
    """An engine's fill context: mutable, its own field order (sglang's FillContext)."""

    padded_num_tokens: int
    raw_num_tokens: int
    padded_bs: int
    raw_bs: int
    side_inputs: Any = None
    params: Any = None

    @classmethod
    def make(cls, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, params, side_inputs):
        return cls(padded_num_tokens, raw_num_tokens, padded_bs, raw_bs, side_inputs, params)


def live_provider(ctx):
    """The live param ``lv``: evaluated when the stamp hook reads it, from the step."""
    return ctx.raw_bs * 5 + ctx.padded_num_tokens


def _feed_hook(name: str):
    def source(fb, ctx):
        feeds = getattr(fb, "feeds", None) or {}
        return feeds.get(name)

    return source


def user_hooks(names) -> Dict[str, Any]:
    hooks = {f"feed_{n}": _feed_hook(n) for n in names}
    hooks["stamp"] = stamp
    return hooks


# --- batches --------------------------------------------------------------------------------


class Batch:
    """A plain batch class (``extract`` copies it field by field)."""


def random_tensor(shape, dtype: torch.dtype, g: torch.Generator, scale: int = 1000,
                  device: Any = "cpu") -> torch.Tensor:
    shape = tuple(shape)
    if dtype == torch.bool:
        out = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point:
        out = ((torch.rand(shape, generator=g) - 0.5) * 2 * scale).to(dtype)  # finite: no NaN
    else:
        out = torch.randint(-scale, scale, shape, generator=g, dtype=torch.int64).to(dtype)
    return out.to(device)


# A source of another dtype (copy_ casts it: not what strict mode allows, but what both
# modes must then do alike).
CAST_TO = {torch.bool: torch.int64, torch.int32: torch.float32, torch.int64: torch.int32,
           torch.float32: torch.bfloat16, torch.bfloat16: torch.float32}


def _set_path(root, dotted: str, value) -> None:
    parts = dotted.split(".")
    obj = root
    for part in parts[:-1]:
        nxt = getattr(obj, part, None)
        if nxt is None:
            nxt = types.SimpleNamespace()
            setattr(obj, part, nxt)
        obj = nxt
    setattr(obj, parts[-1], value)


def make_batch(reg: gs.SlotRegistry, step: Step) -> Any:
    """A batch for ``step`` shaped after ``reg``'s slots: every copied field holds
    ``raw`` rows along its sliced dimension, sources return their drawn row count."""
    g = torch.Generator().manual_seed(step.seed)
    fb = Batch() if step.plain_class else types.SimpleNamespace()
    fb.batch_size = step.raw_bs
    fb.feeds = {}
    fb.unrelated = "kept as is"
    for slot in reg.all_slots():
        spec = slot.resolved
        presence = step.presence.get(spec.name, "tensor")
        full = list(spec.shape)
        device = slot.filled.device if slot.buffer is not None else "cpu"
        dtype = CAST_TO[spec.dtype] if presence == "cast" else spec.dtype
        if spec.source is not None:
            if full:  # a 0-d slot's source is 0-d
                extent = full[spec.slice_dim]
                full[spec.slice_dim] = step.rows.get(spec.name, extent) % (extent + 1)
            if presence == "absent":
                continue
            if presence == "none":
                value = None
            elif presence == "other":
                value = [1, 2]  # not a tensor: no copy
            else:
                value = random_tensor(full, dtype, g, device=device)
            if spec.source == "dotted_field":
                _set_path(fb, spec.name, value)
            else:
                fb.feeds[spec.name] = value
            continue
        if not spec.copy_from_fb:
            # not read by fill_from; extract must expose the buffer instead
            if presence != "absent":
                setattr(fb, spec.name, random_tensor([2], spec.dtype, g, device=device))
            continue
        count = slot.count(step.raw_bs, step.raw_num_tokens)
        if count is not None:
            full[spec.slice_dim] = max(count, 0)  # an impossible size is rejected before the batch is read
        value = random_tensor(full, dtype, g, device=device)
        if not full:  # a 0-d slot: its value is 0-d, its own head the whole buffer
            if presence == "one_row":
                value = random_tensor([1], dtype, g, device=device)
            elif presence.startswith("own_") and slot.buffer is not None:
                value = slot.filled
            presence = presence if presence in ("none", "other", "absent") else "tensor"
        capacity = full[spec.slice_dim] if count is None and full else None if count is None else (
            slot.resolved.shape[spec.slice_dim])
        if presence == "none":
            value = None
        elif presence == "other":
            value = "not a tensor"
        elif presence == "one_row":  # copy_ would broadcast it into every row
            full[spec.slice_dim] = 2 if full[spec.slice_dim] == 1 else 1
            value = random_tensor(full, dtype, g, device=device)
        elif presence == "zero_d":
            value = random_tensor([], dtype, g, device=device)
        elif presence in ("own_head", "own_shifted") and slot.buffer is not None and full[spec.slice_dim] <= capacity:
            rows = full[spec.slice_dim]
            start = 1 if presence == "own_shifted" and rows + 1 <= capacity else 0
            value = slot.filled.narrow(spec.slice_dim, start, rows)
        if presence != "absent":
            setattr(fb, spec.name, value)
    return fb


# --- comparisons ----------------------------------------------------------------------------


def snapshot(obj, depth: int = 0) -> Dict[str, Any]:
    """Every attribute of a batch (and of its nested namespaces), tensors by value."""
    out = {}
    for key, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            out[key] = ("tensor", id(value), value.clone())
        elif isinstance(value, types.SimpleNamespace) and depth < 4:
            out[key] = ("ns", id(value), snapshot(value, depth + 1))
        elif isinstance(value, dict):
            out[key] = ("dict", id(value), {k: (id(v), v.clone() if isinstance(v, torch.Tensor) else v)
                                            for k, v in value.items()})
        else:
            out[key] = ("value", id(value), value)
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bits: NaN equals NaN, -0.0 is not 0.0 (torch.equal
    says neither)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.dtype.is_floating_point:
        a, b = (t.contiguous().view(_BITS[t.element_size()]) for t in (a, b))
    return torch.equal(a, b)


def assert_same_snapshot(before, after, where="batch", views=()) -> None:
    """``views``: fields that view a registry buffer (a fill writes through them)."""
    assert before.keys() == after.keys(), f"{where}: attributes changed"
    for key, (kind, ident, value) in before.items():
        if key in views:
            continue
        kind2, ident2, value2 = after[key]
        assert (kind, ident) == (kind2, ident2), f"{where}.{key} was replaced"
        if kind == "tensor":
            assert same_bits(value, value2), f"{where}.{key} was written to"
        elif kind == "ns":
            assert_same_snapshot(value, value2, f"{where}.{key}")
        elif kind == "dict":
            assert value.keys() == value2.keys()
            for k in value:
                assert value[k][0] == value2[k][0]
                if isinstance(value[k][1], torch.Tensor):
                    assert same_bits(value[k][1], value2[k][1]), f"{where}.{key}[{k}] was written to"


def assert_same_buffers(interp: gs.SlotRegistry, gen: gs.SlotRegistry, when: str) -> None:
    assert interp.slot_names() == gen.slot_names()
    for slot in interp.active:
        other = gen.slot(slot.name)
        assert len(slot.buffers()) == len(other.buffers()), slot.name
        for a, b in zip(slot.buffers(), other.buffers()):  # a staged slot's host buffer, then its device one
            assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, slot.name
            assert same_bits(a, b), (
                f"{when}: buffer '{slot.name}' differs\ninterpreted: {a.tolist()}\ngenerated:   {b.tolist()}")


def assert_same_views(interp, gen, fbs, vi, vg, padded_bs, padded_num_tokens) -> None:
    fbi, fbg = fbs
    assert type(vi) is type(fbi) and type(vg) is type(fbg)
    assert vi is not fbi and vg is not fbg
    assert vi.batch_size == padded_bs and vg.batch_size == padded_bs
    ai, ag = vars(vi), vars(vg)
    assert ai.keys() == ag.keys(), f"view attributes differ: {sorted(ai.keys() ^ ag.keys())}"
    slot_names = set(interp.slot_names())
    for key in ai.keys() - {"batch_size"}:  # set by extract, checked above
        x, y = ai[key], ag[key]
        if isinstance(x, torch.Tensor) and key in slot_names and x is not getattr(fbi, key, None):
            assert isinstance(y, torch.Tensor), key
            assert x.shape == y.shape and x.dtype == y.dtype, key
            assert same_bits(x, y), key
            expected = interp.slot(key).slice_for(padded_bs, padded_num_tokens)
            assert x.shape == expected.shape, key
            # each view is a window on its own registry's buffer, starting at its head
            for view, reg in ((x, interp), (y, gen)):
                buffer = reg.slot(key).buffer
                assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), key
                assert view.storage_offset() == buffer.storage_offset() == 0, key
        else:
            assert x is getattr(fbi, key) and y is getattr(fbg, key), (
                f"view.{key}: non-slot values are carried from the batch by identity")


def assert_design_contract(interp, fb, view, step: Step) -> None:
    """What the contract says a view exposes, checked on the interpreter's view."""
    for slot in interp.active:
        spec = slot.resolved
        if spec.structured:
            continue
        if spec.optional and spec.plain_copy and getattr(fb, spec.name, None) is None:
            assert getattr(view, spec.name, "absent") is getattr(fb, spec.name, "absent")
        else:
            exposed = getattr(view, spec.name)
            assert exposed.shape == slot.slice_for(step.padded_bs, step.padded_num_tokens).shape


def assert_heads_and_tails(interp, fb, step: Step, views=()) -> None:
    """Spot-check the interpreter itself: plain copies land in the head, resets in the tail."""
    for slot in interp.active:
        spec = slot.resolved
        if not spec.plain_copy or spec.name in views:  # a view of the buffer changes with it
            continue
        count = slot.count(step.raw_bs, step.raw_num_tokens)
        src = getattr(fb, spec.name, None)
        if isinstance(src, torch.Tensor):
            assert same_bits(slot.head(count), src.to(spec.dtype)), spec.name
        end = slot.tail_end(step.padded_bs, step.padded_num_tokens) if spec.axis.sliced else None
        if spec.resets_tail:  # to the padded count (extra rows included), or to the end under reset_to: capacity
            tail = slot.filled.narrow(spec.slice_dim, count, end - count)
            assert same_bits(tail, torch.full_like(tail, spec.tail_value)), spec.name
        if spec.repeats_last:  # written after every hook: the tail is the head's last row as the fill left it
            tail = slot.filled.narrow(spec.slice_dim, count, end - count)
            last = slot.filled.narrow(spec.slice_dim, count - 1, 1) if count else torch.zeros_like(tail)
            assert same_bits(tail, last.expand_as(tail)), spec.name
        if slot.host is not None:  # staged: the device buffer holds what the step defines, as the host one
            rows = None if spec.to_capacity else slot.count(step.padded_bs, step.padded_num_tokens)
            assert same_bits(slot.head(rows), slot.buffer if rows is None else slot.buffer.narrow(
                spec.slice_dim, 0, rows)), spec.name


def poison(interp, gen, seed: int) -> None:
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    for slot in interp.active:
        for a, b in zip(slot.buffers(), gen.slot(slot.name).buffers()):  # a staged slot's two
            noise = random_tensor(a.shape, a.dtype, g, scale=10**6, device=a.device)
            a.copy_(noise)
            b.copy_(noise)


def build_pair(spec, max_bs, max_num_tokens, strict=False, **kwargs):
    interp = build(spec, max_bs=max_bs, max_num_tokens=max_num_tokens, impl="interpreted", strict=strict, **kwargs,
                   device="cpu")
    gen = build(spec, max_bs=max_bs, max_num_tokens=max_num_tokens, impl="generated", strict=strict, **kwargs,
                device="cpu")
    assert interp.impl == "interpreted" and gen.impl == "generated"
    assert interp.strict == gen.strict == strict
    assert [s.name for s in interp.all_slots()] == [s.name for s in gen.all_slots()]
    for a, b in zip(interp.all_slots(), gen.all_slots()):
        assert a.enabled == b.enabled, a.name
    return interp, gen


def outcome(call, *args, **kwargs):
    """``(result, None)`` or ``(None, the exception)``."""
    try:
        return call(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 — compared between the modes
        return None, exc


def assert_same_error(ei, eg, where: str) -> None:
    assert (ei is None) == (eg is None), f"{where}: only one mode raised: {ei!r} / {eg!r}"
    if ei is not None:
        assert type(ei) is type(eg), f"{where}: {ei!r} vs {eg!r}"
        if isinstance(ei, gs.SlotError):
            assert str(ei) == str(eg), where


def copy_refused(error: Exception) -> bool:
    """Whether a fill's SlotError names a source that ``copy_`` refused for overlapping a
    buffer (torch's error its cause): raised once the copies began, as torch's own was."""
    return error.__cause__ is not None and "aliases the buffer of slot" in str(error)


ERRORS_SEEN: List[str] = []  # messages of the errors both modes raised (coverage check below)


def run_steps(interp, gen, steps: List[Step], first_poison: bool = True) -> None:
    assert_same_buffers(interp, gen, "after allocation")
    for i, step in enumerate(steps):
        if step.poison or (i == 0 and first_poison):
            poison(interp, gen, step.seed)
        # one batch per registry (equal values; a view of a buffer views its own registry's)
        fbi, fbg = make_batch(interp, step), make_batch(gen, step)
        before = snapshot(fbi)
        sizes = (step.raw_bs, step.padded_bs, step.raw_num_tokens, step.padded_num_tokens)
        side = {"bias": step.bias}
        counts = dict(raw_bs=step.raw_bs, padded_bs=step.padded_bs, raw_num_tokens=step.raw_num_tokens,
                      padded_num_tokens=step.padded_num_tokens)
        _, ei = outcome(interp.fill_from_skipping(step.skip), fbi, **counts, side_inputs=side)
        _, eg = outcome(gen.fill_from_skipping(step.skip), fbg, **counts, side_inputs=side)
        assert_same_error(ei, eg, f"fill {i} {sizes}")
        if ei is not None:
            ERRORS_SEEN.append(f"{type(ei).__name__}: {ei}")
        if ei is not None and (not isinstance(ei, gs.SlotError) or copy_refused(ei)):
            return  # buffers may hold partial copies
        assert_same_buffers(interp, gen, f"after fill {i} {sizes}")
        if ei is not None:
            continue
        views = {name for name, presence in step.presence.items() if presence.startswith("own_")}
        assert_same_snapshot(before, snapshot(fbi), views=views)
        assert_heads_and_tails(interp, fbi, step, views | step.skip)

        (vi, ei), (vg, eg) = (outcome(reg.extract, fb, padded_bs=step.padded_bs,
                                      padded_num_tokens=step.padded_num_tokens)
                              for reg, fb in ((interp, fbi), (gen, fbg)))
        assert_same_error(ei, eg, f"extract {i}")
        if ei is not None:
            continue
        assert_same_views(interp, gen, (fbi, fbg), vi, vg, step.padded_bs, step.padded_num_tokens)
        assert_design_contract(interp, fbi, vi, step)
        assert_same_snapshot(before, snapshot(fbi), views=views)
        assert fbi.batch_size == step.raw_bs
        assert_same_buffers(interp, gen, f"after extract {i}")


# --- the property -------------------------------------------------------------------------


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_generated_code_equals_the_interpreter_on_random_specs(case: Case):
    spec = gs.parse_spec(case.text, path="random.yaml")
    hooks = user_hooks(s.name for s in case.slots)
    context = {"context": OwnContext.make} if case.own_context else {}
    interp, gen = build_pair(spec, case.max_bs, case.max_num_tokens, strict=case.strict, params=case.params,
                             hooks=hooks, **context)
    run_steps(interp, gen, case.steps)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_generated_code_equals_the_interpreter_on_cuda(case: Case):
    """On a GPU, host (``device: cpu``) slots and device slots really differ."""
    spec = gs.parse_spec(case.text, path="random.yaml")
    hooks = user_hooks(s.name for s in case.slots)
    interp, gen = build_pair(spec, case.max_bs, case.max_num_tokens, device="cuda", params=case.params,
                             hooks=hooks)
    for slot in interp.active:
        assert slot.buffer.device.type == ("cpu" if slot.resolved.host else "cuda")
    run_steps(interp, gen, case.steps)


def test_the_strategy_makes_valid_specs_that_cover_every_feature():
    """The generator of specs is itself checked: what it draws parses, and across a
    sample it reaches every policy, axis, dtype and feature the property relies on."""
    seen = set()

    # 250 draws: with 120, about one seed in 40 missed a rare feature (a structured dotted source)
    @settings(max_examples=250, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases())
    def collect(case: Case):
        spec = gs.parse_spec(case.text, path="random.yaml")
        for slot in spec.slots:
            seen.add(("padding", slot.padding or "keep_pad"))
            seen.add(("axis", slot.axis))
            seen.add(("dtype", slot.dtype))
            seen.add(("slice_dim", slot.slice_dim > 0))
            seen.add(("trailing", len(slot.shape) > slot.slice_dim + 1))
            seen.add(("host", slot.device == "cpu"))
            seen.add(("optional", slot.optional))
            seen.add(("computed", not slot.copy_from_fb))
            seen.add(("post_fill", slot.post_fill is not None))
            seen.add(("source", slot.source == "dotted_field", slot.is_structured))
            seen.add(("user_source", slot.source is not None and slot.source != "dotted_field"))
            seen.add(("index", slot.index))
            seen.add(("enabled_if", isinstance(slot.enabled_if, str)))
            seen.add(("runtime_pad", isinstance(slot.pad_value, str)
                      and any(n in slot.pad_value for n in case.runtime)))
            seen.add(("zero_d", not slot.shape))
            seen.add(("extra_rows", slot.extra_rows > 0))
            seen.add(("padding_param", slot.padding == "pol"))
            seen.add(("reset_to", slot.reset_to))
            seen.add(("staged", slot.staged))
        seen.add(("absent_skip", spec.absent_fields == "skip"))
        seen.add(("live_provider", callable(case.params.get("lv"))))
        seen.add(("skip_set", any(step.skip for step in case.steps)))
        seen.add(("own_context", case.own_context))

    collect()
    wanted = ({("padding", p) for p in ("zero", "fill_sentinel", "keep_pad", "foreach_copy", "fill_once",
                                        "repeat_last", "pol")}
              | {("reset_to", r) for r in ("padded", "capacity", "reset")}
              | {("index", "skip"), ("padding_param", True), ("extra_rows", True), ("staged", True)}
              | {("axis", a) for a in ("bs", "tokens", "none")}
              | {("dtype", d) for d in DTYPES}
              | {(k, True) for k in ("slice_dim", "trailing", "host", "optional", "computed", "post_fill",
                                     "user_source", "index", "enabled_if", "runtime_pad", "zero_d",
                                     "absent_skip", "live_provider", "skip_set", "own_context")}
              | {("source", True, True), ("source", True, False)})
    assert wanted <= seen, sorted(wanted - seen, key=str)


def test_the_property_reaches_every_error_of_the_contract():
    """The error half of the property is exercised, not just allowed: across a sample,
    both modes raised each kind of error the contract defines (and agreed on it).
    Aliasing sources are rarer draws; tests/test_strict_mode.py pins them down. A fixed
    seed draws the same sample alone, but the draw also depends on what ran before in the
    process; so up to three seeded samples, until every error was reached."""
    wanted = ["the batch field is None, but the slot is not optional", "the batch has no field",
              "expected a torch.Tensor, got str", "expected shape", "counts must satisfy", "expected dtype"]
    ERRORS_SEEN.clear()
    for sample_seed in (6, 7, 8):
        @seed(sample_seed)
        @settings(max_examples=200, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(cases())
        def run(case: Case):
            test_generated_code_equals_the_interpreter_on_random_specs.hypothesis.inner_test(case)

        run()
        missing = [w for w in wanted if not any(w in seen for seen in ERRORS_SEEN)]
        if not missing:
            break
    assert not missing, missing


# --- regressions found by the property (kept as plain examples) ---------------------------

REGRESSIONS = {
    # every enabled slot is structured: extract has no view to cache
    "only_structured_slots": ("""
        name: r
        slots:
          - {name: a.b, shape: [max_bs], dtype: int64, axis: bs, padding: zero, source: dotted_field}
    """, {}),
    # no slot enabled at all
    "all_slots_disabled": ("""
        name: r
        params:
          flag: {type: bool, default: false}
        slots:
          - {name: x, shape: [max_bs], dtype: int64, axis: bs, padding: zero, enabled_if: flag}
    """, {}),
    # fill_from has nothing to do: an axis-none buffer that is only initialised
    "nothing_to_fill": ("""
        name: r
        slots:
          - {name: x, shape: [4], dtype: int64, axis: none, padding: fill_once, pad_value: 3,
             copy_from_fb: false}
    """, {}),
    # a slot named like a Python keyword is read and set by name
    "keyword_slot_name": ("""
        name: r
        slots:
          - {name: class, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
          - {name: lambda, shape: [max_bs], dtype: int64, axis: bs, padding: zero, optional: true}
          - {name: if, shape: [2, max_num_tokens], dtype: int32, axis: tokens, slice_dim: 1, padding: zero}
    """, {}),
    # 'a.b' mangles to a__b, 'a__b' then to a__b_2 — which is another slot's name
    "generated_identifier_collision": ("""
        name: r
        slots:
          - {name: a.b, shape: [max_bs], dtype: int64, axis: bs, padding: zero, source: dotted_field}
          - {name: a__b_2, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: 7}
          - {name: a__b, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
    """, {}),
    # runtime params named like what the generated module binds itself
    "runtime_params_named_like_generated_locals": ("""
        name: r
        params:
          device: {type: int, default: 3, runtime: true}
          torch: {type: int, default: 4, runtime: true}
          pool: {type: int, default: 5, runtime: true}
          source: {type: int, default: 6, runtime: true}
          buffers: {type: int, default: 7, runtime: true}
          hooks: {type: int, default: 8, runtime: true}
          params: {type: int, default: 9, runtime: true}
          len: {type: int, default: 10, runtime: true}
          rt_device: {type: int, default: 11, runtime: true}
        slots:
          - {name: a, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: device}
          - {name: b, shape: [max_bs, 2], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: "torch + pool"}
          - {name: c, shape: [max_bs], dtype: int32, axis: bs, padding: fill_once, pad_value: source}
          - {name: d, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: fill_sentinel,
             pad_value: "buffers * hooks + params + len"}
          - {name: e, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: rt_device}
          - {name: f, shape: [1], dtype: int64, axis: none, copy_from_fb: false, post_fill: stamp}
    """, {"device": 13, "params": 21}),
    # non-finite, signed-zero, huge and subnormal floats as pad values: literals, folded
    # expressions (one overflowing to inf), a baked param (in PARAMS too) and a runtime one
    "non_finite_pad_values": ("""
        name: r
        params:
          big: {type: float, default: 1.0e+308}
          neg: {type: float, default: -.inf}
          nan: {type: float, default: .nan}
          rtf: {type: float, default: .nan, runtime: true}
        slots:
          - {name: a, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: -.inf}
          - {name: b, shape: [max_num_tokens], dtype: bfloat16, axis: tokens, padding: fill_sentinel, pad_value: .nan}
          - {name: c, shape: [max_bs, 2], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: -0.0}
          - {name: d, shape: [3], dtype: float64, axis: none, padding: fill_once, pad_value: .inf}
          - {name: e, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: "big * 10",
             device: cpu}
          - {name: f, shape: [max_bs], dtype: float32, axis: bs, padding: fill_once, pad_value: "neg - 1"}
          - {name: g, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: rtf}
          - {name: h, shape: [max_bs], dtype: float64, axis: bs, padding: fill_sentinel,
             pad_value: "-1.7976931348623157e308 if nan != nan else 0.0"}
          - {name: i, shape: [max_num_tokens, 2], dtype: float64, axis: tokens, padding: fill_sentinel,
             pad_value: 5.0e-324}
          - {name: j, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: 3}
    """, {"rtf": float("-inf")}),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regressions(name):
    text, params = REGRESSIONS[name]
    spec = gs.parse_spec(textwrap.dedent(text), path=f"{name}.yaml")
    names = [s.name for s in spec.slots]
    interp, gen = build_pair(spec, 4, 6, params=params, hooks=user_hooks(names))
    steps = [
        Step(2, 4, 3, 6, seed=1, poison=True, presence={}, rows={}, bias=1, plain_class=True),
        Step(1, 3, 0, 2, seed=2, poison=False, presence={n: "none" for n in names}, rows={}, bias=2,
             plain_class=False),
        Step(4, 4, 6, 6, seed=3, poison=True, presence={}, rows={}, bias=3, plain_class=True),
    ]
    run_steps(interp, gen, steps)


def test_a_user_hook_may_not_shadow_a_builtin_hook():
    # Otherwise which one runs would depend on the mode: generated code leaves out a
    # built-in with nothing to do under the params, the interpreter would call the user's.
    def mine(buffer, fb, ctx):
        buffer.fill_(42)

    for mode in ("interpreted", "generated"):
        with pytest.raises(gs.SpecError) as info:
            gs.build_registry("decode", max_bs=4, max_num_tokens=4, impl=mode, hooks={"global_num_tokens": mine},
                              device="cpu")
        assert str(info.value) == (
            "<hooks=>: hook name 'global_num_tokens' passed in build_registry(hooks=...) is the name of a "
            "built-in hook; rename yours (e.g. 'my_global_num_tokens') and use that name in the spec")


HOOKED_AND_PLAIN = """
    name: r
    slots:
      - {name: ids, shape: [max_bs], dtype: int64, axis: bs, padding: zero, source: feed}
      - {name: pos, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
"""


def refuse(fb, ctx):
    raise LookupError("the engine's feed failed")


@pytest.mark.parametrize("feed, error, message", [
    (lambda fb, ctx: [1, 2], gs.SlotError, r"^spec 'r', slot 'ids': expected a torch.Tensor, got list \[1, 2\]$"),
    (refuse, LookupError, r"^the engine's feed failed$"),
], ids=["a source that is no tensor", "a source hook that raises"])
def test_a_source_hook_s_failure_comes_before_a_plain_field_s_aliasing(feed, error, message):
    """Every source is read and checked (the fields, then the source hooks) before anything is copied, and only a
    copy that fails looks for the source aliasing a buffer. Generated code caught a source hook's failure in its
    copy's except branch, and raised the aliasing of a plain field instead (found by the property test)."""
    spec = gs.parse_spec(textwrap.dedent(HOOKED_AND_PLAIN), path="r.yaml")
    for reg in build_pair(spec, 4, 8, hooks={"feed": feed}):
        pos = reg.slot("pos").buffer
        fb = types.SimpleNamespace(pos=pos[1:3])  # its own buffer, shifted: overlaps the rows it would be copied into
        with pytest.raises(error, match=message):
            reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)


# --- the shipped specs ----------------------------------------------------------------------

SHIPPED = {
    "decode-default": ("decode", {}, None),
    "decode-eager": ("decode", {}, "eager"),
    "decode-everything": ("decode", {
        "require_gathered_buffer": True, "require_mlp_tp_gather": True, "dp_size": 4,
        "enable_num_token_non_padded": True, "is_encoder_decoder": True, "is_hybrid_swa": True,
        "enable_mamba_track": True, "seq_len_fill_value": 5, "encoder_len_fill_value": 2,
    }, None),
    "decode-gathered-rank": ("decode", {
        "require_gathered_buffer": True, "enable_num_token_non_padded": True, "attn_tp_rank": 1,
        "attn_tp_size": 2,
    }, None),
    "prefill-default": ("prefill", {}, None),
    "prefill-multimodal": ("prefill", {"is_multimodal": True, "hidden_size": 8}, None),
    "prefill-mamba-swa": ("prefill", {"enable_mamba_track": True, "is_hybrid_swa": True,
                                      "cache_loc_dtype": "int32"}, None),
}

SIZES = [  # (raw_bs, padded_bs, raw_num_tokens, padded_num_tokens) on max_bs=8, max_num_tokens=16
    (3, 4, 3, 4), (8, 8, 16, 16), (0, 2, 0, 2), (5, 8, 11, 16), (1, 1, 1, 1), (3, 4, 3, 4), (2, 8, 7, 12),
]


@pytest.mark.parametrize("case", sorted(SHIPPED))
def test_shipped_specs(case):
    name, params, preset = SHIPPED[case]
    interp, gen = build_pair(name, 8, 16, params=params, preset=preset)
    optional = [s.name for s in interp.active if s.resolved.optional]
    steps = []
    for i, (rb, pb, rt, pt) in enumerate(SIZES):
        # optional fields alternate between present, None and absent
        presence = {n: ["tensor", "none", "absent"][(i + j) % 3] for j, n in enumerate(optional)}
        steps.append(Step(rb, pb, rt, pt, seed=100 + i, poison=i % 2 == 0, presence=presence, rows={},
                          bias=0, plain_class=i % 2 == 0))
    run_steps(interp, gen, steps)


def test_shipped_decode_fills_what_the_design_says():
    """An absolute check on top of the differential ones: a decode step, by hand."""
    for mode in ("interpreted", "generated"):
        reg = gs.build_registry("decode", max_bs=4, max_num_tokens=4, impl=mode, params={"seq_len_fill_value": 9},
                                device="cpu")
        for slot in reg.active:
            slot.buffer.fill_(-7)
        fb = Batch()
        fb.batch_size = 2
        fb.input_ids = torch.tensor([11, 12])
        fb.positions = torch.tensor([5, 6])
        fb.out_cache_loc = torch.tensor([40, 41])
        fb.req_pool_indices = torch.tensor([2, 3])
        fb.seq_lens = torch.tensor([6, 7])
        fb.seq_lens_cpu = torch.tensor([6, 7])
        fb.mrope_positions = None
        reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
        buf = {n: reg.slot(n).buffer.tolist() for n in reg.slot_names()}
        assert buf["input_ids"] == [11, 12, -7, -7], mode  # foreach_copy: tail untouched
        assert buf["positions"] == [5, 6, 0, -7], mode  # zero: [raw:padded] only
        assert buf["seq_lens"] == [6, 7, 9, -7], mode  # fill_sentinel with the runtime value
        assert buf["seq_lens_cpu"] == [6, 7, 9, -7], mode
        assert buf["mrope_positions"] == [[-7, -7, 0, -7]] * 3, mode  # None: no copy, tail reset
        assert buf["global_num_tokens_gpu"] == [-7], mode  # no hook without gathered buffers
        view = reg.extract(fb, padded_bs=3, padded_num_tokens=3)
        assert view.batch_size == 3 and view.mrope_positions is None
        assert view.seq_lens.tolist() == [6, 7, 9]
        assert fb.batch_size == 2 and fb.seq_lens.tolist() == [6, 7]
