"""Non-finite and extreme float pad values reach generated source as Python (issue 22).

``pad_value: -.inf`` (the usual pad of a float mask) and ``.nan`` validate for float
slots; generated code must write them as ``float("-inf")`` / ``float("nan")`` — in pad
constants, folded expressions, ``PARAMS`` and the banner — never as a bare ``inf``, a
NameError at import. Both modes then fill the same bits (tests/test_codegen_differential.py
compares them bit for bit, regression ``non_finite_pad_values``). Integer and bool slots
refuse a non-finite value when the spec is validated, with its line.
"""

from __future__ import annotations

import importlib
import io
import math
import sys
import textwrap
import tokenize

import pytest
import torch

import graphslot as gs
from graphslot.codegen.generator import render_module
from graphslot.codegen.inprocess import compile_module

SPEC = textwrap.dedent("""\
    name: masks
    params:
      big: {type: float, default: 1.0e+308}
      neg: {type: float, default: -.inf}
      nanp: {type: float, default: .nan}
      rt: {type: float, default: .inf, runtime: true}
    slots:
      - {name: mask, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: -.inf}
      - {name: logit, shape: [max_num_tokens, 2], dtype: float32, axis: tokens, padding: fill_sentinel,
         pad_value: .nan}
      - {name: once, shape: [max_bs], dtype: float64, axis: bs, padding: fill_once, pad_value: "big * 10"}
      - {name: baked, shape: [max_bs], dtype: bfloat16, axis: bs, padding: fill_sentinel, pad_value: "neg"}
      - {name: folded, shape: [max_bs], dtype: float64, axis: bs, padding: fill_sentinel, pad_value: "nanp + 1"}
      - {name: runtime, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: "rt"}
      - {name: zero, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: -0.0}
      - {name: tiny, shape: [max_bs], dtype: float64, axis: bs, padding: fill_sentinel, pad_value: 5.0e-324}
      - {name: huge, shape: [max_bs], dtype: float64, axis: bs, padding: fill_sentinel,
         pad_value: -1.7976931348623157e+308}
""")
# What each slot's padded rows hold (the runtime one with the default param).
TAILS = {"mask": -math.inf, "logit": math.nan, "once": math.inf, "baked": -math.inf, "folded": math.nan,
         "runtime": math.inf, "zero": -0.0, "tiny": 5e-324, "huge": -1.7976931348623157e308}


def _code_names(text: str) -> set:
    return {t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME}


def test_the_rendered_module_writes_non_finite_floats_as_python():
    spec = gs.parse_spec(SPEC, "masks.yaml")
    text = render_module(spec, gs.resolve_params(spec))
    assert not {"inf", "nan", "Infinity", "NaN"} & _code_names(text)  # every one is a float('...') call
    assert 'pad_dev_float32_bs_neginf = torch.full(\n        (max_bs,), float("-inf"), dtype=torch.float32' in text
    assert 'padval_logit = float("nan")' in text  # a 2-D tail is filled, with the one quiet NaN
    assert '"once": new_buffer("once", (max_bs,), torch.float64, device, float("inf"))' in text  # 1e308 * 10
    assert 'PARAMS = {\n    "big": 1e+308,\n    "nanp": float("nan"),\n    "neg": float("-inf"),\n}\n' in text
    assert "# params:   big=1e+308\n#           nanp=float('nan')\n#           neg=float('-inf')\n" in text  # banner
    assert 'float("nan")' in text.split("def bind", 1)[1]  # nanp + 1 folded to a NaN


def test_the_module_compiles_and_both_modes_fill_the_same_values():
    spec = gs.parse_spec(SPEC, "masks.yaml")
    module = compile_module(spec, gs.resolve_params(spec))
    assert math.isinf(module.PARAMS["neg"]) and math.isnan(module.PARAMS["nanp"])
    for mode in ("interpreted", "generated"):
        reg = gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=mode, device="cpu")
        fb = type("Batch", (), {})()
        for slot in reg.active:
            setattr(fb, slot.name, torch.full((1,) + tuple(slot.buffer.shape[1:]), 7.0, dtype=slot.resolved.dtype))
        reg.fill_from(fb, raw_bs=1, padded_bs=3, raw_num_tokens=1, padded_num_tokens=3)
        for name, value in TAILS.items():
            buffer = reg.slot(name).buffer.double()
            assert buffer[0].flatten().tolist() == [7.0] * buffer[0].numel(), (mode, name)
            for got in buffer[1:3].flatten().tolist():
                expected = float(torch.tensor(value, dtype=reg.slot(name).resolved.dtype).double())
                assert (math.isnan(got) and math.isnan(expected)) or (
                    got == expected and math.copysign(1, got) == math.copysign(1, expected)), (mode, name, got)


def test_a_runtime_param_takes_a_non_finite_value_in_both_modes():
    spec = gs.parse_spec(SPEC, "masks.yaml")
    for mode in ("interpreted", "generated"):
        reg = gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=mode, params={"rt": -math.inf}, device="cpu")
        assert reg.slot("runtime").buffer.tolist() == [-math.inf] * 4, mode  # allocated with its pad value
        reg.slot("runtime").buffer.fill_(5.0)
        fb = type("Batch", (), {})()
        for slot in reg.active:
            setattr(fb, slot.name, torch.zeros((1,) + tuple(slot.buffer.shape[1:]), dtype=slot.resolved.dtype))
        reg.fill_from(fb, raw_bs=1, padded_bs=4, raw_num_tokens=1, padded_num_tokens=4)
        assert reg.slot("runtime").buffer.tolist() == [0.0] + [-math.inf] * 3, mode


def test_graphslot_generate_writes_a_module_that_imports_and_runs(tmp_path, monkeypatch, capsys):
    from graphslot.cli import main

    (tmp_path / "masks.yaml").write_text(SPEC)
    (tmp_path / "pyproject.toml").write_text('[tool.graphslot]\noutput_dir = "gen_masks"\n\n'
                                             '[[tool.graphslot.outputs]]\nmodule = "masks"\nspec = "masks.yaml"\n')
    monkeypatch.chdir(tmp_path)
    assert main(["generate"]) == 0 and main(["generate", "--check"]) == 0
    capsys.readouterr()
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module("gen_masks.masks")
        reg = gs.build_registry(gs.load_spec(tmp_path / "masks.yaml"), max_bs=2, max_num_tokens=2, impl=module,
                                device="cpu")
        assert reg.slot("once").buffer.tolist() == [math.inf, math.inf]
    finally:
        sys.modules.pop("gen_masks.masks", None)
        sys.modules.pop("gen_masks", None)


def test_a_module_built_for_a_nan_param_accepts_that_nan():
    spec = gs.parse_spec(SPEC, "masks.yaml")
    module = compile_module(spec, gs.resolve_params(spec))
    # any NaN is the one NaN
    reg = gs.build_registry(spec, max_bs=2, max_num_tokens=2, impl=module, params={"nanp": -math.nan}, device="cpu")
    assert reg.module is module
    with pytest.raises(gs.SpecError, match=r"nanp \(module: float\('nan'\), registry: float\('inf'\)\)"):
        gs.build_registry(spec, max_bs=2, max_num_tokens=2, impl=module, params={"nanp": math.inf}, device="cpu")


NAN_SPEC = textwrap.dedent("""\
    name: nans
    params:
      p: {type: float, default: .nan}
    presets:
      alt: {p: .nan}
    slots:
      - {name: lit, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: .nan}
      - {name: par, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: p}
      - {name: once, shape: [max_bs], dtype: float32, axis: bs, padding: fill_once, pad_value: .nan,
         copy_from_fb: false}
""")


def _tail_bits(reg) -> dict:
    fb = type("Batch", (), {})()
    for name in ("lit", "par"):
        setattr(fb, name, torch.zeros(1))
    reg.fill_from(fb, raw_bs=1, padded_bs=4, raw_num_tokens=1, padded_num_tokens=4)
    return {name: reg.slot(name).buffer[1:].view(torch.int32).tolist() for name in ("lit", "par", "once")}


def test_a_nan_pad_value_is_the_same_bits_in_every_mode_and_from_a_modules_embedded_spec():
    """YAML's ``.nan`` has its sign bit set, JSON's NaN (a module's embedded spec) not:
    a spec holds the one quiet NaN, so a generated module and the interpreter built from
    its embedded spec write the same bits (issue 37)."""
    spec = gs.parse_spec(NAN_SPEC, "nans.yaml")
    module = compile_module(spec, gs.resolve_params(spec))
    from_code = gs.spec_from_dict(dict(spec.to_dict(), params={"p": {"type": "float", "default": -math.nan}}))
    positive = torch.tensor(math.nan, dtype=torch.float32).view(torch.int32).item()
    assert positive == 0x7FC00000
    expected = {name: [positive] * 3 for name in ("lit", "par", "once")}
    builds = {"yaml": lambda mode: gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=mode, device="cpu"),
              "module": lambda mode: gs.build_registry(module, max_bs=4, max_num_tokens=4, impl=mode, device="cpu"),
              "code": lambda mode: gs.build_registry(from_code, max_bs=4, max_num_tokens=4, impl=mode, device="cpu"),
              "preset": lambda mode: gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=mode,
                                                       params=spec.presets["alt"], device="cpu"),
              "param": lambda mode: gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=mode,
                                                      params={"p": -math.nan}, device="cpu")}
    for source, build in builds.items():
        for mode in ("interpreted", "generated"):
            assert _tail_bits(build(mode)) == expected, (source, mode)


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_two_registries_share_a_pool_whose_slots_pad_with_nan(mode):
    """A NaN pad is the same initial value for both registries of a pool (``nan != nan`` refused the second with
    'was first registered with initial value nan, this registry needs nan')."""
    spec = gs.parse_spec(SPEC, "masks.yaml")
    pool = gs.BufferPool()
    first = gs.build_registry(spec, device="cpu", max_bs=4, max_num_tokens=4, buffers=pool, impl=mode)
    second = gs.build_registry(spec, device="cpu", max_bs=4, max_num_tokens=4, buffers=pool, impl=mode)
    for name in ("logit", "folded", "mask"):
        assert second.slot(name).buffer.data_ptr() == first.slot(name).buffer.data_ptr()
