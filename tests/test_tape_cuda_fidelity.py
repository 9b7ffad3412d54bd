"""Where the ``cpu`` tape differs from a CUDA graph: one test (at least) per row of the
table in :mod:`graphslot.graphs.tape`'s docstring, each marked with the row's id."""

from __future__ import annotations

import array
import threading

import pytest

try:  # torch runs without NumPy; the cases that make host data with it need it
    import numpy as np
except ImportError:
    np = None
NEEDS_NUMPY = pytest.mark.skipif(np is None, reason="needs NumPy (not a graphslot dependency)")
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch as python_dispatch
from torch import nn

from graphslot.graphs import tape
from graphslot.graphs.backend import GraphCaptureError, get_graph_backend
from graphslot.graphs.tape import TapeBackend, TapeGraph
from graphslot.reference.model import RMSNorm

TESTED: dict[str, list[str]] = {}


def difference(row: str):
    """Mark a test as the check of one row of the tape's table of differences."""

    def mark(test):
        TESTED.setdefault(row, []).append(test.__name__)
        return test

    return mark


def capture(fn, warmup=0) -> TapeGraph:
    return TapeBackend().capture(fn, warmup=warmup)


def table_rows() -> list[str]:
    """The ids in the first column of the docstring's table (an RST simple table)."""
    lines = tape.__doc__.split("Differences from CUDA graphs", 1)[1].splitlines()
    borders = [i for i, line in enumerate(lines) if line.startswith("=====")]
    assert len(borders) == 3, "the table is three border lines: top, under the header, bottom"
    body = lines[borders[1] + 1:borders[2]]
    return [line.split()[0] for line in body if line[:1].strip()]


H2D = (
    "host-to-device copy during graph capture: aten.lift_fresh.default (torch.tensor, "
    "torch.as_tensor, torch.from_numpy, Tensor.new_tensor or a list index); a CUDA graph cannot "
    "copy host data to the device during capture; allocate the tensor before capture (a static "
    "buffer filled before each replay), build it on the device (torch.zeros/full/arange) or use a "
    "Python scalar"
)
D2H_HINT = (
    "a CUDA graph cannot copy device values to the host during capture (the copy syncs); keep "
    "the value on the device or read the graph's output after replay"
)
x = torch.arange(4.0)


# -- the table and the tests agree -------------------------------------------------------------


def test_every_row_of_the_table_has_a_test_and_every_test_a_row():
    rows = table_rows()
    assert len(rows) == len(set(rows)), "row ids are unique"
    assert set(rows) - set(TESTED) == set(), "rows with no @difference test"
    assert set(TESTED) - set(rows) == set(), "@difference ids that are no row of the table"


# -- host-to-device ----------------------------------------------------------------------------


@difference("host-to-device")
@pytest.mark.parametrize(
    "fn",
    [
        lambda: x + torch.tensor([1.0, 2.0, 3.0, 4.0]),
        lambda: x + torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device),
        lambda: x + torch.as_tensor([1.0, 2.0, 3.0, 4.0]),
        pytest.param(lambda: x + torch.from_numpy(np.ones(4, dtype=np.float32)).to(x.device), marks=NEEDS_NUMPY),
        pytest.param(lambda: x.copy_(torch.from_numpy(np.ones(4, dtype=np.float32))), marks=NEEDS_NUMPY),
        lambda: x + x.new_tensor([1.0, 2.0, 3.0, 4.0]),
        lambda: x[[0, 2]],
    ],
    ids=["tensor", "tensor-device", "as_tensor", "from_numpy-to", "copy_-from-numpy", "new_tensor",
         "list-index"],
)
def test_host_data_copied_in_is_a_capture_error(fn):
    with pytest.raises(GraphCaptureError) as err:
        capture(fn)
    assert str(err.value) == H2D


@difference("host-to-device")
def test_allocations_and_device_copies_capture_fine():
    inp, static = torch.ones(4), torch.zeros(4)

    def fn():
        made = torch.stack([torch.zeros(4), torch.ones_like(inp), torch.full((4,), 2.0),
                            torch.arange(4.0), torch.empty(4).fill_(3.0)])
        static.copy_(inp * 2)  # device to device
        return made, inp.to(torch.float16), inp.type_as(torch.zeros(1, dtype=torch.long)), inp.clone()

    graph = capture(fn)
    inp.fill_(5.0)
    graph.replay()
    made, half, long, clone = graph.output
    assert made.tolist() == [[0.0] * 4, [1.0] * 4, [2.0] * 4, [0.0, 1.0, 2.0, 3.0], [3.0] * 4]
    assert static.tolist() == [10.0] * 4
    assert half.tolist() == long.tolist() == clone.tolist() == [5.0] * 4


# -- host-scalar-tensor ------------------------------------------------------------------------


@difference("host-scalar-tensor")
def test_a_0_dim_host_tensor_is_a_constant_of_the_graph():
    buf = torch.zeros(4)

    def fn():
        buf[0] = 7.0  # a 0-dim host tensor, then a device copy
        return buf * torch.tensor(2.0), torch.tensor(3.0, device=x.device) + buf

    graph = capture(fn)
    buf.fill_(1.0)
    graph.replay()
    assert graph.output[0].tolist() == [14.0, 2.0, 2.0, 2.0]
    assert graph.output[1].tolist() == [10.0, 4.0, 4.0, 4.0]


# -- device-to-host ----------------------------------------------------------------------------


@difference("device-to-host")
@pytest.mark.parametrize(
    "fn, what",
    [
        (lambda: x.cpu(), "Tensor.cpu()"),
        (lambda: x.to("cpu"), "Tensor.to('cpu')"),
        (lambda: x.to("cpu", torch.float16), "Tensor.to('cpu')"),
        (lambda: x.to(device="cpu"), "Tensor.to('cpu')"),
        (lambda: (x + 1).to("cpu:0", non_blocking=True), "Tensor.to('cpu:0')"),
    ],
    ids=["cpu", "to", "to-dtype", "to-device-kwarg", "to-non-blocking"],
)
def test_a_copy_to_the_host_is_a_capture_error(fn, what):
    with pytest.raises(GraphCaptureError) as err:
        capture(fn)
    assert str(err.value) == f"device-to-host copy during graph capture: {what}; {D2H_HINT}"


@difference("device-to-host")
def test_host_copies_work_again_after_capture():
    with pytest.raises(GraphCaptureError):
        capture(lambda: x.cpu())
    assert x.cpu() is x and x.to("cpu") is x
    assert not {"cpu", "to", "tolist", "numpy"} & set(torch.Tensor.__dict__)


# -- device-object-to ----------------------------------------------------------------------------


@difference("device-object-to")
def test_a_move_to_a_torch_device_is_taken_for_the_device():
    graph = capture(lambda: (x.to(x.device), x.to(torch.device("cpu")),
                             x.to(device=x.device, dtype=torch.float16)))
    assert graph.output[0] is x and graph.output[1] is x
    assert graph.ops == ["aten._to_copy.default"]


# -- host-sync and dynamic-shape (the full lists are in test_tape.py) ------------------------------


@difference("host-sync")
@pytest.mark.parametrize("fn", [lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x[0])],
                         ids=["item", "tolist", "bool"])
def test_a_host_sync_is_a_capture_error(fn):
    with pytest.raises(GraphCaptureError, match="^host sync during graph capture: "):
        capture(fn)


@difference("dynamic-shape")
def test_a_data_dependent_shape_is_a_capture_error():
    with pytest.raises(GraphCaptureError,
                       match=r"^data-dependent output shape during graph capture: aten\.nonzero\.default; "):
        capture(lambda: x.nonzero())


# -- host-tensor-reads / host-tensor-unseen / hidden-host-read -------------------------------------


@difference("host-tensor-reads")
def test_reading_a_tensor_meant_for_the_host_is_rejected_too():
    seq_lens_cpu = torch.tensor([3, 5])  # made before capture, on the host on a GPU too
    with pytest.raises(GraphCaptureError, match=r"^host sync during graph capture: Tensor\.tolist\(\)"):
        capture(lambda: [int(n) for n in seq_lens_cpu.tolist()])


@difference("host-tensor-unseen")
def test_a_host_tensor_made_before_capture_reads_as_a_device_value():
    host = torch.frombuffer(array.array("f", [1.0] * 4), dtype=torch.float32)
    graph = capture(lambda: x + host)  # a device mismatch on a GPU
    assert graph.external_inputs([x]) == [host]


@difference("hidden-host-read")
def test_a_host_read_that_bypasses_the_patched_methods_is_not_seen():
    tolist = torch.Tensor.tolist  # saved before capture: the unpatched method
    graph = capture(lambda: x * tolist(x)[1])
    assert graph.ops == ["aten.mul.Tensor"]


# -- cpu-kernel-sync ------------------------------------------------------------------------------


@difference("cpu-kernel-sync")
def test_a_cpu_kernel_that_syncs_where_cuda_does_not_is_rejected():
    index = torch.tensor([0, 3, 1])
    with pytest.raises(GraphCaptureError, match=r"^host sync during graph capture: "
                                                r"aten\._local_scalar_dense"):
        capture(lambda: F.one_hot(index, 4))  # fine on a GPU


# -- overlapping-captures / other-threads -----------------------------------------------------------


def _host_reads_work() -> bool:
    return (x.tolist() == [0.0, 1.0, 2.0, 3.0] and (np is None or x.numpy().shape == (4,)) and x.cpu() is x
            and x.to("cpu") is x)


def _no_capture_left() -> bool:
    return (not {"cpu", "to", "tolist", "numpy"} & set(torch.Tensor.__dict__)
            and not python_dispatch._get_current_dispatch_mode_stack()
            and not python_dispatch.is_in_torch_dispatch_mode())


@difference("overlapping-captures")
def test_captures_begun_a_b_can_end_a_b():
    backend = TapeBackend()
    a = backend.begin_capture()
    out_a = x + 1
    b = backend.begin_capture()
    out_b = x * 2  # the innermost open capture records
    graph_a = a.end(out_a)
    graph_b = b.end(out_b - 1)  # a has ended, b still records
    assert graph_a.ops == ["aten.add.Tensor"]
    assert graph_b.ops == ["aten.mul.Tensor", "aten.sub.Tensor"]
    assert _host_reads_work() and _no_capture_left()


@difference("overlapping-captures")
def test_captures_begun_a_b_can_end_b_a():
    backend = TapeBackend()
    a = backend.begin_capture()
    out_a = x + 1
    b = backend.begin_capture()
    graph_b = b.end(x * 2)
    graph_a = a.end(out_a - 1)  # b has ended: a records again
    assert graph_a.ops == ["aten.add.Tensor", "aten.sub.Tensor"]
    assert graph_b.ops == ["aten.mul.Tensor"]
    assert _host_reads_work() and _no_capture_left()


@difference("overlapping-captures")
def test_a_host_read_fails_the_innermost_capture():
    backend = TapeBackend()
    a = backend.begin_capture()
    b = backend.begin_capture()
    with pytest.raises(GraphCaptureError, match=r"Tensor\.tolist\(\)"):
        x.tolist()
    with pytest.raises(GraphCaptureError, match=r"Tensor\.tolist\(\)"):
        b.end(None)
    with pytest.raises(GraphCaptureError, match=r"Tensor\.cpu\(\)"):
        x.cpu()  # a is still open
    a.abort()
    assert _host_reads_work() and _no_capture_left()


@difference("overlapping-captures")
def test_overlapping_captures_in_two_threads_end_in_any_order():
    steps = [threading.Event() for _ in range(3)]
    graphs, errors = {}, []

    def a():
        c = TapeBackend().begin_capture()
        y = x + 1
        steps[0].set()
        steps[1].wait(5)
        graphs["a"] = c.end(y)  # a began first and ends first
        steps[2].set()

    def b():
        steps[0].wait(5)
        c = TapeBackend().begin_capture()
        y = x * 2
        steps[1].set()
        steps[2].wait(5)
        try:
            y.tolist()  # b is still capturing
        except GraphCaptureError as e:
            errors.append(e)
        c.abort()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert graphs["a"].ops == ["aten.add.Tensor"]
    assert len(errors) == 1
    assert _host_reads_work() and _no_capture_left()


@difference("overlapping-captures")
def test_a_capture_ends_once_and_in_its_own_thread():
    c = TapeBackend().begin_capture()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(GraphCaptureError, c.abort)))
    t.start()
    t.join(10)
    assert "must end (or abort) in the thread that began it" in str(errors[0].value)
    c.end(None)
    c.abort()  # abandoning an ended capture does nothing
    with pytest.raises(GraphCaptureError, match="^this tape capture has already ended$"):
        c.end(None)
    assert _host_reads_work() and _no_capture_left()


@difference("other-threads")
def test_a_thread_that_is_not_capturing_reads_the_host_freely():
    c = TapeBackend().begin_capture()
    seen = []
    try:
        t = threading.Thread(target=lambda: seen.append(_host_reads_work()))
        t.start()
        t.join(10)
    finally:
        c.abort()
    assert seen == [True]


# -- unsupported-op ------------------------------------------------------------------------------


@difference("unsupported-op")
@pytest.mark.parametrize(
    "fn, op, why",
    [
        (lambda: x.to_sparse(), "aten._to_sparse.default", "it touches a sparse_coo tensor"),
        (lambda: x.to_mkldnn(), "aten.to_mkldnn.default", "it touches a _mkldnn tensor"),
        (lambda: torch.sparse.mm(sparse, x.reshape(4, 1)), "aten._sparse_addmm.default",
         "it touches a sparse_coo tensor"),
    ],
    ids=["to_sparse", "to_mkldnn", "sparse-input"],
)
def test_an_op_the_tape_cannot_record_is_a_capture_error_naming_it(fn, op, why):
    with pytest.raises(GraphCaptureError) as err:
        capture(fn)
    assert str(err.value) == (
        f"the cpu graph backend cannot record {op}: {why}; run it outside the graph (before "
        "capture, or in an eager segment) or use dense strided tensors"
    )


sparse = torch.eye(4).to_sparse()


@difference("unsupported-op")
def test_a_failure_inside_the_tape_is_a_capture_error_naming_the_op(monkeypatch):
    def broken(t):
        raise ValueError("no metadata")

    monkeypatch.setattr(tape.record, "meta", broken)  # what the recorder reads of each tensor
    with pytest.raises(GraphCaptureError) as err:
        capture(lambda: x + 1)
    assert str(err.value) == (
        "the cpu graph backend cannot record aten.add.Tensor: ValueError: no metadata; run it "
        "outside the graph (before capture, or in an eager segment) or use dense strided tensors"
    )


@difference("unsupported-op")
def test_a_failure_building_the_replay_is_a_capture_error_naming_the_op(monkeypatch):
    def broken(self, rec):
        raise TypeError("no step")

    monkeypatch.setattr(TapeGraph, "_step", broken)
    with pytest.raises(GraphCaptureError, match=r"^the cpu graph backend cannot record "
                                                r"aten\.mul\.Tensor: TypeError: no step; "):
        capture(lambda: x * 2)


# -- poisoned-capture / frozen-python / capture-allocations ----------------------------------------


@difference("poisoned-capture")
def test_a_capture_error_the_callable_catches_still_fails_the_capture():
    def fn():
        try:
            x.sum().item()
        except GraphCaptureError:
            pass
        return x + 1

    with pytest.raises(GraphCaptureError, match=r"^host sync during graph capture: aten\._local_scalar_dense"):
        capture(fn)


@difference("frozen-python")
def test_python_branches_scalars_and_names_are_frozen_at_capture():
    state = {"double": False, "scale": 3.0, "tensor": torch.ones(4)}
    graph = capture(lambda: (state["tensor"] * 2 if state["double"] else state["tensor"] + 1) * state["scale"])
    first = state["tensor"]
    state.update(double=True, scale=100.0, tensor=torch.full((4,), 7.0))
    first.fill_(5.0)
    graph.replay()
    assert graph.output.tolist() == [18.0] * 4  # (5 + 1) * 3: the branch, scalar and tensor of capture


@difference("capture-allocations")
def test_memory_allocated_in_a_capture_keeps_its_address_and_empty_is_not_refilled():
    static = torch.ones(4)
    made = {}

    def fn():
        made["empty"] = torch.empty(4)  # no kernel: replay leaves it as it is
        made["zeros"] = torch.zeros(4)  # a fill kernel: rewritten every replay
        made["zeros"][1:].add_(static[1:])
        return made["zeros"] * 2

    graph = capture(fn)
    out = graph.output
    addresses = [t.data_ptr() for t in (made["empty"], made["zeros"], out)]
    made["empty"].fill_(9.0)
    made["zeros"].fill_(9.0)
    static.fill_(3.0)
    graph.replay()
    assert graph.output is out and [t.data_ptr() for t in (made["empty"], made["zeros"], out)] == addresses
    assert made["empty"].tolist() == [9.0] * 4
    assert made["zeros"].tolist() == [0.0, 3.0, 3.0, 3.0] and out.tolist() == [0.0, 6.0, 6.0, 6.0]


# -- memory-pool / streams / rng -----------------------------------------------------------------


@difference("memory-pool")
def test_graphs_never_share_memory():
    backend = TapeBackend()
    kept = []

    def a():
        h = x * 3  # an intermediate: freed after capture on a GPU, its memory back in the pool
        kept.append(h.untyped_storage().data_ptr())
        return h + 1

    graph_a = backend.capture(a, warmup=0)
    graph_b = backend.capture(lambda: x - 1, warmup=0)
    b_before = graph_b.output.clone()
    graph_a.replay()  # on a GPU this may write where graph_b keeps its output
    assert torch.equal(graph_b.output, b_before)
    assert graph_b.output.untyped_storage().data_ptr() not in kept


@difference("streams")
def test_replay_has_finished_when_it_returns():
    static = torch.ones(4)
    graph = capture(lambda: static * 2)
    graph.replay()
    static.fill_(5.0)  # on a GPU, without a sync this races with the replay
    assert graph.output.tolist() == [2.0, 2.0, 2.0, 2.0]


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone (a store in memory, no port)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@difference("collectives")
def test_collectives_are_reissued_and_waited_for_at_replay(one_rank_group):
    import torch.distributed as dist

    funcol, name = torch.ops._c10d_functional, one_rank_group.group_name
    static = torch.ones(2, 3)
    c10d_out = torch.empty(2, 3)

    def step():
        gathered = funcol.wait_tensor(funcol.all_gather_into_tensor(static * 2, 1, name))
        reduced = funcol.wait_tensor(funcol.all_reduce_(gathered + 1, "sum", name))
        dist.all_gather_single(c10d_out, static + 5)  # c10d's own op, which returns its Work
        return gathered, reduced

    graph = capture(step)
    assert {"_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.all_reduce_.default",
            "c10d._allgather_base_.default"} <= set(graph.ops)
    static.fill_(3.0)
    graph.replay()
    gathered, reduced = graph.output
    assert gathered.unique().tolist() == [6.0]  # a stale or unwaited gather keeps 2.0 or garbage
    assert reduced.unique().tolist() == [7.0]
    assert c10d_out.unique().tolist() == [8.0]


@difference("collectives")
def test_async_collective_tensors_are_rejected_naming_the_direct_ops(one_rank_group):
    import torch.distributed._functional_collectives as funcol

    static = torch.ones(2, 3)
    with pytest.raises(GraphCaptureError, match="AsyncCollectiveTensor.*torch.ops._c10d_functional"):
        capture(lambda: funcol.all_gather_single(static, 0, one_rank_group) + 1)


@difference("rng")
def test_random_ops_draw_from_the_global_generator_at_replay():
    graph = capture(lambda: torch.rand(3))
    torch.manual_seed(0)
    plain = torch.rand(3)
    torch.manual_seed(0)
    graph.replay()
    assert torch.equal(graph.output, plain)  # the replay drew what eager code would have
    assert not torch.equal(torch.rand(3), plain)


# -- rebound-tensor ------------------------------------------------------------------------------

cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BACKENDS = ["cpu", pytest.param("cuda", marks=cuda_only)]


class Weights(nn.Module):
    """A tensor a graph reads, reached each way a model reaches one; ``step`` reads it
    from the static input ``x`` (ids, for the embedding)."""

    def __init__(self, how: str, device: str) -> None:
        super().__init__()
        self.how = how
        self.x = torch.randn(3, 4, device=device)
        self.ids = torch.tensor([2, 0, 5], device=device)
        self.emb = nn.Embedding(6, 4, device=device)
        self.norm = RMSNorm(4, 1e-6).to(device)
        self.lin = nn.Linear(4, 4, bias=False, device=device)
        self.register_buffer("scale", torch.randn(4, device=device))
        self.plain = torch.randn(4, device=device)  # an attribute, neither parameter nor buffer
        closed = torch.randn(4, device=device)
        self.closure = lambda x: x - closed  # a tensor held by a Python closure
        self.closed = closed

    @property
    def target(self) -> torch.Tensor:
        """The tensor the step reads (whose storage a weight reload rebinds)."""
        return {"embedding": self.emb.weight, "rmsnorm": self.norm.weight, "linear": self.lin.weight,
                "transposed": self.lin.weight, "buffer": self.scale, "attribute": self.plain,
                "closure": self.closed}[self.how]

    def step(self) -> torch.Tensor:
        if self.how == "embedding":
            return self.emb(self.ids) * 1  # the Parameter itself reaches aten.embedding
        if self.how == "rmsnorm":
            return self.norm(self.x)  # the Parameter itself reaches aten.mul
        if self.how == "linear":
            return self.lin(self.x)  # F.linear takes a view (aten.t) of the Parameter
        if self.how == "transposed":
            return self.x @ self.lin.weight.t()
        if self.how == "buffer":
            return self.x * self.scale
        if self.how == "attribute":
            return self.x * self.plain
        return self.closure(self.x)


WAYS = ["embedding", "rmsnorm", "linear", "transposed", "buffer", "attribute", "closure"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on the CPU; on a GPU, a graph's kernels may differ from eager ones in the last bits."""
    return torch.equal(a, b) if a.device.type == "cpu" else torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def captured(weights: Weights, backend: str):
    with torch.no_grad():
        return get_graph_backend(backend, weights.x.device).capture(weights.step, warmup=1)


@difference("rebound-tensor")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", WAYS)
def test_a_tensor_rebound_after_capture_is_not_seen(how, backend):
    weights = Weights(how, "cpu" if backend == "cpu" else "cuda")
    graph = captured(weights, backend)
    with torch.no_grad():
        before = weights.step().clone()
        old = weights.target.data  # kept: on a GPU the graph reads this memory
        weights.target.data = old + 1.0  # what weight loaders do
        after = weights.step()
        graph.replay()
        assert not same(after, before)
        assert same(graph.output, before)  # stale: the capture-time storage
        weights.target.data.mul_(3.0)  # a write into the new storage: not seen either
        graph.replay()
        assert same(graph.output, before)
        old.add_(2.0)  # a write into the storage the graph was captured with: seen
        graph.replay()
        weights.target.data = old
        assert same(graph.output, weights.step())


@difference("rebound-tensor")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("write", ["data.copy_", "copy_"])
@pytest.mark.parametrize("how", WAYS)
def test_a_tensor_written_in_place_after_capture_is_seen(how, write, backend):
    weights = Weights(how, "cpu" if backend == "cpu" else "cuda")
    graph = captured(weights, backend)
    with torch.no_grad():
        before = weights.step().clone()
        new = weights.target + 1.0
        (weights.target.data if write == "data.copy_" else weights.target).copy_(new)
        graph.replay()
        assert not same(graph.output, before)
        assert same(graph.output, weights.step())


@difference("rebound-tensor")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", WAYS)
def test_a_capture_after_rebinding_reads_the_new_tensor(how, backend):
    weights = Weights(how, "cpu" if backend == "cpu" else "cuda")
    captured(weights, backend)
    with torch.no_grad():
        weights.target.data = weights.target.data + 1.0
        expected = weights.step()
    graph = captured(weights, backend)
    graph.replay()
    assert same(graph.output, expected)


@difference("rebound-tensor")
def test_a_tensor_rebound_during_capture_is_read_as_each_op_saw_it():
    weight = nn.Parameter(torch.ones(4), requires_grad=False)
    first = weight.data
    second = torch.full((4,), 2.0)

    def fn():
        before = x * weight
        weight.data = second  # between two ops: each reads the storage it saw
        return before, x * weight

    graph = capture(fn)
    first.fill_(10.0)
    second.fill_(20.0)
    graph.replay()
    assert graph.output[0].tolist() == (x * 10).tolist() and graph.output[1].tolist() == (x * 20).tolist()
