"""A change to a spec changes the lines of the generated module that concern it, no others.

Generated modules are committed and reviewed as diffs, so their names do not depend on
positions: a pad constant is named by its device, dtype, axis and value
(``pad_dev_int64_bs_seq_len_fill_value``, not ``pad1_int64``), an expected shape by the
shape (``shape_tokens``), a plan field by its slot or copy group; and every list that
grows with the spec holds one item a line. The property, for a change C with a set N of
names it concerns (the slot added, the param changed and the slots that change enables
or disables):

    every line the unified diff of the two modules removes or adds either names a member
    of N (as a whole word of an identifier or string: ``buf_X``, ``src_X``, ``"X"``) or
    is a line the other module has too (a slice of a pad constant other slots share, a
    closing bracket, ``raise __gs_Mismatch``): no line is rewritten for anything else;

and adding a slot removes no line at all but the two that carry the spec's identity.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path
from typing import Iterable, List, Tuple

import pytest

import graphslot as gs
from graphslot.codegen.generator import render_module

REPO = Path(__file__).resolve().parent.parent
GENERATED = REPO / "graphslot" / "generated"
LABEL = "graphslot/slot_specs/decode.yaml"


def code_lines(text: str) -> List[str]:
    """The module's lines but its embedded spec (SPEC_JSON: data, a group of lines per
    param and slot whose diffs tests/test_embedded_spec.py holds to this property)."""
    lines = text.splitlines()
    if "SPEC_JSON = (" in lines:
        start = lines.index("SPEC_JSON = (")
        del lines[start:lines.index(")", start) + 1]
    return lines


def changed_lines(before: str, after: str) -> Tuple[List[str], List[str]]:
    """(removed, added) lines of the unified diff, the identity lines left out."""
    removed, added = [], []
    for line in list(difflib.unified_diff(code_lines(before), code_lines(after), n=0, lineterm=""))[2:]:
        if line.startswith("@@") or "identity" in line.lower() and re.search(r"[0-9a-f]{64}", line):
            continue
        (removed if line.startswith("-") else added).append(line[1:])
    return removed, added


def _names(line: str, names: Iterable[str]) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])", line) for n in names)


def foreign(before: str, after: str, names: Iterable[str]) -> List[str]:
    """The changed lines that break the property: they name nothing in ``names`` and the
    other module has no such line."""
    removed, added = changed_lines(before, after)
    names = list(names)
    lines_before, lines_after = set(before.splitlines()), set(after.splitlines())
    return ([f"-{line}" for line in removed if not _names(line, names) and line not in lines_after]
            + [f"+{line}" for line in added if not _names(line, names) and line not in lines_before])


def decode(params=None, text: str = None) -> str:
    spec = gs.parse_spec(text or gs.load_spec("decode").text, LABEL)
    return render_module(spec, gs.resolve_params(spec, params or {}), LABEL)


def with_slot(slot_yaml: str, before: str) -> str:
    """decode.yaml with ``slot_yaml`` inserted before the slot named ``before``."""
    text = gs.load_spec("decode").text
    marker = f"  - name: {before}\n"
    assert text.count(marker) == 1
    return text.replace(marker, slot_yaml + marker)


# Slots like decode's own (so they join its copy groups, pad constants and shapes), each
# inserted between two others.
NEW_SLOTS = {
    "copied": ("""  - name: token_type_ids
    shape: [max_num_tokens]
    dtype: int64
    axis: tokens
    padding: zero
""", "req_pool_indices"),
    "sentinel": ("""  - name: cached_lens
    shape: [max_bs]
    dtype: int64
    axis: bs
    padding: fill_sentinel
    pad_value: seq_len_fill_value
""", "seq_lens_cpu"),
    "host": ("""  - name: extend_lens_cpu
    shape: [max_bs]
    dtype: int64
    axis: bs
    device: cpu
    padding: fill_sentinel
    pad_value: seq_len_fill_value
""", "mrope_positions"),
    "optional": ("""  - name: draft_positions
    shape: [max_num_tokens]
    dtype: int64
    axis: tokens
    padding: zero
    optional: true
""", "positions"),
    "computed": ("""  - name: global_num_tokens_for_draft_gpu
    shape: [1]
    dtype: int32
    axis: none
    copy_from_fb: false
    post_fill: global_num_tokens
""", "global_num_tokens_for_logprob_gpu"),
}


@pytest.mark.parametrize("kind", sorted(NEW_SLOTS))
def test_adding_a_slot_only_adds_lines_that_name_it(kind):
    slot_yaml, before = NEW_SLOTS[kind]
    name = re.search(r"name: (\w+)", slot_yaml).group(1)
    old, new = decode(), decode(text=with_slot(slot_yaml, before))
    removed, added = changed_lines(old, new)
    assert removed == [], removed  # nothing rewritten
    assert sum(_names(line, [name]) for line in added) >= 4, added  # allocate, bind, read or view, ...
    assert foreign(old, new, [name]) == []


def test_the_committed_decode_modules_differ_only_where_the_preset_does():
    """decode_eager turns register_global_num_tokens off, which leaves the two
    global-num-tokens slots out (its other params change nothing generated)."""
    default = (GENERATED / "decode_default.py").read_text("utf-8")
    eager = (GENERATED / "decode_eager.py").read_text("utf-8")
    names = ["register_global_num_tokens", "global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu"]
    assert foreign(default, eager, names) == []
    removed, added = changed_lines(default, eager)
    assert added == ["#           register_global_num_tokens=False", '    "register_global_num_tokens": False,']


# (params before, params after, what the change concerns); changes that keep the device
# group's dtypes (a first int32 or bool slot there turns every int64 copy into an int32
# view: one kernel for all dtypes, a rewrite of those lines that names no one slot).
PARAM_CHANGES = {
    "unread param": ({}, {"enable_prefill_cp": True}, ["enable_prefill_cp"]),
    "unread int param": ({}, {"dp_size": 4}, ["dp_size"]),
    "a shape": ({"dp_size": 4}, {"dp_size": 4, "require_mlp_tp_gather": True},
                ["require_mlp_tp_gather", "global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu"]),
    "slots left out": ({}, {"register_global_num_tokens": False},
                       ["register_global_num_tokens", "global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu"]),
}


@pytest.mark.parametrize("change", sorted(PARAM_CHANGES))
def test_changing_a_param_changes_only_the_lines_that_name_it_or_its_slots(change):
    before, after, concerned = PARAM_CHANGES[change]
    old, new = decode(before), decode(after)
    removed, added = changed_lines(old, new)
    assert removed and added
    assert foreign(old, new, concerned) == []


def test_a_live_params_value_changes_nothing_generated():
    """Live params are read by hooks at each fill (ctx.params), never baked: any value,
    a provider included, gives the very same module."""
    assert decode({"attn_tp_rank": 1, "attn_tp_size": 4}) == decode()
    assert decode({"attn_tp_sharded": lambda ctx: True}) == decode()


def _definitions(text: str) -> dict:
    """name -> source of every local ``bind`` and ``make_plan`` assign (pad constants,
    dtypes, shapes, plan fields), as ``ast.unparse`` writes it."""
    bind = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "bind")
    plan = next(n for n in bind.body if isinstance(n, ast.FunctionDef) and n.name == "make_plan")
    return {n.targets[0].id: ast.unparse(n.value) for n in bind.body + plan.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_no_generated_name_shifts_when_a_param_enables_more_slots(name):
    """The bug this replaces: enabling a slot renumbered or resized the pad constants of
    others (``pad0_int64`` became ``pad1_int64``, or ``max(max_num_tokens, max_bs)``
    long). Now a name stands for one thing: every pad constant, dtype and expected shape
    a module defines is still defined, the same way, in the module of any param set
    that enables more slots."""
    spec = gs.load_spec(name)
    base = gs.resolve_params(spec)
    kept = {k: v for k, v in _definitions(render_module(spec, base, name)).items()
            if re.match(r"(pad_|dt_|shape_|val_|pad[0-9]|val[0-9]|rows[0-9])", k)}  # and the old names
    checked = 0
    for param, declared in spec.params.items():
        if declared.type != "bool" or declared.runtime:
            continue
        flipped = gs.resolve_params(spec, {param: not base[param]})
        slots = [set(gs.build_registry(spec, max_bs=4, max_num_tokens=4, params=p, impl="interpreted",
                                       device="cpu").slot_names())
                 for p in (base, flipped)]
        if slots[0] == slots[1] or not slots[0] <= slots[1]:
            continue
        after = _definitions(render_module(spec, flipped, name))
        assert {k: after.get(k) for k in kept} == kept, param
        checked += 1
    assert checked >= 3
