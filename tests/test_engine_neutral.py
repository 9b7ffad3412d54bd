"""The decode runner works with batch types that are not sglang's, or says at once why not.

The batches here are plain dataclasses of the decode spec's fields, with no
``forward_mode`` (and, for some, no ``batch_size``); the adapter turns a view into the
reference model's ``ForwardBatch`` inside ``forward``, so the captured graph still reads
only static buffers.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

import graphslot as gs
from graphslot.reference import ForwardBatch, ForwardMode, Scheduler, build_reference_model, make_decode_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners.prefill import PrefillGraphRunner
from graphslot.runners.adapter import DecodeAdapter
from graphslot.runners.decode import DecodeGraphRunner
from graphslot.runners.outputs import slice_rows
from prefill_cases import mixed_batches

FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "seq_lens_cpu")


@dataclass
class PlainBatch:
    """A decode step of some other engine: no forward_mode, no batch_size."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor


@dataclass(frozen=True)
class FrozenBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    batch_size: int = 0


@dataclass(frozen=True, slots=True)
class SlottedBatch:
    """A __slots__ type must declare every attribute a view sets, computed slots too."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    batch_size: int = 0
    mrope_positions: Optional[torch.Tensor] = None
    global_num_tokens_gpu: Optional[torch.Tensor] = None
    global_num_tokens_for_logprob_gpu: Optional[torch.Tensor] = None


@dataclass(frozen=True, slots=True)
class SlottedNoBatchSize:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor


def convert(fb: ForwardBatch, cls: type) -> Any:
    """The same step as a ``cls`` batch (what another engine would have built)."""
    values = {name: getattr(fb, name) for name in FIELDS}
    if "batch_size" in {f.name for f in dataclasses.fields(cls)}:
        values["batch_size"] = fb.batch_size
    return cls(**values)


class PlainAdapter(ReferenceDecodeAdapter):
    """The reference adapter for a batch type of its own; only the batch changes."""

    def __init__(self, runtime, batch_type: type = PlainBatch):
        super().__init__(runtime)
        self.batch_type = batch_type
        self.captured = 0

    def to_fb(self, b: Any) -> ForwardBatch:
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=self.batch_size(b),
                            **{name: getattr(b, name) for name in FIELDS})

    def forward(self, b):
        return super().forward(self.to_fb(b))

    def forward_eager(self, b):
        return super().forward_eager(self.to_fb(b))

    def init_capture_metadata(self, bs, num_tokens, view):
        self.captured += 1
        super().init_capture_metadata(bs, num_tokens, self.to_fb(view))

    def init_replay_metadata(self, bs, view, raw_fb):
        super().init_replay_metadata(bs, self.to_fb(view), raw_fb)

    def make_dummy_batch(self, bs, num_tokens):
        fb = super().make_dummy_batch(bs, num_tokens)
        return convert(fb, self.batch_type)


def decode_through(runner, rt, batch_type, steps=40):
    """Scheduler-driven decode: each step as a ``batch_type`` through the runner,
    compared with the eager reference forward of the same step. The sizes seen."""
    sizes = []

    def decode_fn(fb):
        batch = convert(fb, batch_type)
        assert runner.can_run(batch), f"bs={fb.batch_size} is not graph-runnable"
        graph = runner(batch).clone()
        eager = rt.forward(fb)
        assert graph.shape == eager.shape  # raw rows only
        assert torch.equal(graph, eager), f"step with bs={fb.batch_size} differs from eager"
        sizes.append(fb.batch_size)
        return eager

    Scheduler(rt, seed=3, num_requests=20, max_running=runner.captured_sizes[0],
              max_new_tokens=(1, 16)).run(decode_fn, max_steps=steps)
    return sizes


@pytest.mark.parametrize("batch_type", [PlainBatch, FrozenBatch, SlottedBatch],
                         ids=["plain", "frozen", "frozen-slots"])
def test_batch_types_without_forward_mode_decode_like_eager(batch_type):
    rt = build_reference_model(max_num_reqs=8)
    runner = DecodeGraphRunner(PlainAdapter(rt, batch_type), max_bs=8, progress=False)
    sizes = decode_through(runner, rt, batch_type)
    assert len(set(sizes)) >= 4
    assert set(sizes) - set(runner.captured_sizes), "no step needed padding"
    for bs in runner.captured_sizes:
        assert runner.external_inputs(bs) == []


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_extract_on_a_batch_that_cannot_take_a_view_field_names_the_spec_and_the_fields(mode):
    reg = gs.build_registry("decode", max_bs=4, max_num_tokens=4, device="cpu", impl=mode)
    fb = SlottedNoBatchSize(*[torch.zeros(2, dtype=torch.int64) for _ in range(6)])
    reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)
    with pytest.raises(gs.SlotError) as info:
        reg.extract(fb, padded_bs=2, padded_num_tokens=2)
    assert str(info.value).startswith("spec 'decode': extract cannot set 'batch_size' on a copy of "
                                      "SlottedNoBatchSize (")
    assert str(info.value).endswith("; a batch type with __slots__ must declare every field a view sets: "
                                    + ", ".join(reg.view_names()))


def test_a_slotted_batch_without_batch_size_fails_at_construction_naming_it():
    rt = build_reference_model(max_num_reqs=4)
    adapter = PlainAdapter(rt, SlottedNoBatchSize)
    with pytest.raises(gs.SlotError) as info:
        DecodeGraphRunner(adapter, max_bs=4, progress=False)
    msg = str(info.value)
    assert msg.startswith("capturing batch size 4: the SlottedNoBatchSize from PlainAdapter.make_dummy_batch "
                          "cannot carry the view: spec 'decode': extract cannot set 'batch_size' on a copy of "
                          "SlottedNoBatchSize")
    assert "must declare every field a view sets: batch_size, input_ids, positions," in msg
    assert adapter.captured == 0


# -------------------------------------------------------------------- tokens_per_bs


def plain(n_tokens: int, bs: int) -> PlainBatch:
    z = torch.zeros
    return PlainBatch(z(n_tokens, dtype=torch.int64), z(n_tokens, dtype=torch.int64),
                      z(n_tokens, dtype=torch.int64), z(bs, dtype=torch.int64),
                      z(bs, dtype=torch.int64), z(bs, dtype=torch.int64))


def test_tokens_per_bs_without_forward_mode_is_tokens_over_requests():
    adapter = DecodeAdapter()
    assert adapter.batch_size(plain(3, 3)) == 3  # no batch_size field: the rows of seq_lens
    assert adapter.tokens_per_bs(plain(3, 3)) == 1
    assert adapter.tokens_per_bs(plain(8, 4)) == 2
    assert adapter.tokens_per_bs(plain(5, 2)) is None  # uneven: a prefill
    assert adapter.tokens_per_bs(plain(0, 0)) is None
    assert adapter.tokens_per_bs(plain(1, 2)) is None
    with pytest.raises(AttributeError, match="override DecodeAdapter.batch_size"):
        adapter.batch_size(object())


def test_tokens_per_bs_follows_an_sglang_forward_mode():
    rt = build_reference_model(max_num_reqs=4)
    rpi = rt.req_to_token_pool.alloc(2)
    adapter = DecodeAdapter()
    assert adapter.tokens_per_bs(make_decode_batch(rt, rpi, [3, 4], [5, 6])) == 1
    assert adapter.tokens_per_bs(make_decode_batch(rt, rpi, [4, 5], [[1, 2], [3, 4]])) == 2
    extend = dataclasses.replace(make_decode_batch(rt, rpi, [6, 7], [5, 6]), forward_mode=ForwardMode.EXTEND)
    assert adapter.tokens_per_bs(extend) is None  # 1 token per request, but a prefill


# --------------------------------------------------------- construction-time checks


@dataclass
class NoHostLens:
    """The issue's batch: everything but seq_lens_cpu."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    batch_size: int = 0


class NoHostLensAdapter(PlainAdapter):
    def make_dummy_batch(self, bs, num_tokens):
        e = torch.zeros(0, dtype=torch.int64)
        return NoHostLens(e, e, e, e, e)

    def init_graph_state(self, max_bs, max_num_tokens):
        raise AssertionError("the runner got as far as capture")


def test_a_dummy_batch_missing_a_copied_field_fails_at_construction():
    rt = build_reference_model(max_num_reqs=4)
    with pytest.raises(gs.SlotError) as info:
        DecodeGraphRunner(NoHostLensAdapter(rt), max_bs=4, progress=False)
    msg = str(info.value)
    assert msg.startswith("spec 'decode': the NoHostLens from NoHostLensAdapter.make_dummy_batch has no "
                          "'seq_lens_cpu'")
    assert "slot 'seq_lens_cpu'" in msg and "make_dummy_batch" in msg


def test_every_missing_field_is_named_at_once():
    class TwoMissing(NoHostLensAdapter):
        def make_dummy_batch(self, bs, num_tokens):
            e = torch.zeros(0, dtype=torch.int64)
            return NoHostLens(e, None, e, e, e)

    with pytest.raises(gs.SlotError, match="has no 'positions', 'seq_lens_cpu'"):
        DecodeGraphRunner(TwoMissing(build_reference_model(max_num_reqs=4)), max_bs=4, progress=False)


def test_an_optional_slot_may_be_missing_from_the_dummy():
    rt = build_reference_model(max_num_reqs=4)
    adapter = PlainAdapter(rt)  # PlainBatch has no mrope_positions: optional in the spec
    runner = DecodeGraphRunner(adapter, max_bs=2, progress=False)
    assert runner.registry.has_slot("mrope_positions") and adapter.captured == 2


def test_a_reader_that_fails_on_the_dummy_fails_at_construction():
    class ReadsMode(PlainAdapter):
        def tokens_per_bs(self, fb):
            return 1 if fb.forward_mode.is_decode() else None

    with pytest.raises(TypeError) as info:
        DecodeGraphRunner(ReadsMode(build_reference_model(max_num_reqs=4)), max_bs=4, progress=False)
    msg = str(info.value)
    assert msg.startswith("ReadsMode.tokens_per_bs fails on the PlainBatch from ReadsMode.make_dummy_batch")
    assert "forward_mode" in msg and "override DecodeAdapter.tokens_per_bs" in msg


def test_a_live_batch_missing_a_field_is_a_slot_error_naming_it():
    rt = build_reference_model(max_num_reqs=4)
    runner = DecodeGraphRunner(PlainAdapter(rt), max_bs=4, progress=False)
    rpi = rt.req_to_token_pool.alloc(3)
    fb = make_decode_batch(rt, rpi, [2, 3, 4], [5, 6, 7])
    batch = convert(fb, PlainBatch)
    object.__delattr__(batch, "seq_lens_cpu")  # an engine that forgot it on live batches
    assert runner.can_run(batch)
    with pytest.raises(gs.SlotError, match="spec 'decode', slot 'seq_lens_cpu': the batch has no field"):
        runner(batch)


# ------------------------------------------------------------------- output slicing


@dataclass(frozen=True)
class Output:
    """A dataclass output like transformers' ModelOutput (logits per request)."""

    logits: torch.Tensor
    hidden: Optional[tuple] = None
    loss: Optional[torch.Tensor] = None


class StructuredOutputAdapter(PlainAdapter):
    """forward returns a structure; ``kind`` picks which."""

    kind = "dataclass"

    def forward(self, b):
        logits = super().forward(b)
        hidden = (logits * 2, logits * 3)
        if self.kind == "dataclass":
            return Output(logits=logits.unsqueeze(1), hidden=hidden)
        if self.kind == "dict":
            return OrderedDict(logits=logits, extra=[logits + 1, None], scale=2.0)
        if self.kind == "namedtuple":
            return Pair(logits, logits - 1)
        if self.kind == "object":
            return Holder(logits)
        if self.kind == "aggregate":
            return {"logits": logits, "loss": logits.sum()}
        raise AssertionError(self.kind)


Pair = namedtuple("Pair", "logits shifted")


@dataclass
class Bad:
    x: torch.Tensor


class Holder:
    def __init__(self, logits):
        self.logits = logits


def structured_runner(kind):
    rt = build_reference_model(max_num_reqs=8)
    adapter = StructuredOutputAdapter(rt)
    adapter.kind = kind
    runner = DecodeGraphRunner(adapter, max_bs=4, progress=False)
    rpi = rt.req_to_token_pool.alloc(3)
    fb = make_decode_batch(rt, rpi, [2, 3, 4], [5, 6, 7])
    assert runner.padded_bs(fb) == 4
    return runner, convert(fb, PlainBatch), rt.forward(fb)


@pytest.mark.parametrize("kind", ["dataclass", "dict", "namedtuple"])
def test_structured_outputs_come_back_with_raw_rows_only(kind):
    runner, batch, eager = structured_runner(kind)
    out = runner(batch)
    if kind == "dataclass":
        assert type(out) is Output and out.logits.shape == (3, 1, eager.shape[1]) and out.loss is None
        assert torch.equal(out.logits[:, 0], eager)
        assert [h.shape[0] for h in out.hidden] == [3, 3] and torch.equal(out.hidden[1], eager * 3)
    elif kind == "dict":
        assert type(out) is OrderedDict and list(out) == ["logits", "extra", "scale"]
        assert torch.equal(out["logits"], eager) and out["extra"][0].shape[0] == 3
        assert out["extra"][1] is None and out["scale"] == 2.0
    else:
        assert type(out) is Pair and torch.equal(out.shifted, eager - 1) and out.logits.shape[0] == 3


def test_an_output_the_runner_cannot_slice_is_a_type_error_naming_it():
    runner, batch, _ = structured_runner("object")
    with pytest.raises(TypeError, match=r"^output: the runner cannot cut the padded rows out of a "
                                        r"test_engine_neutral\.Holder; return only tensors"):
        runner(batch)


def test_a_tensor_without_rows_is_not_handed_back():
    runner, batch, _ = structured_runner("aggregate")
    with pytest.raises(ValueError, match=r"^output\['loss'\]: a tensor of shape \[\] has neither 4 token rows "
                                         r"nor 4 request rows"):
        runner(batch)


def test_slice_rows_tells_token_rows_from_request_rows():
    tokens, requests = torch.arange(16).view(8, 2), torch.arange(4)
    out = slice_rows({"t": tokens, "r": [requests]}, raw_bs=3, raw_num_tokens=6, padded_bs=4, padded_num_tokens=8)
    assert out["t"].shape == (6, 2) and out["r"][0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"^output\.x: a tensor of shape \[5\]"):
        slice_rows(Bad(torch.zeros(5)), 3, 6, 4, 8)


def test_a_frozen_dataclass_batch_is_never_written():
    rt = build_reference_model(max_num_reqs=4)
    runner = DecodeGraphRunner(PlainAdapter(rt, FrozenBatch), max_bs=4, progress=False)
    rpi = rt.req_to_token_pool.alloc(3)
    fb = make_decode_batch(rt, rpi, [2, 3, 4], [5, 6, 7])
    batch = convert(fb, FrozenBatch)
    before = {name: getattr(batch, name) for name in FIELDS}
    out = runner(batch).clone()
    assert batch.batch_size == 3 and all(getattr(batch, n) is t for n, t in before.items())
    assert torch.equal(out, rt.forward(fb))


# ------------------------------------------------------------------ prefill runner


@dataclass(frozen=True)
class PlainExtend:
    """A prefill of some other engine: no forward_mode, no batch_size."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_seq_lens_cpu: tuple


def as_plain_extend(fb: ForwardBatch) -> PlainExtend:
    return PlainExtend(**{name: getattr(fb, name) for name in FIELDS},
                       extend_seq_lens_cpu=tuple(fb.extend_seq_lens_cpu))


class PlainPrefillAdapter(ReferencePrefillAdapter):
    """The reference prefill adapter for :class:`PlainExtend` batches."""

    def to_fb(self, b) -> ForwardBatch:
        return ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=self.batch_size(b),
                            **{name: getattr(b, name) for name in FIELDS},
                            extend_seq_lens_cpu=list(b.extend_seq_lens_cpu))

    def run_layer_stack(self, stack, hidden, view):
        return stack(view.positions, hidden, self.to_fb(view))

    def embed(self, fb):
        return super().embed(self.to_fb(fb))

    def forward_eager(self, fb):
        return super().forward_eager(self.to_fb(fb))

    def init_replay_metadata(self, num_tokens, view, raw_fb):
        super().init_replay_metadata(num_tokens, view, self.to_fb(raw_fb))

    def make_dummy_batch(self, num_tokens):
        e = torch.zeros(0, dtype=torch.int64)
        return PlainExtend(e, e, e, e, e, e, ())


def test_a_prefill_batch_without_forward_mode_runs_the_prefill_graph():
    rt = build_reference_model(max_num_reqs=64)
    adapter = PlainPrefillAdapter(rt)
    runner = PrefillGraphRunner(adapter, capture="breakable", token_buckets=[16, 32], progress=False)
    seen = 0
    for fb in mixed_batches(rt, seed=5, sizes=(1, 3, 4), max_len=6):
        batch = as_plain_extend(fb)
        assert adapter.is_prefill(batch) and adapter.batch_size(batch) == fb.batch_size
        assert runner.can_run(batch)
        out = runner(batch).clone()
        assert torch.equal(out, rt.forward(fb))
        seen += 1
    assert seen >= 4


def test_a_prefill_dummy_missing_a_field_fails_at_construction():
    class Forgetful(PlainPrefillAdapter):
        def make_dummy_batch(self, num_tokens):
            return dataclasses.replace(super().make_dummy_batch(num_tokens), positions=None)

    with pytest.raises(gs.SlotError, match=r"^spec 'prefill': the PlainExtend from Forgetful\.make_dummy_batch has "
                                           r"no 'positions'"):
        PrefillGraphRunner(Forgetful(build_reference_model(max_num_reqs=4)), token_buckets=[16], progress=False)


def test_an_old_slice_output_override_fails_at_construction():
    class OldSignature(PlainAdapter):
        def slice_output(self, output, raw_bs, raw_num_tokens):
            return output[:raw_num_tokens]

    with pytest.raises(TypeError, match=r"^OldSignature\.slice_output must take \(output, raw_bs, raw_num_tokens, "
                                        r"\*, padded_bs, padded_num_tokens\)"):
        DecodeGraphRunner(OldSignature(build_reference_model(max_num_reqs=4)), max_bs=2, progress=False)
