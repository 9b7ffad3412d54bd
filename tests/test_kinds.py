"""The spec's vocabularies are defined once (graphslot/spec/kinds.py): the axis and padding
enums are their strings everywhere they are compared, printed or dumped; the axis knows
its capacity; a declared and a resolved slot agree on what kind of slot they are; and a
registry's slot names its resolved declaration ``resolved`` (``spec``, the older name,
still works)."""

from __future__ import annotations

import json
import typing

import pytest

import graphslot as gs
from graphslot.spec.kinds import CAPACITY_NAMES, Axis, Padding
from graphslot.spec.model import SlotSpec
from graphslot.spec.resolve import resolve_params, resolve_slots

from conftest import make_slot_yaml, parse


def test_an_axis_is_its_string():
    assert Axis.BS == "bs" and "tokens" == Axis.TOKENS and Axis("none") is Axis.NONE
    assert {"bs": 1}[Axis.BS] == 1 and hash(Axis.TOKENS) == hash("tokens")
    assert f"{Axis.BS}" == str(Axis.BS) == "%s" % Axis.BS == "bs" and f"{Axis.NONE:>6}" == "  none"
    assert (json.dumps({"axis": Axis.TOKENS, "padding": Padding.FILL_ONCE})
            == '{"axis": "tokens", "padding": "fill_once"}')
    assert type(str(Padding.ZERO)) is str and repr(Axis.TOKENS) == "'tokens'" and repr((Axis.BS,)) == "('bs',)"


def test_the_axis_knows_its_capacity_and_counts():
    assert {a.value: a.capacity for a in Axis} == {"bs": "max_bs", "tokens": "max_num_tokens", "none": None}
    assert CAPACITY_NAMES == ("max_bs", "max_num_tokens")
    assert Axis.BS.counts == ("raw_bs", "padded_bs") and Axis.TOKENS.counts == ("raw_num_tokens", "padded_num_tokens")
    assert (Axis.BS.select(3, 7), Axis.TOKENS.select(3, 7), Axis.NONE.select(3, 7)) == (3, 7, None)
    assert [a.sliced for a in Axis] == [True, True, False]


def test_padding_policies():
    assert Padding.values() == ("zero", "fill_sentinel", "keep_pad", "foreach_copy", "fill_once", "repeat_last")
    assert [p.value for p in Padding if p.resets_tail] == ["zero", "fill_sentinel"]
    assert [p.value for p in Padding if p.writes_tail] == ["zero", "fill_sentinel", "repeat_last"]
    assert [p.value for p in Padding if p.needs_pad_value] == ["fill_sentinel", "fill_once"]
    assert Padding.of(None) is Padding.KEEP_PAD and Padding.of("zero") is Padding.ZERO
    with pytest.raises(ValueError):
        Padding.of("zeros")


def test_the_model_takes_its_choices_from_the_enums():
    assert typing.get_args(SlotSpec.model_fields["axis"].annotation) == Axis.values()
    padding = typing.get_args(SlotSpec.model_fields["padding"].annotation)[0]  # Optional[...]
    assert typing.get_args(padding) == Padding.values()
    # the declared model keeps plain strings (its canonical form and identity are unchanged)
    spec = gs.load_spec("decode")
    assert type(spec.slots[0].axis) is str and "Axis" not in spec.canonical_json()


def test_a_resolved_slot_holds_the_enums():
    spec = gs.load_spec("decode")
    slots = resolve_slots(spec, resolve_params(spec, torch_dtypes=False), 4, 8)
    by_name = {s.name: s for s in slots}
    assert by_name["seq_lens"].axis is Axis.BS and by_name["seq_lens"].padding is Padding.FILL_SENTINEL
    assert by_name["input_ids"].axis is Axis.TOKENS
    assert all(isinstance(s.padding, Padding) for s in slots)  # keep_pad where none is declared


@pytest.mark.parametrize("keys, structured, computed", [
    ({}, False, False),
    ({"name": "info.ids", "source": "dotted_field"}, True, False),
    ({"post_fill": "my_hook"}, False, True),
    ({"copy_from_fb": False}, False, True),
])
def test_declared_and_resolved_slots_agree_on_their_kind(keys, structured, computed):
    spec = parse(make_slot_yaml(**keys))
    declared = spec.slots[0]
    resolved = resolve_slots(spec, {}, 4, 8)[0]
    assert ((declared.structured, declared.computed) == (resolved.structured, resolved.computed)
            == (structured, computed))
    assert declared.is_structured == structured  # the older spelling


def test_a_registry_slot_names_its_resolved_declaration_resolved():
    reg = gs.build_registry("decode", max_bs=4, max_num_tokens=8, impl="interpreted", device="cpu")
    slot = reg.slot("seq_lens")
    assert slot.resolved.name == "seq_lens" and slot.resolved.axis is Axis.BS
    assert not hasattr(slot, "spec")  # Slot.spec, the older name, is gone (CHANGELOG)
    assert slot.count(3, 7) == 3 and reg.slot("input_ids").count(3, 7) == 7
    assert repr(slot).startswith("<Slot seq_lens axis=bs padding=fill_sentinel shape=[4]")
