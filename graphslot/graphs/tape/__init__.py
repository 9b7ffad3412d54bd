"""The ``cpu`` graph backend: CUDA-graph semantics on the CPU.

Capture runs the callable once under a TorchDispatchMode that records every
ATen op with its tensors, each pinned to the storage, shape, stride and offset
it had when the op ran (an alias of that memory, taken at record time). Replay
re-runs the recorded ops on that memory and writes each result into the tensor
the op produced at capture, so every address stays fixed -- rebinding a tensor
later (``p.data = new``) does not reach the graph, writing into it does -- and
Python control flow, Python scalars and shapes are frozen at capture -- exactly
what a CUDA graph does. It is not a
re-run of the Python function, so runner bugs that only a GPU graph would show
(stale inputs, values read on the host, data-dependent shapes, host data copied
in) show up in CPU tests too.

Modules: :mod:`.checks` (what a capture refuses, and its errors), :mod:`.ops` (how
each op is classified and recorded), :mod:`.record` (the recorder, captures opened and
closed per thread, :class:`TapeBackend`), :mod:`.replay` (:class:`TapeGraph`).

Host data and device values
---------------------------

Everything lives on the CPU here, so the tape models the two sides of a GPU by
where a tensor's data comes from, not by its device:

* every tensor an op reads or writes during capture is a *device value*: the
  static buffers, the parameters, and whatever the graph allocates
  (``torch.zeros/empty/full/arange``, op results, device-to-device copies);
* data made from Python during capture is *host data*: ``torch.tensor``,
  ``torch.as_tensor``, ``torch.from_numpy``, ``Tensor.new_tensor`` and an index
  given as a Python list all reach ATen as ``aten.lift_fresh``, which is
  therefore a host-to-device copy and is rejected -- unless it is 0-dim: a host
  scalar (``x[i] = 0.0`` makes one too) is a constant of the graph, as CUDA
  reads a 0-dim CPU operand at capture;
* ``.item()``, ``bool(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()`` and
  ``.to("cpu")`` are *host reads* of a device value and are rejected. The last
  four do not reach the dispatcher on a CPU tensor, so while any capture is open
  they are patched on ``torch.Tensor`` (once for the whole process, reference
  counted); the patched methods fail only in a thread that has a capture open.

Differences from CUDA graphs
----------------------------

Every row is checked by a test in ``tests/test_tape_cuda_fidelity.py`` marked
``@difference("<id>")``; a test there checks that rows and tests match.

======================  =========================================  ==========================================
id                      CUDA graph capture                         tape (this module)
======================  =========================================  ==========================================
host-to-device          torch.tensor / as_tensor / from_numpy /    rejected at ``aten.lift_fresh``:
                        new_tensor / ``x[[0, 1]]`` data copied     GraphCaptureError naming the op, saying
                        in: "Cannot copy between CPU and CUDA      to allocate the tensor before capture
                        tensors during CUDA graph capture"         (same as CUDA)
host-scalar-tensor      a 0-dim CPU tensor operand (``x *          0-dim host data is a constant of the
                        torch.tensor(2.0)``) is read at capture    graph, restored on every replay; it
                        and frozen; ``torch.tensor(2.0,            cannot tell the ``device=`` spelling
                        device="cuda")`` is a copy and fails       from the host one: allowed (laxer)
device-to-host          ``.cpu()``, ``.to("cpu")`` copy to the     ``Tensor.cpu()`` and ``Tensor.to()`` with
                        host: a sync, the capture fails            the device spelled ``"cpu"`` rejected
                                                                   (same as CUDA)
device-object-to        ``.to(torch.device("cpu"))`` is a          a ``torch.device`` target is taken for the
                        device-to-host copy and fails              device (``x.to(x.device)`` is a no-op on a
                                                                   GPU): allowed (laxer)
host-sync               ``.item()``, ``bool(t)``, ``if t:``,       rejected, naming the op or method
                        ``.tolist()``, ``.numpy()``,               (same as CUDA)
                        ``torch.equal`` sync: the capture fails
dynamic-shape           ``nonzero``, ``x[mask]``, ``unique``...    rejected, naming the op (same as CUDA)
                        sync for their output size
host-tensor-reads       reading a tensor that lives on the host    rejected: every tensor is a device
                        (``seq_lens_cpu.tolist()``) is no sync     value (stricter)
host-tensor-unseen      a host tensor made before capture, used    not seen: a tensor made before capture
                        with device tensors, fails (device         or by a path that does not dispatch
                        mismatch or host-to-device copy)           (``torch.frombuffer``) reads as a device
                                                                   value (laxer); ``external_inputs()``
                                                                   lists it when it is not declared static
hidden-host-read        a host read by any means fails or reads    only the patched methods are caught: a
                        stale data                                 method saved before capture, a
                                                                   ``memoryview`` or ``data_ptr()`` read
                                                                   passes (laxer)
cpu-kernel-sync         CUDA kernels of some ops do not sync       their CPU kernels do (``F.one_hot`` with
                                                                   ``num_classes`` checks indices with
                                                                   ``.item()``): rejected (stricter)
overlapping-captures    work goes to the capture of the current    work goes to the innermost open capture
                        stream; captures on one stream cannot      of the thread; captures overlap and end
                        overlap and ``torch.cuda.graph`` restores  in any order, in any threads; host reads
                        streams last-in-first-out                  fail only in a capturing thread
other-threads           in the default "global" capture mode,      other threads are not checked: their
                        unsafe CUDA calls from other threads       host reads work (laxer)
                        fail while a capture is open
unsupported-op          sparse and other layouts may capture       any op on a tensor that is not dense and
                                                                   strided, or that the tape cannot record,
                                                                   raises GraphCaptureError naming the op
                                                                   (stricter)
poisoned-capture        an op that fails stream capture            the same: the first GraphCaptureError
                        invalidates it: the callable catching the  fails the capture at ``end`` even if the
                        error does not save the capture, which     callable caught it
                        fails at its end
frozen-python           Python runs once, at capture: its          the same: replay re-runs the recorded ops,
                        branches, Python scalars and which tensor  not the function
                        a name or attribute holds are baked in
capture-allocations     memory allocated in a capture is the       the same (and no other graph writes there:
                        graph's, at fixed addresses:               see ``memory-pool``)
                        ``torch.empty`` runs no kernel (replay
                        leaves what the last replay wrote); fills
                        (``zeros``, ``full``, ``arange``) and
                        results are rewritten by every replay,
                        outputs in place
rebound-tensor          a graph reads the memory each tensor had   the same, for a tensor an op got itself
                        at capture: ``p.data = new`` after it      (an embedding's Parameter), through a view
                        (what weight loaders do) is not seen,      (``weight.t()`` in a linear layer), as a
                        in-place writes (``p.copy_(new)``,         buffer or from a closure: each is pinned
                        ``p.data.copy_(new)``) are; a new capture  at record time to its storage, size,
                        (``recapture()``) reads the new tensor.    stride and offset; the old storage is kept
                        Once nothing holds the old storage,        alive, so replay reads the old values
                        replay reads freed memory                  (laxer)
memory-pool             the graphs of a backend share one pool:    nothing is freed or shared: every tensor
                        memory freed during capture is reused,     keeps its own memory, so a replay never
                        so replaying one graph may overwrite       overwrites another graph's tensors
                        what another graph keeps there             (laxer)
streams                 replay is queued on a stream: reading an   no streams: replay runs to completion
                        output or writing a static input before    before it returns; nothing races (laxer)
                        a sync races with it
collectives             NCCL collectives (functional or c10d) are  re-issued over the process group (gloo on
                        kernels of the graph, launched on its      the CPU) at their place in the tape and
                        stream at replay; every rank must replay   waited for at once; every rank must
                        the same graph or the ranks hang           replay the same graph or the ranks hang
                                                                   (same); funcol's AsyncCollectiveTensor
                                                                   is rejected: call the ops directly
rng                     random ops use the seed and offset the     random ops re-run on the global CPU
                        graph registered, advanced per replay:     generator: new numbers each replay, the
                        new numbers each replay, not the ones      very ones eager code would have drawn
                        eager code would have drawn                next
======================  =========================================  ==========================================
"""

from .record import OpenTapeCapture, TapeBackend, TapePool
from .replay import TapeGraph

__all__ = ["OpenTapeCapture", "TapeBackend", "TapeGraph", "TapePool"]
