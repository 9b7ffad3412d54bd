"""Generated ``fill_from`` copies sources as data (issue 22).

The contract: both modes perform every copy and reset with autograd disabled, so a source
with ``requires_grad=True`` is copied by value and no buffer ever requires grad or records
history. These are the generated-mode checks, over every way generated code writes a
buffer: the device group's ``_foreach_copy_`` (one dtype, and mixed dtypes through a
carrier), host slots, 2-D slots copied and reset on their own, and source hooks.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import graphslot as gs

SPEC = textwrap.dedent("""\
    name: grads
    slots:
      - {name: mask, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: -.inf}
      - {name: rows, shape: [max_bs, 2], dtype: float32, axis: bs, padding: zero}
      - {name: ids, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
      - {name: host, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: 2.0,
         device: cpu}
      - {name: embeds, shape: [max_num_tokens, 3], dtype: float32, axis: tokens, padding: keep_pad,
         source: embeds_source}
""")
ALONE = textwrap.dedent("""\
    name: alone
    slots:
      - {name: mask, shape: [max_bs], dtype: float32, axis: bs, padding: fill_sentinel, pad_value: -.inf}
""")


class Batch:
    pass


def _batch(step: int, requires_grad: bool) -> Batch:
    fb = Batch()
    base = float(step + 1)
    fb.mask = torch.full((2,), base, requires_grad=requires_grad)
    fb.rows = (torch.full((2, 2), base, requires_grad=requires_grad) * 2)  # a non-leaf with history
    fb.ids = torch.tensor([step, step + 1])
    fb.host = torch.full((2,), base, requires_grad=requires_grad)
    fb.embeds = torch.full((3, 3), base, requires_grad=requires_grad)
    return fb


def _registry(text: str = SPEC) -> gs.SlotRegistry:
    spec = gs.parse_spec(text, "grads.yaml")
    reg = gs.build_registry(spec, max_bs=4, max_num_tokens=4, impl="generated",
                            hooks={"embeds_source": lambda fb, ctx: fb.embeds}, device="cpu")
    assert reg.impl == "generated"
    return reg


def _assert_no_history(reg: gs.SlotRegistry) -> None:
    for slot in reg.active:
        assert not slot.buffer.requires_grad and slot.buffer.grad_fn is None, slot.name
        assert slot.buffer.is_leaf, slot.name


@pytest.mark.parametrize("first_requires_grad", [True, False])
def test_requires_grad_sources_are_copied_by_value_fill_after_fill(first_requires_grad):
    reg = _registry()
    for step in range(4):
        requires_grad = step % 2 == (0 if first_requires_grad else 1)
        fb = _batch(step, requires_grad)
        assert torch.is_grad_enabled()
        reg.fill_from(fb, raw_bs=2, padded_bs=3, raw_num_tokens=3, padded_num_tokens=4)
        assert torch.is_grad_enabled()  # the caller's mode, restored
        _assert_no_history(reg)
        value = float(step + 1)
        assert reg.slot("mask").buffer.tolist() == [value, value, float("-inf"), float("-inf")]
        assert reg.slot("rows").buffer[:3].tolist() == [[2 * value] * 2] * 2 + [[0.0, 0.0]]
        assert reg.slot("ids").buffer[:3].tolist() == [step, step + 1, 0]
        assert reg.slot("host").buffer[:3].tolist() == [value, value, 2.0]
        assert reg.slot("embeds").buffer[:3].tolist() == [[value] * 3] * 3
        view = reg.extract(fb, padded_bs=3, padded_num_tokens=4)
        assert not any(getattr(view, name).requires_grad for name in reg.slot_names())
        assert fb.mask.requires_grad == requires_grad and fb.mask.grad is None  # the source is untouched


def test_a_backward_through_the_buffers_never_reaches_the_source():
    reg = _registry(ALONE)
    fb = Batch()
    fb.mask = torch.ones(2, requires_grad=True)
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    weight = torch.ones(4, requires_grad=True)
    (reg.slot("mask").buffer[:2] * weight[:2]).sum().backward()
    assert fb.mask.grad is None and weight.grad.tolist() == [1.0, 1.0, 0.0, 0.0]
    fb.mask = torch.full((1,), 5.0)
    reg.fill_from(fb, raw_bs=1, padded_bs=2, raw_num_tokens=1, padded_num_tokens=2)  # and the next fill still works
    assert reg.slot("mask").buffer.tolist() == [5.0, float("-inf"), float("-inf"), float("-inf")]
    _assert_no_history(reg)


def test_the_callers_grad_mode_is_restored_after_a_fill_and_after_an_error():
    reg = _registry(ALONE)
    fb = Batch()
    fb.mask = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)
        assert not torch.is_grad_enabled()
    fb.mask = torch.ones(3, requires_grad=True)  # a row count that is not the step's
    with pytest.raises(gs.SlotError, match="spec 'alone', slot 'mask': expected shape \\[2\\], got \\[3\\]"):
        reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)
    assert torch.is_grad_enabled()
    with pytest.raises(gs.SlotError):
        # an impossible step size, found when the plan is made
        reg.fill_from(fb, raw_bs=5, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)
    assert torch.is_grad_enabled()
    _assert_no_history(reg)
