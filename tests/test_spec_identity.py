"""A generated module records its spec's meaning, not its bytes (issue 22).

``RegistrySpec.identity`` hashes the canonical form of the validated spec: CRLF line
endings, comments, key order, quoting and descriptions leave it (and so the checked-in
modules and ``graphslot generate --check``) alone; every change of meaning changes it,
and the checked-in module then refuses to run with "run `graphslot generate`".
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import graphslot as gs
from graphslot.cli.aot import generate
from graphslot.spec.loading import SHIPPED_DIR
from graphslot.spec.project import load_project_config
from graphslot.spec.yaml_loader import load_yaml
from graphslot.generated import decode_default, decode_eager, prefill_default
from graphslot.api import build

REPO = Path(__file__).resolve().parent.parent
SHIPPED = {name: (SHIPPED_DIR / f"{name}.yaml").read_text(encoding="utf-8")
           for name in ("decode", "prefill", "vllm")}
LABEL = "graphslot/slot_specs/{}.yaml"


def _data(text: str) -> dict[str, Any]:
    return load_yaml(text, "x.yaml").data


def _reversed(value: Any) -> Any:
    """Every mapping with its keys in reverse order (lists keep theirs: slot order is meaning)."""
    if isinstance(value, dict):
        return {k: _reversed(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed(v) for v in value]
    return value


def _described(value: Any, depth: int = 0, under: str = "") -> Any:
    """Every description of the spec, its params and its slots rewritten or dropped (``under``: the spec's key
    the value sits under; a preset maps params to values, and has no description)."""
    if isinstance(value, list):
        return [_described(v, depth, under) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _described(v, depth + 1, k if depth == 0 else under) for k, v in value.items() if k != "description"}
    if (depth == 0 or depth == 2 and under != "presets") and len(out) % 2:  # some get a new one
        out["description"] = "Something else entirely.\nOver two lines, with 'quotes' and # signs."
    return out


def _commented(text: str) -> str:
    """Comment lines before every slot and trailing comments after plain values."""
    text = re.sub(r"(?m)^(  - name:)", "  # a comment before a slot\n\\1", text)
    return re.sub(r"(?m)^(    (?:dtype|axis|padding): [A-Za-z0-9_]+)$", r"\1  # a trailing comment", text)


# Edits that keep the meaning: each gives the identity of the file as shipped.
SAME_MEANING: dict[str, Callable[[str], str]] = {
    "crlf": lambda t: t.replace("\n", "\r\n"),
    "comments": _commented,
    "comments-and-crlf": lambda t: _commented(t).replace("\n", "\r\n"),
    "descriptions": lambda t: yaml.safe_dump(_described(_data(t)), sort_keys=False),
    "keys-reversed": lambda t: yaml.safe_dump(_reversed(_data(t)), sort_keys=False),
    "keys-sorted": lambda t: yaml.safe_dump(_data(t), sort_keys=True),
    "json-quoting": lambda t: json.dumps(_data(t), indent=2),  # JSON is YAML: every string double-quoted
    "flow-style": lambda t: yaml.safe_dump(_data(t), default_flow_style=True, width=60),
}


def test_the_edits_that_keep_the_meaning_really_change_the_text():
    for name, text in SHIPPED.items():
        for kind, edit in SAME_MEANING.items():
            assert edit(text) != text, (name, kind)
        assert "\r\n" in SAME_MEANING["crlf"](text) and "# a trailing comment" in SAME_MEANING["comments"](text)
        described = _data(SAME_MEANING["descriptions"](text))
        assert described.get("description") != _data(text).get("description")


@pytest.mark.parametrize("kind", sorted(SAME_MEANING))
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_same_meaning_same_identity(name, kind):
    shipped = gs.parse_spec(SHIPPED[name], LABEL.format(name))
    edited = gs.parse_spec(SAME_MEANING[kind](SHIPPED[name]), LABEL.format(name))
    assert edited.text != shipped.text
    assert edited.identity == shipped.identity
    assert edited.canonical_json() == shipped.canonical_json()


MODULES = [("decode", decode_default, None), ("decode", decode_eager, "eager"), ("prefill", prefill_default, None)]


@pytest.mark.parametrize("kind", sorted(SAME_MEANING))
def test_the_committed_modules_still_run_under_every_such_edit(kind):
    for name, module, preset in MODULES:
        spec = gs.parse_spec(SAME_MEANING[kind](SHIPPED[name]), LABEL.format(name))
        assert module.SPEC_IDENTITY == spec.identity
        reg = build(spec, max_bs=4, max_num_tokens=8, impl=module, preset=preset, device="cpu")
        fb = type("Batch", (), {})()
        for slot in reg.active:
            if slot.resolved.plain_copy:
                shape = list(slot.resolved.shape)
                if slot.resolved.axis != "none":
                    shape[slot.resolved.slice_dim] = 2
                setattr(fb, slot.name, torch.ones(shape, dtype=slot.resolved.dtype))
        reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
        assert reg.extract(fb, padded_bs=4, padded_num_tokens=4).batch_size == 4


def _copy_repo_project(root: Path, spec_edit: Callable[[str], str] = lambda t: t,
                       module_edit: Callable[[str], str] = lambda t: t) -> Path:
    """This repository's [tool.graphslot] project (pyproject, shipped specs, committed
    modules) under ``root``, the specs and modules edited."""
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "graphslot" / "slot_specs").mkdir(parents=True)
    for name, text in SHIPPED.items():
        (root / LABEL.format(name)).write_bytes(spec_edit(text).encode("utf-8"))
    (root / "graphslot" / "generated").mkdir()
    for path in sorted((REPO / "graphslot" / "generated").glob("*.py")):
        (root / "graphslot" / "generated" / path.name).write_bytes(module_edit(path.read_text("utf-8")).encode())
    return root


@pytest.mark.parametrize("kind", sorted(SAME_MEANING))
def test_generate_check_is_clean_under_every_such_edit_of_the_specs(tmp_path, kind):
    root = _copy_repo_project(tmp_path, spec_edit=SAME_MEANING[kind])
    config = load_project_config(root)
    report = generate(config.root, config.raw, check=True)
    assert report.problems == [], "\n".join(report.diffs)
    assert len(report.unchanged) == 6


def _crlf(text: str) -> str:
    return text.replace("\n", "\r\n")


def test_a_crlf_checkout_of_everything_is_current_and_left_alone(tmp_path):
    """core.autocrlf=true: specs, pyproject and generated modules all with CRLF."""
    root = _copy_repo_project(tmp_path, spec_edit=_crlf, module_edit=_crlf)
    (root / "pyproject.toml").write_bytes(_crlf((REPO / "pyproject.toml").read_text("utf-8")).encode())
    before = {p: p.read_bytes() for p in (root / "graphslot" / "generated").iterdir()}
    assert all(b"\r\n" in data for data in before.values())
    config = load_project_config(root)
    assert generate(config.root, config.raw, check=True).problems == []
    report = generate(config.root, config.raw)
    assert report.written == [] and report.removed == [] and len(report.unchanged) == 6
    assert {p: p.read_bytes() for p in before} == before  # not rewritten


def test_a_crlf_module_with_a_real_difference_is_still_stale(tmp_path):
    root = _copy_repo_project(tmp_path, module_edit=_crlf)
    module = root / "graphslot" / "generated" / "decode_default.py"
    module.write_bytes(module.read_bytes().replace(b"max_bs, 2", b"max_bs, 3") + b"# edited\r\n")
    config = load_project_config(root)
    report = generate(config.root, config.raw, check=True)
    assert report.problems == ["stale: graphslot/generated/decode_default.py"]
    assert "-# edited\n" in report.diffs[0] and "\r" not in report.diffs[0]
    assert generate(config.root, config.raw).written == [module]
    assert module.read_bytes() == (REPO / "graphslot" / "generated" / "decode_default.py").read_bytes()


def test_a_crlf_module_imports_and_runs(tmp_path, monkeypatch):
    package = tmp_path / "crlf_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = (REPO / "graphslot" / "generated" / "decode_default.py").read_text("utf-8")
    (package / "decode_crlf.py").write_bytes(_crlf(source).encode())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "crlf_pkg", raising=False)
    module = importlib.import_module("crlf_pkg.decode_crlf")
    try:
        spec = gs.parse_spec(_crlf(SHIPPED["decode"]), LABEL.format("decode"))
        reg = gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=module, params={"seq_len_fill_value": 3},
                                device="cpu")
        assert reg.slot("seq_lens").buffer.tolist() == [3, 3, 3, 3]
    finally:
        sys.modules.pop("crlf_pkg.decode_crlf", None)
        sys.modules.pop("crlf_pkg", None)


# --- every change of meaning changes the identity -------------------------------------------


def _slot(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in data["slots"] if s["name"] == name)


def _set(slot: str, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        _slot(data, slot).update(changes)
    return edit


def _param(param: str, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["params"][param].update(changes)
    return edit


def _swap_first_slots(data: dict[str, Any]) -> None:
    data["slots"][0], data["slots"][1] = data["slots"][1], data["slots"][0]


def _drop_key(name: str, key: str) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        del _slot(data, name)[key]
    return edit


MEANING: dict[str, Callable[[dict[str, Any]], None]] = {
    "spec name": lambda d: d.update(name="decode2"),
    "slot name": _set("input_ids", name="input_ids2"),
    "shape": _set("global_num_tokens_gpu", shape=["dp_size if require_mlp_tp_gather else 2"]),
    "trailing extent": _set("req_pool_indices", shape=["max_bs", 1]),
    "dtype": _set("input_ids", dtype="int32"),
    "dtype param": _set("out_cache_loc", dtype="encoder_lens_dtype"),
    "axis": _set("input_ids", axis="bs", shape=["max_bs"]),
    "slice_dim": _set("mrope_positions", shape=["max_num_tokens", 3], slice_dim=0),
    "policy": _set("input_ids", padding="keep_pad"),
    "pad value": _set("seq_lens", pad_value=2),
    "pad value int to float": _set("seq_lens", pad_value=1.0),
    "pad value expression": _set("seq_lens", pad_value="seq_len_fill_value + 1"),
    "device": _drop_key("seq_lens_cpu", "device"),
    "optional": _set("input_ids", optional=True),
    "index": _set("req_pool_indices", index=False),
    "enabled_if": _set("mamba_track_indices", enabled_if="enable_mamba_track or is_hybrid_swa"),
    "enabled_if literal": _set("mamba_track_indices", enabled_if=True),
    "copy_from_fb": _set("input_ids", copy_from_fb=False),
    "post_fill hook": _set("global_num_tokens_gpu", post_fill="my_hook"),
    "pre_capture hook": _set("out_cache_loc_swa", pre_capture="my_hook"),
    "source hook": _set("input_ids", source="my_source"),
    "param type": _param("seq_len_fill_value", type="float", default=1.0),
    "param default": _param("seq_len_fill_value", default=2),
    "param default expression": _param("attn_tp_sharded", default="require_gathered_buffer or is_hybrid_swa"),
    "param runtime": _param("encoder_len_fill_value", runtime=False),
    "new param": lambda d: d["params"].update(extra={"type": "int", "default": 0}),
    "preset value": lambda d: d["presets"]["eager"].update(seq_len_fill_value=2),
    "preset added": lambda d: d["presets"].update(other={"dp_size": 2}),
    "slot order": _swap_first_slots,
    "slot dropped": lambda d: d["slots"].pop(0),
}


def _edited(name: str, edit: Callable[[dict[str, Any]], None]) -> gs.RegistrySpec:
    data = _data(SHIPPED[name])
    edit(data)
    return gs.parse_spec(json.dumps(data, indent=1), LABEL.format(name))


@pytest.mark.parametrize("change", sorted(MEANING))
def test_every_change_of_meaning_changes_the_identity_and_the_module_refuses(change):
    shipped = gs.parse_spec(SHIPPED["decode"], LABEL.format("decode"))
    spec = _edited("decode", MEANING[change])
    assert spec.identity != shipped.identity
    with pytest.raises(gs.SpecError) as info:
        gs.build_registry(spec, max_bs=8, max_num_tokens=8, impl=decode_default, hooks={"my_hook": lambda *a: None,
                                                                   "my_source": lambda *a: None}, device="cpu")
    message = str(info.value)
    assert (f"generated module 'graphslot.generated.decode_default' was generated from another version of "
            f"graphslot/slot_specs/decode.yaml (identity {shipped.identity[:12]}…, the spec is now "
            f"{spec.identity[:12]}…); run `graphslot generate`") in message


def test_the_identities_of_all_those_changes_differ_from_each_other():
    identities = {change: _edited("decode", edit).identity for change, edit in MEANING.items()}
    assert len(set(identities.values())) == len(identities)


@pytest.mark.parametrize("a, b", [("0.0", "-0.0"), (".inf", "-.inf"), (".nan", ".inf"), ("1", "1.0"),
                                  ("1.0e+308", ".inf"), ("5.0e-324", "0.0")])
def test_float_pad_values_that_differ_give_different_identities(a, b):
    def spec(value: str) -> gs.RegistrySpec:
        return gs.parse_spec("name: f\nslots:\n  - {name: x, shape: [max_bs], dtype: float64, axis: bs, "
                             f"padding: fill_sentinel, pad_value: {value}}}\n", "f.yaml")

    assert spec(a).identity != spec(b).identity
    assert spec(a).identity == spec(a).identity and spec(b).identity == spec(b).identity  # nan included


def test_the_canonical_form_is_plain_data_without_descriptions():
    spec = gs.parse_spec(SHIPPED["decode"], LABEL.format("decode"))
    canonical = spec.canonical()
    assert "description" not in canonical
    assert all("description" not in p for p in canonical["params"].values())
    assert all("description" not in s for s in canonical["slots"])
    assert [s["name"] for s in canonical["slots"]] == [s.name for s in spec.slots]
    assert json.loads(spec.canonical_json()) == canonical  # plain data: embeddable as a literal
    assert spec.canonical_json().isascii() and "\n" not in spec.canonical_json()


def test_a_param_or_preset_named_description_is_meaning():
    text = ("name: d\nparams:\n  description: {type: int, default: 1, description: free text}\n"
            "presets:\n  p: {description: 2}\nslots:\n"
            "  - {name: x, shape: [max_bs], dtype: int64, axis: bs, padding: fill_sentinel, pad_value: description}\n")
    spec = gs.parse_spec(text, "d.yaml")
    assert spec.canonical()["params"] == {"description": {"type": "int", "default": 1, "runtime": False}}
    assert spec.canonical()["presets"] == {"p": {"description": 2}}
    assert gs.parse_spec(text.replace("default: 1", "default: 3"), "d.yaml").identity != spec.identity
    assert gs.parse_spec(text.replace("free text", "other"), "d.yaml").identity == spec.identity
