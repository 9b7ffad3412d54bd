"""Specs built in code (``gs.spec_from_dict``, ``RegistrySpec.to_dict``), the identity
of specs that do not use the keys added for sglang, and the caches that make a registry
built again cheap (parsed specs, resolved slots, compiled modules). Times are measured
by benchmarks/bench_build_registry.py, not here: these tests check that nothing is done
twice.
"""

from __future__ import annotations

import enum
import os
from types import SimpleNamespace

import pytest
import torch

import graphslot as gs
from conftest import parse
from graphslot.codegen import generator

LABEL = "<code: tests>"


def slot(**keys):
    return dict({"name": "x", "shape": ["max_bs"], "dtype": "int64", "axis": "bs", "padding": "zero"}, **keys)


def test_a_shipped_spec_goes_to_data_and_back_with_its_identity():
    for name in gs.shipped_spec_names():
        spec = gs.load_spec(name)
        again = gs.spec_from_dict(spec.to_dict(), label=LABEL)
        assert again.identity == spec.identity and again.path == LABEL
        assert again.to_dict() == spec.to_dict()
        assert list(again.params) == list(spec.params)  # the order of the data is kept


def test_to_dict_leaves_out_what_holds_its_default():
    data = gs.spec_from_dict({"name": "t", "slots": [slot()]}).to_dict()
    assert data == {"name": "t", "slots": [slot()]}
    data["slots"].append(slot(name="y"))  # plain data to derive another spec from
    assert gs.load_spec("decode").to_dict() is not gs.load_spec("decode").to_dict()


def test_a_code_spec_is_validated_like_a_file_and_its_errors_name_the_label_and_slot():
    with pytest.raises(gs.SpecError) as err:
        gs.spec_from_dict({"name": "t", "slots": [slot(padding="keep_pad", index=True), slot(name="y", axis="batch")]},
                          label=LABEL)
    assert str(err.value).splitlines() == [  # every problem; the structural ones first (there are no lines)
        "<code: tests>: slot 'y': 'batch' is not a valid axis (one of: bs, tokens, none)",
        "<code: tests>: slot 'x': index slots must use padding 'zero' (got 'keep_pad'): a stale or sentinel tail "
        "would index out of the pool"]


@pytest.mark.parametrize("data, error", [
    ([1], "a spec is a mapping with keys name, description, params, presets, absent_fields, slots, got list"),
    ({1: 2}, "the spec: key 1 is not a string"),
    ({"name": "t", "slots": [{("a",): 1}]}, "slots[0]: key ('a',) is not a string"),
    ({"name": "t", "slots": [slot(shape=[torch.int64])]},
     "slots[0].shape[0]: torch.dtype is not plain data: a spec from code holds only dicts, lists, str, int, float, "
     "bool and None (a dtype by its name: 'int64')"),
    ({"name": "t", "slots": [slot(shape=[2 ** 63])]},
     "slots[0].shape[0]: integer 9223372036854775808 out of range (|value| < 2**63)"),
])
def test_what_is_not_plain_data_is_refused_naming_where_it_sits(data, error):
    with pytest.raises(gs.SpecError) as err:
        gs.spec_from_dict(data, label=LABEL)
    assert str(err.value) == f"{LABEL}: {error}"


def test_enum_values_are_taken_as_their_plain_values():
    class Axis(str, enum.Enum):
        NONE = "none"

    class Two(enum.IntEnum):
        TWO = 2

    spec = gs.spec_from_dict({"name": "t", "slots": [slot(axis=Axis.NONE, shape=[Two.TWO], padding=None)]})
    assert spec.slots[0].axis == "none" and type(spec.slots[0].shape[0]) is int
    assert gs.spec_from_dict({"name": "t", "slots": [slot(axis="none", shape=[2], padding=None)]}) is spec


def test_str_subclass_keys_and_numpy_scalars_are_taken_as_their_plain_values():
    """Issue 37: a str-enum key was "not a string", and np.bool_ "bool is not plain data
    ... holds only ... bool"."""
    import numpy as np

    class Key(str, enum.Enum):
        NAME = "name"
        AXIS = "axis"

    keys = {k: v for k, v in slot(shape=[np.int64(2)], optional=np.bool_(True)).items() if k != "axis"}
    spec = gs.spec_from_dict({Key.NAME: "t", "slots": [dict(keys, padding=None, **{Key.AXIS: "none"})],
                              "params": {"p": {"type": "float", "default": np.float32(0.5)}}})
    assert spec.slots[0].axis == "none" and spec.slots[0].shape == (2,) and spec.slots[0].optional is True
    assert type(spec.slots[0].shape[0]) is int and spec.params["p"].default == 0.5
    assert spec.identity == gs.spec_from_dict({"name": "t", "slots": [slot(axis="none", shape=[2], optional=True,
                                                                           padding=None)],
                                               "params": {"p": {"type": "float", "default": 0.5}}}).identity


class LyingList(list):
    def __len__(self):
        return 1 << 60


def test_a_sequence_is_read_by_iterating_never_by_trusting_its_len():
    spec = gs.spec_from_dict({"name": "t", "slots": LyingList([slot()])})
    assert [s.name for s in spec.slots] == ["x"]
    with pytest.raises(gs.SpecError) as err:
        gs.spec_from_dict({"name": "t", "slots": [slot(shape=LyingList([1, object()]))]}, label=LABEL)
    assert str(err.value) == (f"{LABEL}: slots[0].shape[1]: object is not plain data: a spec from code holds only "
                              "dicts, lists, str, int, float, bool and None (a dtype by its name: 'int64')")


def test_hooks_of_a_code_spec_are_passed_by_name():
    data = {"name": "t", "slots": [slot(name="n", shape=[1], axis="none", padding=None, copy_from_fb=False,
                                        post_fill="mine")]}
    spec = gs.spec_from_dict(data, label=LABEL)
    for mode in ("interpreted", "generated"):
        reg = gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=mode,
                                hooks={"mine": lambda buf, fb, ctx: buf.fill_(ctx.raw_bs)}, device="cpu")
        reg.fill_from(SimpleNamespace(), raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
        assert reg.slot("n").buffer.tolist() == [3]
    with pytest.raises(gs.SpecError) as err:
        gs.build_registry(spec, max_bs=4, max_num_tokens=4, device="cpu")
    assert str(err.value) == (f"{LABEL}: slot 'n': unknown post_fill hook 'mine': pass it in "
                              "build_registry(hooks={'mine': fn}), use a built-in post_fill hook, or write "
                              "'package.module:function'")


def test_the_new_keys_at_their_defaults_leave_the_identity_as_it_was():
    plain = {"name": "t", "params": {"p": {"type": "int", "default": 1}}, "slots": [slot()]}
    spelled = {"name": "t", "absent_fields": "error", "params": {"p": {"type": "int", "default": 1, "live": False}},
               "slots": [slot(adopt="allowed")]}
    a, b = gs.spec_from_dict(plain), gs.spec_from_dict(spelled)
    assert a.canonical() == b.canonical() and a.identity == b.identity
    assert {"absent_fields", "live", "adopt"}.isdisjoint(a.canonical_json().replace('"', " ").split())
    for key, value in (("absent_fields", "skip"), ("live", True), ("adopt", "never")):
        changed = {"name": "t", "params": {"p": {"type": "int", "default": 1}}, "slots": [slot()]}
        {"absent_fields": changed, "live": changed["params"]["p"], "adopt": changed["slots"][0]}[key][key] = value
        assert gs.spec_from_dict(changed).identity != a.identity, key


# --- caches --------------------------------------------------------------------------------


def test_a_second_build_parses_resolves_and_compiles_nothing(monkeypatch):
    spec = gs.spec_from_dict({"name": "cached_once", "slots": [slot()]}, label=LABEL)
    gs.build_registry(spec, max_bs=4, max_num_tokens=8, device="cpu")
    calls = []
    for module, name in ((generator, "render_module"), (gs.spec.resolve, "_resolve_slots"),
                         (gs.spec.loading, "_validated")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    assert gs.spec_from_dict({"name": "cached_once", "slots": [slot()]}, label=LABEL) is spec
    reg = gs.build_registry(spec, max_bs=4, max_num_tokens=8, params={}, device="cpu")
    assert calls == []
    reg.fill_from(SimpleNamespace(x=torch.tensor([5])), raw_bs=1, padded_bs=2, raw_num_tokens=1, padded_num_tokens=2)
    assert reg.slot("x").buffer.tolist() == [5, 0, 0, 0]
    # other capacities: resolved again, not compiled again
    gs.build_registry(spec, max_bs=4, max_num_tokens=16, device="cpu")
    assert calls == ["_resolve_slots"]


def test_load_spec_keeps_a_file_until_it_changes(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nslots:\n  - {name: x, shape: [max_bs], dtype: int64, axis: bs, padding: zero}\n")
    first = gs.load_spec(path)
    assert gs.load_spec(path) is first
    path.write_text("name: mine\nslots:\n  - {name: x, shape: [max_bs], dtype: int32, axis: bs, padding: zero}\n")
    stat = path.stat()  # the same size: only the modification time tells the change
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))  # later, whatever the clock's grain
    changed = gs.load_spec(path)
    assert changed is not first and changed.slots[0].dtype == "int32"


def test_live_providers_do_not_defeat_the_caches(monkeypatch):
    spec = parse("""\
        name: live_cached
        params:
          k: {type: int, default: 1, live: true}
        slots:
          - {name: x, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
    """)
    gs.build_registry(spec, max_bs=4, max_num_tokens=8, params={"k": lambda ctx: 1}, device="cpu")
    calls = []
    real = gs.spec.resolve._resolve_slots
    monkeypatch.setattr(gs.spec.resolve, "_resolve_slots", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(generator, "render_module", lambda *a, **k: calls.append(2))
    gs.build_registry(spec, max_bs=4, max_num_tokens=8, params={"k": lambda ctx: 2}, device="cpu")
    assert calls == []
