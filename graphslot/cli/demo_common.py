"""What the demo workloads share (torch): the device, one intra-op thread, timing, and the
fill timings every demo reports."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..api import build_registry

FILL_REPEATS = 2000


@contextlib.contextmanager
def single_thread():
    """A model this small gains nothing from intra-op threads, and on a busy machine
    spinning OpenMP workers make every step several times slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def demo_device(backend: str) -> torch.device:
    """Where the demo model lives: ``auto`` takes the GPU when there is one."""
    cuda = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> Tuple[Any, float]:
    """``fn()`` and its wall time in seconds, the device's queue drained on both ends."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def _median_us(call: Callable[[], Any], repeats: int = FILL_REPEATS) -> float:
    """Median per-call time of ``call()`` over five rounds (µs)."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats // 5):
            call()
        rounds.append((time.perf_counter() - start) / (repeats // 5) * 1e6)
    return statistics.median(rounds)


def fill_timings(spec: str, registry: Any, fill: Callable[[Any], Any], label: str) -> Dict[str, Any]:
    """Generated vs interpreted ``fill(registry)`` on one real batch, into fresh registries
    shaped like ``registry`` (the runner's own buffers stay as they are)."""
    out: Dict[str, Any] = {"fill_batch": label}
    for mode in ("generated", "interpreted"):
        fresh = build_registry(spec, max_bs=registry.max_bs, max_num_tokens=registry.max_num_tokens,
                               device=registry.device, params=registry.params, impl=mode)
        out[f"fill_us_{mode}"] = _median_us(lambda: fill(fresh))
    return out


def representative(batches: List[Any], graphs: Dict[int, Any], size: Callable[[Any], int]) -> Any:
    """A batch that needs padding (no graph of its own size), of middling size: the
    common case of a server."""
    padded = [b for b in batches if size(b) not in graphs] or list(batches)
    padded.sort(key=lambda b: (b.batch_size, size(b)))
    return padded[len(padded) // 2]


def run_figures(runner: Any, device: torch.device, check: str, max_bs: int) -> Dict[str, Any]:
    """What every demo's JSON says of how it ran: graph backend, device, registry, check,
    torch and the largest batch."""
    return {"backend": runner.backend.name, "device": str(device), "registry_mode": runner.registry.impl,
            "check": check, "torch": torch.__version__, "max_bs": max_bs}
