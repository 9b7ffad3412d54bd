"""Replay of a captured tape: :class:`TapeGraph` re-runs the recorded ops on the
memory the capture's tensors had (:class:`~.ops.Pins`) and writes each result where
the op put it at capture."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

import torch

from ..backend import GraphCaptureError
from .checks import unsupported_error
from .ops import Record, meta, storage, tensors


def _naming_op(rec: Record, build: Callable[[Record], Any]) -> Any:
    """``build(rec)``, any failure turned into a GraphCaptureError naming the op."""
    try:
        return build(rec)
    except GraphCaptureError:
        raise
    except Exception as e:
        raise unsupported_error(str(rec.func), f"{type(e).__name__}: {e}") from e


def _copy_into(dst: torch.Tensor, call: Callable[[], torch.Tensor]) -> None:
    dst.copy_(call())


def _copy_many(pairs: list[tuple[int, torch.Tensor]], call: Callable[[], Any]) -> None:
    result = call()
    for i, dst in pairs:
        dst.copy_(result[i])


def _run_collective(call: Callable[[], Any], fresh: list[tuple[int, torch.Tensor]]) -> None:
    """Issue a recorded collective, wait for it, and put fresh results where capture had them."""
    result = call()
    results = result if isinstance(result, (tuple, list)) else (result,)
    for x in results:
        if isinstance(x, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(x)  # no-op unless work is pending on x
        elif hasattr(x, "wait"):  # c10d's ops return their Work
            x.wait()
    for i, dst in fresh:
        dst.copy_(results[i])


class TapeGraph:
    """A captured op tape; :meth:`replay` re-runs it on the capture's tensors.

    An :class:`~graphslot.graphs.backend.InspectableGraph`: it lists the tensors it
    reads that nothing keeps current (:meth:`external_inputs`). ``owner``: the backend
    that captured it, whose ``replays`` each :meth:`replay` counts.
    """

    def __init__(
        self, records: list[Record], output: Any, given: Optional[dict[int, torch.Tensor]] = None, owner: Any = None
    ) -> None:
        self.output = output
        self.owner = owner
        self.ops: list[str] = [str(r.func) for r in records]
        self._records = records
        #: id of a recorded tensor (a :class:`~.ops.Pins` alias) -> the tensor the op got
        self._given = given or {}
        sizes = self._produced_storages()
        #: Storages the graph allocates or writes: its own, never a stale input.
        self.produced: set[int] = set(sizes)
        #: Bytes of those storages: what the graph holds in its pool.
        self.nbytes = sum(sizes.values())
        steps = (_naming_op(r, self._step) for r in self._records)
        self._steps = [s for s in steps if s is not None]

    @property
    def num_replay_ops(self) -> int:
        return len(self._steps)

    def replay(self) -> None:
        # Inference mode: no autograd bookkeeping, and in-place writes into
        # inference tensors made by a capture under inference_mode are allowed.
        with torch.inference_mode():
            for step in self._steps:
                step()
        if self.owner is not None:
            self.owner.replays += 1

    @staticmethod
    def _fresh_outputs(rec: Record) -> list[tuple[int, torch.Tensor]]:
        """(position, tensor) of outputs in new memory; ``_unsafe_view`` is a view by another name."""
        inputs = {storage(t) for t in tensors((rec.args, rec.kwargs))}
        outs = rec.out if isinstance(rec.out, (tuple, list)) else (rec.out,)
        return [(i, t) for i, t in enumerate(outs)
                if isinstance(t, torch.Tensor) and storage(t) not in inputs]

    def _produced_storages(self) -> dict[int, int]:
        """Bytes of each storage the graph produced, by address."""
        made: list[torch.Tensor] = []
        for rec in self._records:
            if rec.info.kind == "alloc":
                made.extend(tensors(rec.out))
            elif rec.info.kind == "scalar":  # a host scalar is the graph's own too
                made.extend(tensors((rec.args, rec.out)))
            elif rec.info.kind in ("compute", "collective"):
                made.extend(t for _, t in self._fresh_outputs(rec))
        return {storage(t): t.untyped_storage().nbytes() for t in made}

    def _step(self, rec: Record) -> Optional[Callable[[], Any]]:
        kind = rec.info.kind
        if kind in ("alloc", "view"):
            return None  # no kernel; views alias storage that replay updates
        if kind == "scalar":
            return functools.partial(rec.out.copy_, rec.value)
        call = functools.partial(rec.func, *rec.args, **rec.kwargs)
        if kind == "collective":
            return functools.partial(_run_collective, call, self._fresh_outputs(rec))
        if kind == "mutate":
            return call
        if isinstance(rec.out, torch.Tensor):
            fresh = self._fresh_outputs(rec)
            return functools.partial(_copy_into, rec.out, call) if fresh else None
        if isinstance(rec.out, (tuple, list)):
            fresh = self._fresh_outputs(rec)
            return functools.partial(_copy_many, fresh, call) if fresh else None
        return call  # no tensor output (an assert, say): re-run it for its effect

    def external_inputs(self, statics: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Tensors the graph reads that it neither made nor was told are static.

        On a GPU these are addresses baked into the graph at capture: writing a
        new tensor to the same Python name later does not reach the graph.
        In-place targets count as reads; write-only ``out=`` arguments do not.
        One tensor per storage, in the order the graph first reads them.
        """
        known = self.produced | {storage(t) for t in statics}
        found: dict[int, torch.Tensor] = {}
        for rec in self._records:
            if rec.info.kind in ("alloc", "scalar"):
                continue  # empty_like(t) reads no data; host scalars are the graph's own
            reads = [rec.args] + [v for k, v in rec.kwargs.items() if k not in rec.info.out_kwargs]
            for t in tensors(reads):
                ptr = storage(t)
                if ptr and ptr not in known and ptr not in found:
                    found[ptr] = self._named(t)
        return list(found.values())

    def _named(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor an op got, for ``t`` pinned to it, while it still is what ``t`` reads."""
        given = self._given.get(id(t))
        same = given is not None and storage(given) == storage(t) and meta(given) == meta(t)
        return given if same else t

    def describe_external_inputs(self, statics: Iterable[torch.Tensor] = ()) -> list[str]:
        """``"(4, 8) float32"`` per external input, for error messages."""
        return [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                for t in self.external_inputs(statics)]

    def __repr__(self) -> str:
        return f"TapeGraph({len(self.ops)} ops, {self.num_replay_ops} replayed)"
