"""What a registry takes as its buffers (issue 44, "No silent wrong output"): adopted
(``buffers=`` an object or mapping) and pooled (``buffers=`` a pool) tensors are checked
at build, in both impls and whatever ``GRAPHSLOT_STRICT`` says:

* identity: within one registry every slot has memory of its own, judged by device and
  byte ranges as strict mode judges a source's aliasing (one tensor under two names, two
  overlapping views of one allocation, a pool handing out one tensor per shape);
* device, shape and dtype, naming the slot (and the pool), the expected and the given;
* an adoptee whose attributes raise, and the capacities' types, get one clear error.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import graphslot as gs
from graphslot.generated import decode_default
from graphslot.registry.buffers import BufferPool

MODES = ("interpreted", "generated")
STRICT = ("0", "1")

PAIR = gs.spec_from_dict({"name": "pair", "slots": [
    {"name": "input_ids", "shape": ["max_num_tokens"], "dtype": "int64", "axis": "tokens", "padding": "zero"},
    {"name": "positions", "shape": ["max_num_tokens"], "dtype": "int64", "axis": "tokens", "padding": "zero"},
    {"name": "lens", "shape": ["max_bs"], "dtype": "int64", "axis": "bs", "padding": "fill_sentinel",
     "pad_value": 1},
    {"name": "lens_cpu", "shape": ["max_bs"], "dtype": "int64", "axis": "bs", "padding": "fill_sentinel",
     "pad_value": 1, "device": "cpu"}]})


def build(buffers, mode, device="cpu"):
    return gs.build_registry(PAIR, device=device, max_bs=4, max_num_tokens=4, impl=mode, buffers=buffers)


def own() -> dict:
    return {"input_ids": torch.zeros(4, dtype=torch.int64), "positions": torch.zeros(4, dtype=torch.int64),
            "lens": torch.ones(4, dtype=torch.int64), "lens_cpu": torch.ones(4, dtype=torch.int64)}


def batch(device="cpu"):
    return SimpleNamespace(input_ids=torch.tensor([7, 8, 9], device=device),
                           positions=torch.tensor([3, 4, 5], device=device),
                           lens=torch.tensor([4, 5], device=device), lens_cpu=torch.tensor([4, 5]))


def fill_and_view(reg):
    fb = batch(reg.device)
    reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=3, padded_num_tokens=4)
    return reg.extract(fb, padded_bs=2, padded_num_tokens=4)


@pytest.fixture(params=STRICT, ids=["lenient", "strict"])
def strict(request, monkeypatch):
    monkeypatch.setenv("GRAPHSLOT_STRICT", request.param)
    return request.param


# --- identity: no two slots of one registry share memory --------------------------------------


def same_tensor(given: dict) -> dict:
    return dict(given, positions=given["input_ids"])


def overlapping_views(given: dict) -> dict:
    backing = torch.zeros(6, dtype=torch.int64)
    return dict(given, input_ids=backing[:4], positions=backing[2:])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("alias, what", [
    (same_tensor, "slots 'input_ids' and 'positions' were given the same tensor (buffers= adopted)"),
    (overlapping_views, "the buffers of slots 'input_ids' and 'positions' overlap (16 bytes on cpu, buffers= adopted)"),
], ids=["one tensor under two names", "overlapping views of one allocation"])
def test_adopted_buffers_that_share_memory_are_refused(mode, alias, what, strict):
    with pytest.raises(gs.SlotError) as err:
        build(alias(own()), mode)
    assert str(err.value) == (
        f"spec 'pair': {what}; every slot of a registry needs memory of its own: give each slot in buffers= a "
        "tensor of its own (views of one allocation must not overlap)")


@pytest.mark.parametrize("mode", MODES)
def test_adjacent_views_of_one_allocation_are_adopted_and_filled_apart(mode, strict):
    backing = torch.zeros(8, dtype=torch.int64)
    given = dict(own(), input_ids=backing[:4], positions=backing[4:])
    view = fill_and_view(build(given, mode))
    assert view.input_ids.tolist() == [7, 8, 9, 0] and view.positions.tolist() == [3, 4, 5, 0]
    assert backing.tolist() == [7, 8, 9, 0, 3, 4, 5, 0]


class ShapePool:
    """A pool that shares by (shape, dtype), not by name: two slots of one shape get one tensor."""

    def __init__(self):
        self.tensors = {}

    def share(self, name, tensor, init_value=None):
        key = (tuple(tensor.shape), tensor.dtype, tensor.device)
        if key in self.tensors:
            return self.tensors[key], False
        self.tensors[key] = tensor
        return tensor, True


@pytest.mark.parametrize("mode", MODES)
def test_a_pool_that_shares_one_tensor_between_two_slots_is_refused(mode, strict):
    with pytest.raises(gs.SlotError) as err:
        build(ShapePool(), mode)
    assert str(err.value) == (
        "spec 'pair': slots 'input_ids' and 'positions' were given the same tensor (from the pool ShapePool); "
        "every slot of a registry needs memory of its own: a pool must return a tensor of its own for each "
        "slot name (gs.BufferPool shares by (name, numel, dtype, device), so only across registries)")


@pytest.mark.parametrize("mode", MODES + (decode_default,), ids=MODES + ("checked-in module",))
def test_the_shipped_decode_spec_refuses_a_pool_sharing_by_shape(mode, strict):
    """The issue's case: positions and input_ids one tensor, the view's positions were the ids."""
    with pytest.raises(gs.SlotError, match="^spec 'decode': slots 'input_ids' and 'positions' were given the same"):
        gs.build_registry("decode", device="cpu", max_bs=4, max_num_tokens=4, impl=mode, buffers=ShapePool())


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_pool_still_shares_each_slot_across_registries(mode, strict):
    pool = BufferPool()
    first = build(pool, mode)
    second = build(pool, mode)
    for name in ("input_ids", "positions", "lens", "lens_cpu"):
        assert first.slot(name).buffer.data_ptr() == second.slot(name).buffer.data_ptr()
    assert len(pool) == 4
    assert fill_and_view(second).positions.tolist() == [3, 4, 5, 0]


# --- device, shape and dtype of what is adopted or pooled ----------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_an_adopted_tensor_on_another_device_is_refused(mode, strict):
    given = dict(own(), positions=torch.zeros(4, dtype=torch.int64, device="meta"))
    with pytest.raises(gs.SlotError) as err:
        build(given, mode)
    assert str(err.value) == (
        "slot 'positions': cannot adopt the tensor: expected device cpu, got meta; pass a tensor on cpu "
        "(.to('cpu') gives one)")


@pytest.mark.parametrize("mode", MODES)
def test_a_host_slot_expects_an_adopted_tensor_on_the_host(mode):
    given = {name: tensor.to("meta") for name, tensor in own().items()}
    with pytest.raises(gs.SlotError) as err:
        build(given, mode, device="meta")
    assert str(err.value) == (
        "slot 'lens_cpu': cannot adopt the tensor: expected device cpu, got meta; pass a tensor on cpu "
        "(.to('cpu') gives one)")


class Pool:
    """A pool returning ``make(tensor)`` for every slot (one of its own each)."""

    def __init__(self, make):
        self.make = make

    def share(self, name, tensor, init_value=None):
        return self.make(tensor), True


WRONG = [
    (lambda t: torch.zeros(2, dtype=t.dtype), "shape [2] torch.int64 on cpu"),
    (lambda t: torch.zeros(t.shape, dtype=torch.int32), "shape [4] torch.int32 on cpu"),
    (lambda t: torch.zeros(t.shape, dtype=t.dtype, device="meta"), "shape [4] torch.int64 on meta"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make, got", WRONG, ids=["shape", "dtype", "device"])
def test_a_pool_returning_a_tensor_that_does_not_fit_is_refused_at_build(mode, make, got, strict):
    with pytest.raises(gs.SlotError) as err:
        build(Pool(make), mode)
    assert str(err.value) == (
        f"slot 'input_ids': the pool Pool returned {got}, expected shape [4] torch.int64 on cpu; "
        "a pool's share() must return a tensor of the shape, dtype and device it was given")


@pytest.mark.parametrize("mode", MODES)
def test_a_pool_returning_a_strided_tensor_is_refused_at_build(mode):
    """As an adopted one: generated code views buffers as one integer dtype, which a strided one fails at the
    first fill (``self.stride(-1) must be 1 to view Long as Int``), naming nothing."""
    with pytest.raises(gs.SlotError) as err:
        build(Pool(lambda t: torch.zeros(2 * t.numel(), dtype=t.dtype)[::2].view(t.shape)), mode)
    assert str(err.value) == (
        "slot 'input_ids': the pool Pool returned a non-contiguous tensor (shape [4], strides [2]); "
        "a pool's share() must return a contiguous tensor (.contiguous() gives one)")


@pytest.mark.parametrize("mode", MODES)
def test_a_pool_returning_no_tensor_is_refused_at_build(mode):
    with pytest.raises(gs.SlotError) as err:
        build(Pool(lambda t: t.tolist()), mode)
    assert str(err.value) == (
        "slot 'input_ids': the pool Pool returned tuple ([0, 0, 0, 0], True), expected (tensor, fresh); "
        "a pool's share() must return a tensor of the shape, dtype and device it was given")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_a_host_tensor_is_refused_by_a_cuda_registry_and_a_device_one_by_its_host_slot(mode):
    given = {name: tensor.cuda() for name, tensor in own().items()}
    given["input_ids"] = given["input_ids"].cpu()
    refused = r"^slot '{}': cannot adopt the tensor: expected device {}, got {}"
    with pytest.raises(gs.SlotError, match=refused.format("input_ids", "cuda", "cpu")):
        build(given, mode, device="cuda")
    given["input_ids"] = given["input_ids"].cuda()
    with pytest.raises(gs.SlotError, match=refused.format("lens_cpu", "cpu", "cuda")):
        build(given, mode, device="cuda")
    given["lens_cpu"] = given["lens_cpu"].cpu()
    assert fill_and_view(build(given, mode, device="cuda")).positions.tolist() == [3, 4, 5, 0]


# --- what the adoptee and the capacities may be ----------------------------------------------------


class Engine:
    """An engine object whose attribute lookups go through an engine-specific ``__getattr__``."""

    def __getattr__(self, name):
        raise RuntimeError(f"engine: no buffer {name!r} registered yet")


@pytest.mark.parametrize("mode", MODES)
def test_an_adoptee_whose_getattr_raises_is_named_by_slot(mode):
    with pytest.raises(gs.SlotError) as err:
        build(Engine(), mode)
    assert str(err.value) == (
        "slot 'input_ids': looking up its tensor in buffers= raised RuntimeError: engine: no buffer 'input_ids' "
        "registered yet; give buffers= a tensor 'input_ids', or declare the slot `adopt: never`")
    assert isinstance(err.value.__cause__, RuntimeError)


def test_an_instance_attribute_share_makes_a_pool_and_a_mapping_is_adopted():
    calls = []
    pool = SimpleNamespace(share=lambda name, tensor, init=None: calls.append(name) or (tensor, True))
    build(pool, "generated")
    assert calls == ["input_ids", "positions", "lens", "lens_cpu"]
    given = own()
    adopted = build({**given, "share": lambda *args: None}, "interpreted")  # a key, not a pool
    assert adopted.slot("lens").buffer is given["lens"]


@pytest.mark.parametrize("mode", MODES)
def test_numpy_integer_capacities_are_taken_as_ints(mode):
    reg = gs.build_registry(PAIR, device="cpu", max_bs=np.int64(4), max_num_tokens=np.int32(4), impl=mode)
    assert type(reg.max_bs) is int and type(reg.max_num_tokens) is int and (reg.max_bs, reg.max_num_tokens) == (4, 4)
    assert fill_and_view(reg).positions.tolist() == [3, 4, 5, 0]


@pytest.mark.parametrize("value, shown", [
    (np.float64(8.0), "float64 np.float64(8.0)"), (np.bool_(True), "bool np.True_"),
    (True, "bool True"), (8.0, "float 8.0")])
def test_a_capacity_that_is_no_int_is_one_line_naming_the_argument(value, shown):
    with pytest.raises(ValueError) as err:
        gs.build_registry("decode", device="cpu", max_bs=value, max_num_tokens=4)
    assert str(err.value) == f"max_bs must be an int, got {shown}"


def test_a_pool_initial_value_disagreement_says_what_to_do():
    pool = BufferPool()
    kept = pool.share("lens", torch.zeros(4), 1)
    with pytest.raises(gs.SlotError) as err:
        pool.share("lens", torch.zeros(4), 2)
    assert kept[1] and "share_pool" not in str(err.value)
    assert str(err.value) == (
        "slot 'lens': shared buffer (4 x torch.float32 on cpu) was first registered with initial value 1, this "
        "registry needs 2; give both the same pad value, or build this registry with a pool of its own "
        "(or buffers=None)")


# --- strided buffers (the sglang drop-in binds them): shared elements, not spans --------------


def bound_pair(first: torch.Tensor, second: torch.Tensor):
    """A drop-in registry with ``seq_lens`` bound to ``first`` and ``req_pool_indices`` to ``second``."""
    from graphslot.integrations.sglang import CudaGraphBufferRegistry, GraphSlot

    reg = CudaGraphBufferRegistry(device=torch.device("cpu"), max_bs=4, max_num_tokens=4)
    reg.register_slot(GraphSlot("seq_lens", lambda bs, nt: (bs,), torch.int64, axis="bs"), bind=first)
    reg.register_slot(GraphSlot("req_pool_indices", lambda bs, nt: (bs,), torch.int64, axis="bs"), bind=second)
    batch = SimpleNamespace(seq_lens=torch.tensor([5, 6]), req_pool_indices=torch.tensor([1, 2]), batch_size=2)
    reg.fill_from(batch, raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)


def test_interleaved_columns_of_one_allocation_are_bound_and_filled_apart():
    """Two columns of one ``[bs, 2]`` tensor share no byte, though each one's span crosses the
    other's: sglang binds them, and the drop-in refused them as overlapping (by 56 bytes)."""
    wide = torch.zeros(4, 2, dtype=torch.int64)
    bound_pair(wide[:, 0], wide[:, 1])
    assert wide[:2].tolist() == [[5, 1], [6, 2]]


@pytest.mark.parametrize("second, shared", [
    (lambda wide: wide[:4, 0], "were given the same tensor"),
    (lambda wide: wide.view(-1)[2:6], "overlap (16 bytes on cpu, bound)"),
    (lambda wide: wide.view(-1).as_strided((4,), (1,), 6), "overlap (8 bytes on cpu, bound)"),
], ids=["one column twice", "a dense run over two rows", "a view sharing one element"])
def test_strided_buffers_that_share_elements_are_refused_with_the_bytes_shared(second, shared):
    wide = torch.zeros(5, 2, dtype=torch.int64)
    with pytest.raises(gs.SlotError, match=rf"^spec 'sglang': (the buffers of )?slots 'seq_lens' and "
                                           rf"'req_pool_indices' {re.escape(shared)}"):
        bound_pair(wide[:4, 0], second(wide))


@pytest.mark.parametrize("mode", MODES)
def test_a_copy_torch_refuses_for_overlap_names_the_slot_whose_source_aliases_a_buffer(mode, monkeypatch):
    """Without strict mode nothing judges aliasing on the happy path; when the copy fails for it (a source that is
    its own buffer shifted), the error names the slot, as strict mode's does, instead of torch's bare one."""
    monkeypatch.setenv("GRAPHSLOT_STRICT", "0")
    reg = build(None, mode)
    fb = batch()
    fb.positions = reg.slot("positions").buffer[1:4]
    with pytest.raises(gs.SlotError) as err:
        reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=3, padded_num_tokens=4)
    assert str(err.value) == (
        "spec 'pair', slot 'positions': the source aliases the buffer of slot 'positions' (a view of a static buffer "
        "other than this slot's own head); copy it first, or pass the batch's own tensor")
    assert "refer to a single memory location" in str(err.value.__cause__)
