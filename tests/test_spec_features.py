"""The slot keys for every engine (docs/spec-features.md), by example: exact buffer contents
after a fill, head, tail and past the tail, in both implementations.

* ``extra_rows``: a head of ``raw + k`` rows, a tail ``[raw + k:padded + k]``, a view of ``padded + k``;
* ``padding: repeat_last``: each tail row is the head's last row, after every hook (an empty head: zeros);
* ``reset_to: capacity``: the written tail runs to the end of the buffer, the view stays ``[:padded + k]``;
* ``index: skip``: a negative sentinel tail;
* ``staged: true``: the fill writes the host buffer, one copy puts the rows the step defines on the device;
  adopted from a ``.cpu``/``.gpu`` object or a ``(host, device)`` pair, one tensor for both making no copy;
* ``padding`` / ``reset_to`` naming a ``str`` param: the choice of the defaults, a preset or the build.

Every buffer is poisoned with ``P`` before the fill, so an untouched row reads ``P``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import graphslot as gs
from conftest import parse
from graphslot.api import build

P = 9  # the poison
IMPLS = ("interpreted", "generated")

SPEC = """\
name: features
params:
  reset: {type: str, default: capacity}
  policy: {type: str, default: zero}
presets:
  cpu: {reset: padded, policy: keep_pad}
slots:
  - {name: qsl, shape: [max_bs + 1], dtype: int32, axis: bs, extra_rows: 1, padding: repeat_last, staged: true}
  - {name: qsl_cap, shape: [max_bs + 1], dtype: int32, axis: bs, extra_rows: 1, padding: repeat_last,
     reset_to: capacity}
  - {name: last, shape: [max_bs, 2], dtype: int64, axis: bs, padding: repeat_last}
  - {name: seq_lens, shape: [max_bs], dtype: int32, axis: bs, padding: zero, reset_to: capacity, staged: true}
  - {name: slot_mapping, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: fill_sentinel, pad_value: -1,
     index: skip, staged: true, reset_to: reset}
  - {name: chosen, shape: [max_num_tokens], dtype: int64, axis: tokens, padding: policy}
  - {name: wide, shape: [2, max_num_tokens + 2], dtype: int32, axis: tokens, slice_dim: 1, extra_rows: 2,
     padding: fill_sentinel, pad_value: 7}
  - {name: block_table, shape: [max_bs, 2], dtype: int32, axis: bs, padding: keep_pad, staged: true,
     copy_from_fb: false}
"""


def registry(impl, preset=None, params=None, **kwargs):
    reg = build(parse(SPEC), device="cpu", max_bs=4, max_num_tokens=6, impl=impl, preset=preset, params=params,
                **kwargs)
    for slot in reg.active:
        for buffer in slot.buffers():
            buffer.fill_(P)
    return reg


def batch(raw_bs, raw_num_tokens):
    """Sources of ``raw`` rows (``raw + k`` for the slots with extra rows): 1, 2, 3, … (slot_mapping from 10)."""
    def rows(n, dtype=torch.int32, start=1, width=None):
        values = torch.arange(start, start + n, dtype=dtype)
        return values if width is None else values.repeat_interleave(width).view(n, width)

    return SimpleNamespace(
        qsl=rows(raw_bs + 1), qsl_cap=rows(raw_bs + 1), last=rows(raw_bs, torch.int64, width=2),
        seq_lens=rows(raw_bs), slot_mapping=rows(raw_num_tokens, torch.int64, 10),
        chosen=rows(raw_num_tokens, torch.int64),
        wide=rows(2 * (raw_num_tokens + 2)).view(2, raw_num_tokens + 2),
    )


def fill(reg, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens):
    fb = batch(raw_bs, raw_num_tokens)
    reg.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_num_tokens,
                  padded_num_tokens=padded_num_tokens)
    return fb


def host(reg, name):
    return reg.slot(name).filled.tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_step_with_raw_below_padded_below_capacity(impl):
    reg = registry(impl)
    fb = fill(reg, 2, 3, 3, 4)
    assert host(reg, "qsl") == [1, 2, 3, 3, P]  # head [:3], tail [3:4] repeats the last head row, past it untouched
    assert host(reg, "qsl_cap") == [1, 2, 3, 3, 3]  # to the end of the buffer
    assert host(reg, "last") == [[1, 1], [2, 2], [2, 2], [P, P]]  # a row of a wider buffer
    assert host(reg, "seq_lens") == [1, 2, 0, 0]  # zero to capacity
    assert host(reg, "slot_mapping") == [10, 11, 12, -1, -1, -1]  # the reset param's default: capacity
    assert host(reg, "chosen") == [1, 2, 3, 0, P, P]  # the policy param's default: zero
    assert host(reg, "wide") == [[1, 2, 3, 4, 5, 7, P, P], [6, 7, 8, 9, 10, 7, P, P]]  # head [:5], tail [5:6]
    assert host(reg, "block_table") == [[P, P]] * 4  # the engine writes its host buffer: the fill only stages it
    view = reg.extract(fb, padded_bs=3, padded_num_tokens=4)
    assert view.qsl.tolist() == [1, 2, 3, 3] and view.qsl_cap.tolist() == [1, 2, 3, 3]  # [:padded + 1]
    assert view.wide.shape == (2, 6) and view.slot_mapping.tolist() == [10, 11, 12, -1]
    assert view.seq_lens.tolist() == [1, 2, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_an_empty_head(impl):
    reg = registry(impl)
    fill(reg, 0, 2, 0, 3)
    assert host(reg, "qsl") == [1, 1, 1, P, P]  # the extra row is the head: its value is repeated
    assert host(reg, "last") == [[0, 0], [0, 0], [P, P], [P, P]]  # no row to repeat: zeros
    assert host(reg, "seq_lens") == [0, 0, 0, 0]
    assert host(reg, "slot_mapping") == [-1] * 6
    assert host(reg, "chosen") == [0, 0, 0, P, P, P]
    assert host(reg, "wide") == [[1, 2, 7, 7, 7, P, P, P], [3, 4, 7, 7, 7, P, P, P]]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_full_step_has_no_tail(impl):
    reg = registry(impl)
    fill(reg, 4, 4, 6, 6)
    assert host(reg, "qsl") == [1, 2, 3, 4, 5] and host(reg, "qsl_cap") == [1, 2, 3, 4, 5]
    assert host(reg, "last") == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert host(reg, "slot_mapping") == [10, 11, 12, 13, 14, 15]
    assert host(reg, "wide")[0] == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("impl", IMPLS)
def test_staged_slots_copy_what_the_step_defines_to_the_device_buffer(impl):
    reg = registry(impl)
    reg.host_buffer("block_table")[:2] = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)  # the engine's write
    fb = fill(reg, 2, 3, 3, 4)
    device = {name: reg.slot(name).buffer.tolist() for name in ("qsl", "seq_lens", "slot_mapping", "block_table")}
    assert device["qsl"] == [1, 2, 3, 3, P]  # [:padded + 1]: the rest keeps what it held
    assert device["seq_lens"] == [1, 2, 0, 0]  # reset_to: capacity: the whole buffer
    assert device["slot_mapping"] == [10, 11, 12, -1, -1, -1]
    assert device["block_table"] == [[5, 6], [7, 8], [P, P], [P, P]]  # [:padded]: the rows the graph reads
    assert reg.host_buffer("qsl") is reg.slot("qsl").host and reg.slot("qsl").host is not reg.slot("qsl").buffer
    view = reg.extract(fb, padded_bs=3, padded_num_tokens=4)
    assert view.block_table.data_ptr() == reg.slot("block_table").buffer.data_ptr()  # the device buffer's view
    assert reg.nbytes == sum(b.numel() * b.element_size() for s in reg.active for b in s.buffers())


def test_host_buffer_of_a_slot_without_one():
    reg = registry("interpreted")
    with pytest.raises(gs.SlotError, match="slot 'chosen' has no host buffer: it is neither staged nor device: cpu"):
        reg.host_buffer("chosen")


@pytest.mark.parametrize("impl", IMPLS)
def test_the_choices_of_a_preset(impl):
    reg = registry(impl, preset="cpu")  # reset: padded, policy: keep_pad
    fill(reg, 2, 3, 3, 4)
    assert host(reg, "slot_mapping") == [10, 11, 12, -1, P, P]
    assert host(reg, "chosen") == [1, 2, 3, P, P, P]
    assert reg.slot("chosen").resolved.padding == "keep_pad"


@pytest.mark.parametrize("impl", IMPLS)
def test_the_choices_given_at_build(impl):
    reg = registry(impl, params={"reset": "padded", "policy": "repeat_last"})
    fill(reg, 2, 3, 3, 5)
    assert host(reg, "slot_mapping") == [10, 11, 12, -1, -1, P]
    assert host(reg, "chosen") == [1, 2, 3, 3, 3, P]


HOOKED = """\
name: hooked
slots:
  - {name: offsets, shape: [max_bs + 1], dtype: int64, axis: bs, extra_rows: 1, padding: repeat_last,
     copy_from_fb: false, post_fill: cumsum}
  - {name: sourced, shape: [max_bs], dtype: int64, axis: bs, padding: repeat_last, source: longer}
"""


@pytest.mark.parametrize("impl", IMPLS)
def test_repeat_last_repeats_what_the_hooks_wrote(impl):
    def cumsum(buffer, fb, ctx):  # a computed head, as vLLM computes query_start_loc
        buffer[0] = 0
        buffer[1:ctx.raw_bs + 1] = torch.cumsum(fb.lens, 0)

    def longer(fb, ctx):  # a source longer than the raw count: its extra rows are the tail's, then repeated over
        return torch.arange(1, ctx.padded_bs + 1)

    reg = build(parse(HOOKED), device="cpu", max_bs=4, max_num_tokens=4, impl=impl,
                hooks={"cumsum": cumsum, "longer": longer})
    for slot in reg.active:
        slot.buffer.fill_(P)
    fb = SimpleNamespace(lens=torch.tensor([3, 2]))
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.slot("offsets").buffer.tolist() == [0, 3, 5, 5, 5]
    assert reg.slot("sourced").buffer.tolist() == [1, 2, 2, 2]


# --- staged adoption --------------------------------------------------------------------------

STAGED = """\
name: staged
slots:
  - {name: ids, shape: [max_num_tokens], dtype: int32, axis: tokens, padding: zero, staged: true}
"""


class CpuGpuBuffer:
    """vLLM's pair: a host tensor and a device tensor of one shape."""

    def __init__(self, n, same=False):
        self.cpu = torch.full((n,), P, dtype=torch.int32)
        self.gpu = self.cpu if same else torch.full((n,), P, dtype=torch.int32)


def staged(impl, buffers=None, **kwargs):
    return gs.build_registry(parse(STAGED), device="cpu", max_bs=4, max_num_tokens=4, impl=impl, buffers=buffers,
                             **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("how", ["object", "pair"])
def test_a_staged_slot_adopts_a_host_and_a_device_tensor(impl, how):
    pair = CpuGpuBuffer(4)
    reg = staged(impl, {"ids": pair} if how == "object" else {"ids": (pair.cpu, pair.gpu)})
    slot = reg.slot("ids")
    assert slot.host is pair.cpu and slot.buffer is pair.gpu
    reg.fill_from(SimpleNamespace(ids=torch.tensor([4, 5], dtype=torch.int32)), raw_bs=1, padded_bs=1,
                  raw_num_tokens=2, padded_num_tokens=3)
    assert pair.cpu.tolist() == [4, 5, 0, P] and pair.gpu.tolist() == [4, 5, 0, P]


@pytest.mark.parametrize("impl", IMPLS)
def test_one_tensor_for_both_is_staged_in_name_only(impl, monkeypatch):
    pair = CpuGpuBuffer(4, same=True)
    reg = staged(impl, {"ids": pair})
    slot = reg.slot("ids")
    assert slot.host is slot.buffer is pair.cpu and slot.buffers() == (pair.cpu,)
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: copies.append(non_blocking)
                        or real_copy(self, src, non_blocking))
    fb = SimpleNamespace(ids=torch.tensor([4, 5], dtype=torch.int32))
    reg.fill_from(fb, raw_bs=1, padded_bs=1, raw_num_tokens=2, padded_num_tokens=3)
    assert pair.cpu.tolist() == [4, 5, 0, P]
    assert True not in copies  # no non-blocking (staging) copy
    assert reg.extract(fb, padded_bs=1, padded_num_tokens=3).ids.data_ptr() == pair.cpu.data_ptr()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_staged_slot_makes_one_non_blocking_copy(impl, monkeypatch):
    reg = staged(impl)
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: copies.append(non_blocking)
                        or real_copy(self, src, non_blocking))
    reg.fill_from(SimpleNamespace(ids=torch.tensor([4, 5], dtype=torch.int32)), raw_bs=1, padded_bs=1,
                  raw_num_tokens=2, padded_num_tokens=3)
    assert copies.count(True) == 1


@pytest.mark.parametrize("value, message", [
    (torch.zeros(4, dtype=torch.int32), "slot 'ids' is staged: buffers= must hold an object with .cpu and .gpu "
     "tensors (vLLM's CpuGpuBuffer) or a (host, device) pair of tensors for it, got Tensor"),
    ((torch.zeros(4, dtype=torch.int32, device="meta"), torch.zeros(4, dtype=torch.int32)),
     "slot 'ids' is staged: its host tensor must be on the CPU, got one on meta"),
    ((torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32, device="meta")),
     "slot 'ids' is staged: its device tensor must be on cpu, got one on meta"),
    ((torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),
     "slot 'ids (host)': cannot adopt the tensor: expected shape [4] dtype torch.int32, got shape [3] dtype "
     "torch.int32"),
    ((torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)),
     "slot 'ids': cannot adopt the tensor: expected shape [4] dtype torch.int32, got shape [4] dtype torch.int64"),
])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_staged_adoptee_that_does_not_fit_is_refused(impl, value, message):
    with pytest.raises(gs.SlotError) as info:
        staged(impl, {"ids": value})
    assert str(info.value) == message


def test_staged_slots_share_a_pool_as_two_buffers():
    pool = gs.BufferPool()
    first, second = staged("interpreted", pool), staged("generated", pool)
    assert first.slot("ids").host.data_ptr() == second.slot("ids").host.data_ptr()
    assert first.slot("ids").buffer.data_ptr() == second.slot("ids").buffer.data_ptr()
    assert first.slot("ids").host.data_ptr() != first.slot("ids").buffer.data_ptr()
    assert len(pool) == 2


def test_bound_staged_buffers():
    host_tensor, device_tensor = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    reg = build(parse(STAGED), device="cpu", max_bs=4, max_num_tokens=4, impl="generated",
                bind={"ids": (host_tensor, device_tensor)})
    assert reg.slot("ids").host is host_tensor and reg.slot("ids").buffer is device_tensor
    with pytest.raises(gs.SlotError, match=r"slot 'ids' \(host\): buffers= holds shape \[3\]"):
        build(parse(STAGED), device="cpu", max_bs=4, max_num_tokens=4, bind={"ids": (torch.zeros(3), device_tensor)})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", IMPLS)
def test_on_cuda_the_host_buffer_is_pinned_and_the_copy_reaches_the_device(impl):
    reg = gs.build_registry(parse(STAGED), device="cuda", max_bs=4, max_num_tokens=4, impl=impl)
    slot = reg.slot("ids")
    assert slot.host.is_pinned() and slot.host.device.type == "cpu" and slot.buffer.device.type == "cuda"
    reg.fill_from(SimpleNamespace(ids=torch.tensor([4, 5], dtype=torch.int32)), raw_bs=1, padded_bs=1,
                  raw_num_tokens=2, padded_num_tokens=3)
    torch.cuda.synchronize()
    assert slot.buffer[:3].tolist() == [4, 5, 0]


# --- what the spec says about itself --------------------------------------------------------------


def test_keys_at_their_defaults_leave_the_identity_as_it_was():
    plain = parse(STAGED.replace(", staged: true", ""))
    spelled = parse(STAGED.replace(", staged: true", ", staged: false, extra_rows: 0, reset_to: padded"))
    assert plain.identity == spelled.identity
    assert '"staged":' not in plain.canonical_json() and '"extra_rows":' not in plain.canonical_json()
    assert parse(STAGED).identity != plain.identity
    assert parse(STAGED.replace("staged: true", "reset_to: capacity")).identity != plain.identity


def test_show_prints_the_policy_a_param_chose(capsys, tmp_path):
    from conftest import cli

    path = tmp_path / "features.yaml"
    path.write_text(SPEC)
    status, out, _ = cli(capsys, "show", str(path), "--preset", "cpu")
    assert status == 0
    assert [line.split()[4] for line in out.splitlines() if line.startswith("chosen ")] == ["keep_pad"]


def test_a_runner_resets_index_skip_buffers_to_their_sentinel_not_to_zero():
    """Released graphs leave index buffers as a padded row holds them: a zero in a slot mapping whose kernels
    skip -1 would write into KV slot 0, a real one."""
    from graphslot.runners.phase import PhaseRunner

    reg = registry("interpreted")
    PhaseRunner.reset_index_buffers(SimpleNamespace(registry=reg))
    assert [b.tolist() for b in reg.slot("slot_mapping").buffers()] == [[-1] * 6, [-1] * 6]  # host and device
    assert reg.slot("chosen").buffer.tolist() == [P] * 6  # not an index slot


def test_a_staged_slots_two_buffers_are_two_to_the_identity_check():
    """No two buffers of a registry overlap: a staged slot's host tensor may not be another slot's buffer."""
    text = STAGED + "  - {name: other, shape: [max_num_tokens], dtype: int32, axis: tokens, padding: zero}\n"
    shared = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(gs.SlotError) as info:
        gs.build_registry(parse(text), device="cpu", max_bs=4, max_num_tokens=4, impl="interpreted",
                          buffers={"ids": (shared, torch.zeros(4, dtype=torch.int32)), "other": shared})
    assert str(info.value).startswith("spec 'staged': slots 'ids (host)' and 'other' were given the same tensor")
    one = torch.zeros(4, dtype=torch.int32)  # one tensor for both halves of one staged slot: allowed
    reg = gs.build_registry(parse(text), device="cpu", max_bs=4, max_num_tokens=4, impl="interpreted",
                            buffers={"ids": (one, one), "other": torch.zeros(4, dtype=torch.int32)})
    assert reg.slot("ids").buffers() == (one,)
