"""The ``cuda`` graph backend: ``torch.cuda.CUDAGraph`` with one shared pool.

All graphs of one backend draw from one memory pool (its own, or the engine's handle
given as ``pool=``, which several backends may share), so a runner capturing several
batch sizes pays for the largest one only -- provided it captures the largest size
first (the runner's job). Nothing here touches CUDA at import or construction time, so
the module is safe on a CPU-only build of torch.

No process-global state is changed unless asked: ``fresh_cublas_workspace=True``
clears cuBLAS's workspaces before the backend's first capture (:func:`capturing` says
why an engine whose process also runs torch.compile's CUDAGraph Trees wants that).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator, Optional

import torch

from .backend import GraphCaptureError
from .util import no_collection

_CAPTURE_HINT = (
    "common causes are a host sync (.item(), .tolist(), bool(tensor)), a data-dependent "
    "shape (nonzero, x[mask]) or a host<->device copy inside the captured function; "
    "capture it with the 'cpu' graph backend to get the offending op named"
)


@contextlib.contextmanager
def capturing(graph: "torch.cuda.CUDAGraph", pool: Any, stream: "torch.cuda.Stream", *,
              fresh_workspace: bool) -> Iterator[None]:
    """``torch.cuda.graph`` with no collection; ``fresh_workspace``: a cuBLAS workspace
    the graphs own.

    cuBLAS keeps one workspace per handle and stream in the caching allocator, made at
    the first matmul (the warm-up) and baked into every graph captured after it. Whoever
    clears the workspaces later -- torch.compile's CUDAGraph Trees does before each
    recording -- frees that memory under our graphs: their matmuls then write into other
    tensors, or into memory given back to the driver (an illegal address). Cleared just
    before a backend's first capture, the workspace is allocated inside it, from the
    graphs' pool, which lives as long as they do; later captures on the same stream
    reuse it (the graphs never run at once). Cleared before every capture instead, each
    graph's workspace would go back to the pool, where the next capture could place its
    outputs -- which replaying the earlier graph would then overwrite.
    """
    if fresh_workspace:
        torch._C._cuda_clearCublasWorkspaces()
    with no_collection(), torch.cuda.graph(graph, pool=pool, stream=stream):
        yield


class CudaGraphWrapper:
    """A captured ``torch.cuda.CUDAGraph`` and the static tensors it returned; ``backend``:
    the backend that captured it, whose ``replays`` each :meth:`replay` counts."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", output: Any, pool: Any, backend: Any = None) -> None:
        self.graph = graph
        self.output = output
        self.pool = pool
        self.backend = backend

    def replay(self) -> None:
        self.graph.replay()
        if self.backend is not None:
            self.backend.replays += 1


class CudaGraphBackend:
    """Graph backend ``cuda``; captures into its memory pool on the stream it is given
    (``capture(..., stream=)``: the engine's capture stream), else on a side stream of
    its own.

    ``pool``: the engine's graph pool handle (``torch.cuda.graph_pool_handle()``), shared
    with whoever else it gave it to; None: the backend makes its own. ``fresh_cublas_workspace``:
    clear cuBLAS's workspaces before the first capture (a process-global change, off
    unless the engine asks; see :func:`capturing`)."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda", *, pool: Any = None,
                 fresh_cublas_workspace: bool = False) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"the 'cuda' graph backend needs a CUDA device, got {self.device}")
        self._given_pool = pool
        self._pool: Optional[Any] = pool
        self.fresh_cublas_workspace = bool(fresh_cublas_workspace)
        self._stream: Optional["torch.cuda.Stream"] = None
        self._captures = 0
        #: Replays of the graphs this backend captured, counted by the graphs themselves.
        self.replays = 0

    @property
    def pool(self) -> Any:
        """The pool handle every graph of this backend is captured into (made on first use)."""
        if self._pool is None:
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def capture_stream(self, stream: Optional["torch.cuda.Stream"] = None) -> "torch.cuda.Stream":
        """The stream a capture runs on: ``stream`` when given, else the backend's own
        side stream (made on first use). The pool is made first."""
        self.pool  # noqa: B018 -- made now, before the capture stream
        if stream is not None:
            return stream
        if self._stream is None:
            with torch.cuda.device(self.device):
                self._stream = torch.cuda.Stream()
        return self._stream

    def _capturing(self, graph: "torch.cuda.CUDAGraph", stream: "torch.cuda.Stream") -> Any:
        self._captures += 1
        return capturing(graph, self._pool, stream,
                         fresh_workspace=self.fresh_cublas_workspace and self._captures == 1)

    def release(self) -> None:
        """After the caller dropped every graph: the backend's own pool goes back to the
        driver (a new one is made at the next capture); a pool it was given is left to
        its owner."""
        self._captures = 0
        if self._given_pool is None and self._pool is not None:
            self._pool = None
            gc.collect()  # graphs in reference cycles hold their pool's blocks
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def begin_capture(self, stream: Optional["torch.cuda.Stream"] = None) -> "OpenCudaCapture":
        """Start capturing into the shared pool now, on ``stream`` (None: the backend's
        own); ``end(output)`` returns the graph. For runners that cut one run of Python
        code into several graphs."""
        return OpenCudaCapture(self, self.capture_stream(stream))

    def warm_up(self, fn: Callable[[], Any], times: int, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """``times`` eager calls of ``fn`` on the capture stream: lazy inits (cuBLAS
        handles, autotuning) happen outside the graph, on the stream the graph will use."""
        if times < 1:
            return
        stream = self.capture_stream(stream)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(times):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()

    def capture(self, fn: Callable[[], Any], *, warmup: int = 1,
                stream: Optional["torch.cuda.Stream"] = None) -> CudaGraphWrapper:
        """``warmup`` eager calls (:meth:`warm_up`; none: no synchronize), then one
        captured, on ``stream`` (None: the backend's own side stream)."""
        stream = self.capture_stream(stream)
        self.warm_up(fn, warmup, stream)
        with torch.cuda.device(self.device):
            graph = torch.cuda.CUDAGraph()
            try:
                with self._capturing(graph, stream):
                    output = fn()
            except RuntimeError as e:
                if isinstance(e, GraphCaptureError) or "captur" not in str(e).lower():
                    raise
                raise GraphCaptureError(f"CUDA graph capture failed: {e}; {_CAPTURE_HINT}") from e
        return CudaGraphWrapper(graph, output, self._pool, self)


class OpenCudaCapture:
    """A ``torch.cuda.graph`` capture in progress on the backend's pool and a stream."""

    def __init__(self, backend: CudaGraphBackend, stream: "torch.cuda.Stream") -> None:
        self.backend = backend
        self.graph = torch.cuda.CUDAGraph()
        self._open = contextlib.ExitStack()
        self._open.enter_context(backend._capturing(self.graph, stream))

    def end(self, output: Any) -> CudaGraphWrapper:
        self._open.close()
        return CudaGraphWrapper(self.graph, output, self.backend.pool, self.backend)

    def abort(self) -> None:
        try:
            self._open.__exit__(RuntimeError, RuntimeError("aborted"), None)
        except Exception:  # the capture is being abandoned; its own error is not the news
            pass
