"""Tensors a registry binds (``buffers=``) or adopts (``adopt=``) must be contiguous
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

DTYPES = ("int64", "int32", "int16", "uint8", "bool", "float32", "float16", "bfloat16")
MODES = ("interpreted", "generated")


def spec(a: str, b: str) -> gs.RegistrySpec:
    return gs.spec_from_dict({"name": "pair", "slots": [
        {"name": "x", "shape": ["max_bs", 2], "dtype": a, "axis": "bs", "padding": "zero"},
        {"name": "y", "shape": ["max_bs"], "dtype": b, "axis": "bs", "padding": "zero"}]})


def tensors(a: str, b: str, strided: bool) -> dict:
    x = torch.zeros(4, 4, dtype=getattr(torch, a))
    return {"x": x[:, ::2] if strided else x[:, :2].contiguous(), "y": torch.zeros(4, dtype=getattr(torch, b))}


def fill(reg, a: str, b: str):
    fb = SimpleNamespace(x=torch.ones(2, 2, dtype=getattr(torch, a)), y=torch.ones(2, dtype=getattr(torch, b)))
    reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=2, padded_num_tokens=3)
    return [reg.slot(name).buffer.tolist() for name in ("x", "y")]


@pytest.mark.parametrize("how", ["buffers", "adopt"])
def test_a_strided_tensor_is_refused_at_build_naming_the_slot_in_both_modes(how):
    for a, b in itertools.product(DTYPES, DTYPES):
        for mode in MODES:
            with pytest.raises(gs.SlotError) as err:
                gs.build_registry(spec(a, b), max_bs=4, max_num_tokens=4, impl=mode, **{how: tensors(a, b, strided=True)}, device="cpu")
            where = "spec 'pair', slot 'x'" if how == "buffers" else "slot 'x'"  # adopt names no spec
            assert str(err.value) == (
                f"{where}: {how}= holds a non-contiguous tensor (shape [4, 2], strides [4, 2]); "
                "pass a contiguous tensor (.contiguous() gives one)"), (a, b, mode)
        filled = [fill(gs.build_registry(spec(a, b), max_bs=4, max_num_tokens=4, impl=mode, **{how: tensors(a, b, strided=False)}, device="cpu"), a, b)
                  for mode in MODES]
        assert filled[0] == filled[1], (a, b)
