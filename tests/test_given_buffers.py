"""Tensors a registry adopts (``buffers=``) or binds (``graphslot.api.build(bind=)``, the
sglang drop-in's ``bind=``) must be contiguous
(issue 37): generated code reinterprets the buffers of slots of several dtypes as one
integer dtype to copy them in one kernel, which a strided tensor cannot be, so a strided
one failed every fill in generated mode and worked in the interpreter. Both modes now
refuse it at build, naming the slot; contiguous tensors fill the same in both."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

import graphslot as gs
from graphslot.api import build

DTYPES = ("int64", "int32", "int16", "uint8", "bool", "float32", "float16", "bfloat16")
MODES = ("interpreted", "generated")


def spec(a: str, b: str) -> gs.RegistrySpec:
    return gs.spec_from_dict({"name": "pair", "slots": [
        {"name": "x", "shape": ["max_bs", 2], "dtype": a, "axis": "bs", "padding": "zero"},
        {"name": "y", "shape": ["max_bs"], "dtype": b, "axis": "bs", "padding": "zero"}]})


def tensors(a: str, b: str, strided: bool) -> dict:
    x = torch.zeros(4, 4, dtype=getattr(torch, a))
    return {"x": x[:, ::2] if strided else x[:, :2].contiguous(), "y": torch.zeros(4, dtype=getattr(torch, b))}


def registry(mode: str, how: str, given: dict, a: str, b: str):
    if how == "bind":
        return build(spec(a, b), device="cpu", max_bs=4, max_num_tokens=4, impl=mode, bind=given)
    return gs.build_registry(spec(a, b), device="cpu", max_bs=4, max_num_tokens=4, impl=mode, buffers=given)


def fill(reg, a: str, b: str):
    fb = SimpleNamespace(x=torch.ones(2, 2, dtype=getattr(torch, a)), y=torch.ones(2, dtype=getattr(torch, b)))
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    return [reg.slot(name).buffer.tolist() for name in ("x", "y")]


@pytest.mark.parametrize("how", ["bind", "buffers"])
def test_a_strided_tensor_is_refused_at_build_naming_the_slot_in_both_modes(how):
    for a, b in itertools.product(DTYPES, DTYPES):
        for mode in MODES:
            with pytest.raises(gs.SlotError) as err:
                registry(mode, how, tensors(a, b, strided=True), a, b)
            where = "spec 'pair', slot 'x'" if how == "bind" else "slot 'x'"  # adoption names no spec
            assert str(err.value) == (
                f"{where}: {how}= holds a non-contiguous tensor (shape [4, 2], strides [4, 2]); "
                "pass a contiguous tensor (.contiguous() gives one)"), (a, b, mode)
        filled = [fill(registry(mode, how, tensors(a, b, strided=False), a, b), a, b) for mode in MODES]
        assert filled[0] == filled[1], (a, b)
