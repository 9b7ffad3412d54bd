"""One device op per padded fill: the GPU fast path of generated fill_from.

On CUDA every op that writes a device buffer is a kernel launch. Generated code puts
every head copy, tail reset (2-D ``[:, raw:padded]`` tails as rows) and step-count
computed slot of the registry's device into one ``_foreach_copy_``; with several dtypes
the tensors are reinterpreted as one integer carrier dtype, and a source of another
dtype or layout takes the typed copies instead (cast as ``copy_`` does, never
reinterpreted). Counted here with a dispatch mode over the ops that write the device
buffers, for the shipped specs under the param combinations the differential tests
use; the buffers are compared with the interpreter's byte for byte.
"""

from types import SimpleNamespace

import pytest
import torch

import graphslot as gs
from graphslot.cli.fill_bench import count_device_ops

from test_codegen_differential import SHIPPED
from graphslot.api import build

SIZES = [(3, 4, 3, 4), (5, 8, 11, 16), (0, 2, 0, 2), (2, 8, 7, 12)]  # padded: raw < padded


def batch_for(reg, raw_bs, raw_num_tokens, seed, mrope=True, **overrides):
    """A batch carrying every copied field at the step's raw size, of the buffer's dtype."""
    gen = torch.Generator().manual_seed(seed)
    fb = SimpleNamespace()
    for slot in reg.checker.plain:
        if slot.resolved.optional and slot.name == "mrope_positions" and not mrope:
            continue
        shape = list(slot.buffer.shape)
        count = slot.count(raw_bs, raw_num_tokens)
        if count is not None:
            shape[slot.resolved.slice_dim] = count
        setattr(fb, slot.name, torch.randint(1, 100, shape, generator=gen).to(slot.buffer.dtype))
    for name, value in overrides.items():
        setattr(fb, name, value)
    return fb


def pair(name, params, preset):
    return [build(name, max_bs=8, max_num_tokens=16, impl=mode, params=params, preset=preset, device="cpu")
            for mode in ("interpreted", "generated")]


def assert_same_bytes(interp, gen):
    for a, b in zip(interp.active, gen.active):
        assert torch.equal(a.buffer, b.buffer), f"slot {a.name}: {a.buffer.tolist()} vs {b.buffer.tolist()}"


def expected_device_ops(reg):
    """One grouped copy, plus a fill for each reset-only tail wider than one element per
    row (prefill's input_embeds: a constant pad as large as the buffer would double its
    memory, so it keeps its own fill)."""
    wide = [s for s in reg.active if not s.resolved.host and s.resolved.resets_tail and len(s.buffer.shape) > 1
            and s.resolved.slice_dim == 0]
    return 1 + len(wide)


@pytest.mark.parametrize("case", sorted(SHIPPED))
@pytest.mark.parametrize("mrope", [True, False])
def test_one_device_op_per_padded_fill_and_the_interpreters_bytes(case, mrope):
    name, params, preset = SHIPPED[case]
    interp, gen = pair(name, params, preset)
    for i, (rb, pb, rt, pt) in enumerate(SIZES):
        fb = batch_for(gen, rb, rt, seed=i, mrope=mrope)
        ops = count_device_ops(gen, fb, rb, pb, rt, pt)
        assert len(ops) == expected_device_ops(gen), (case, (rb, pb, rt, pt), ops)
        assert ops[0] == "_foreach_copy_"
        interp.fill_from(fb, raw_bs=rb, padded_bs=pb, raw_num_tokens=rt, padded_num_tokens=pt)
        assert_same_bytes(interp, gen)


def test_the_interpreter_issues_more_device_ops_than_generated_code():
    """What the fusion saves on the shipped decode spec with multimodal rope positions."""
    interp, gen = pair("decode", {}, None)
    fb = batch_for(gen, 3, 3, seed=0)
    assert len(count_device_ops(gen, fb, 3, 4, 3, 4)) == 1
    assert len(count_device_ops(interp, fb, 3, 4, 3, 4)) >= 4  # copies, then a reset per slot


MIXED = {"cache_loc_dtype": "int32", "enable_mamba_track": True, "is_encoder_decoder": True,
         "require_gathered_buffer": True, "encoder_len_fill_value": 2}


@pytest.mark.parametrize("wrong", ["dtype_same_itemsize", "dtype_other_itemsize", "strided"])
def test_a_source_of_another_dtype_or_layout_is_cast_not_reinterpreted(wrong):
    """int64, int32 and bool slots share one copy through an integer carrier; a source
    that is not the slot's dtype (a float32 for an int32 slot has the same itemsize) or
    not contiguous goes through typed copies, with the interpreter's bytes."""
    interp, gen = pair("decode", MIXED, None)
    base = batch_for(gen, 3, 3, seed=1)
    fast = count_device_ops(gen, base, 3, 4, 3, 4)
    assert len(fast) == 1
    if wrong == "dtype_same_itemsize":
        bad = {"encoder_lens": torch.tensor([2.0, 3.0, 40.0])}  # int32 slot; bits would be 1073741824...
    elif wrong == "dtype_other_itemsize":
        bad = {"out_cache_loc": torch.tensor([7, 8, 9], dtype=torch.int64)}  # int32 slot
    else:
        bad = {"input_ids": torch.arange(6, dtype=torch.int64)[::2]}
    fb = batch_for(gen, 3, 3, seed=1, **bad)
    gen.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    interp.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert_same_bytes(interp, gen)
    name, value = next(iter(bad.items()))
    assert gen.slot(name).buffer[:3].tolist() == value.to(gen.slot(name).buffer.dtype).tolist()


def test_the_step_count_of_gathered_buffers_rides_in_the_grouped_copy():
    interp, gen = pair("decode", {"require_gathered_buffer": True}, None)
    fb = batch_for(gen, 3, 3, seed=2)
    assert count_device_ops(gen, fb, 3, 4, 3, 4) == ["_foreach_copy_"]
    assert gen.slot("global_num_tokens_gpu").buffer.tolist() == [4]
    gen.fill_from(batch_for(gen, 5, 5, seed=3), raw_bs=5, padded_bs=8, raw_num_tokens=5, padded_num_tokens=8)
    assert gen.slot("global_num_tokens_for_logprob_gpu").buffer.tolist() == [8]


def test_a_hook_computing_on_the_device_keeps_its_own_ops_and_writes_only_its_slot():
    """local_num_token_non_padded clamps the batch's device count (a kernel that must run
    after the batch's count exists): the one exception, and it writes only its slot."""
    _, gen = pair("decode", {"enable_num_token_non_padded": True}, None)
    fb = batch_for(gen, 3, 3, seed=4, global_num_token_non_padded=torch.tensor(9, dtype=torch.int32))
    ops = count_device_ops(gen, fb, 3, 4, 3, 4)
    assert ops[0] == "_foreach_copy_" and len(ops) == 2
    assert gen.slot("num_token_non_padded").buffer.tolist() == [4]  # clamped to the padded count


def test_a_contiguous_source_without_a_unit_last_stride_is_not_reinterpreted():
    """A ``[n, 1]`` source may have any last stride and still be contiguous, but only a
    unit stride can be viewed as another dtype (found by the differential property)."""
    spec = gs.parse_spec(
        "name: unit\nslots:\n"
        "- {name: flags, shape: [max_bs], dtype: bool, axis: bs, padding: zero}\n"
        "- {name: scale, shape: [max_bs, 1], dtype: float32, axis: bs, padding: keep_pad}\n", "unit.yaml")
    interp, gen = (gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl=mode, device="cpu")
                   for mode in ("interpreted", "generated"))
    scale = torch.as_strided(torch.tensor([1.5, 2.5, 3.5]), (3, 1), (1, 0))
    assert scale.is_contiguous() and scale.stride(-1) == 0
    fb = SimpleNamespace(flags=torch.tensor([True, False, True]), scale=scale)
    for reg in (interp, gen):
        reg.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert_same_bytes(interp, gen)
    assert gen.slot("scale").buffer[:3, 0].tolist() == [1.5, 2.5, 3.5]


@pytest.mark.parametrize("mode", ["interpreted", "generated"])
def test_a_row_copied_slot_judges_a_source_overlapping_its_own_buffer_row_by_row(mode):
    """Both modes copy a ``[L, capacity]`` head as rows, so copy_ refuses a source that
    partially overlaps the buffer the same way in both, and both name the slot (a 2-D copy
    would not notice, while the rows of the grouped copy do; found by the differential
    property)."""
    spec = gs.parse_spec(
        "name: rows\nslots:\n"
        "- {name: flags, shape: [max_bs], dtype: bool, axis: bs, padding: zero, device: cpu}\n"
        "- {name: pos, shape: [2, max_bs], dtype: bool, axis: bs, slice_dim: 1, padding: keep_pad}\n",
        "rows.yaml")
    reg = gs.build_registry(spec, max_bs=3, max_num_tokens=1, impl=mode, device="cpu")
    assert reg.slot("pos").resolved.rows
    host = gs.parse_spec("name: rows\nslots:\n- {name: pos, shape: [2, max_bs], dtype: bool, axis: bs, slice_dim: 1, "
                         "padding: keep_pad, device: cpu}\n", "host.yaml")
    # a host copy is 2-D in both
    assert not gs.build_registry(host, max_bs=3, max_num_tokens=1, impl=mode, device="cpu").slot("pos").resolved.rows
    shifted = reg.slot("pos").buffer[:, 1:3]  # the buffer's own columns 1-2 into columns 0-1
    fb = SimpleNamespace(flags=torch.tensor([True, False]), pos=shifted)
    with pytest.raises(gs.SlotError, match="slot 'pos': the source aliases the buffer of slot 'pos'") as refused:
        reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=0, padded_num_tokens=0)
    assert "refer to a single memory location" in str(refused.value.__cause__)  # copy_'s refusal, named
    distinct = SimpleNamespace(flags=torch.tensor([True, False]), pos=torch.tensor([[True, False], [False, True]]))
    reg.fill_from(distinct, raw_bs=2, padded_bs=3, raw_num_tokens=0, padded_num_tokens=0)
    assert reg.slot("pos").buffer[:, :2].tolist() == [[True, False], [False, True]]
