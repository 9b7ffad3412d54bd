"""A spec is immutable (issue 37): ``load_spec`` and ``spec_from_dict`` hand out the
process-wide cached spec, so a list or dict inside it that could be changed would change
every later ``load_spec``/``build_registry`` of that name, behind its cached identity.
``to_dict()`` is the way to derive a spec: plain, mutable data."""

from __future__ import annotations

import pytest

import graphslot as gs


def mutations(spec):
    preset = next(iter(spec.presets))
    return {
        "slots.append": lambda: spec.slots.append(spec.slots[0]),
        "slots[0] =": lambda: spec.slots.__setitem__(0, spec.slots[1]),
        "slots[0].shape.append": lambda: spec.slots[0].shape.append(1),
        "params[x] =": lambda: spec.params.__setitem__("x", spec.params[next(iter(spec.params))]),
        "params.pop": lambda: spec.params.pop(next(iter(spec.params))),
        "presets[x] =": lambda: spec.presets.__setitem__("x", {}),
        "presets[p][k] =": lambda: spec.presets[preset].__setitem__("k", 1),
        "presets[p].update": lambda: spec.presets[preset].update(k=1),
        "spec.name =": lambda: setattr(spec, "name", "other"),
    }


@pytest.mark.parametrize("how", list(mutations(gs.load_spec("decode"))))
def test_a_loaded_spec_cannot_be_changed_so_later_loads_stay_the_file(how):
    spec = gs.load_spec("decode")
    before = (spec.identity, spec.canonical_json())
    with pytest.raises((TypeError, AttributeError, ValueError)):
        mutations(spec)[how]()
    again = gs.load_spec("decode")
    assert (again.identity, again.canonical_json()) == before
    assert again.identity == gs.spec_from_dict(again.to_dict()).identity


def test_a_spec_from_code_cannot_be_changed_and_to_dict_gives_plain_data_to_derive_from():
    data = gs.load_spec("decode").to_dict()
    spec = gs.spec_from_dict(data)
    with pytest.raises(AttributeError):
        spec.slots.append(spec.slots[0])
    derived = spec.to_dict()
    assert type(derived["slots"]) is list and type(derived["slots"][0]["shape"]) is list
    assert type(derived["params"]) is dict and all(type(v) is dict for v in derived["presets"].values())
    extra = dict(derived["slots"][-1], name="extra_slot")
    derived["slots"].append(extra)
    bigger = gs.spec_from_dict(derived)
    assert [s.name for s in bigger.slots] == [s.name for s in spec.slots] + ["extra_slot"]
    assert gs.spec_from_dict(data).identity == spec.identity != bigger.identity
    canonical = spec.canonical()
    assert type(canonical["slots"]) is list and type(canonical["slots"][0]["shape"]) is list
