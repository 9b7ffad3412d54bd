"""Byte budgets: buffers over their cap are a wrong argument (``max_bs=10**9`` typed for ``10**3``),
refused with a :class:`BufferBudgetError` before a byte is allocated. The cap is ``max_bytes=``, else
``GRAPHSLOT_MAX_BUFFER_BYTES``, else :data:`DEFAULT_MAX_BUFFER_BYTES`; no buffer of 2**63 bytes fits. Torch-free."""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

from ..env import MAX_BUFFER_BYTES, variable
from .errors import shorten

#: The default cap on the bytes of one registry's buffers (4 GiB): the shipped decode
#: spec takes about 20 KiB at max_bs = max_num_tokens = 256.
DEFAULT_MAX_BUFFER_BYTES = 4 << 30
#: torch sizes a storage in signed 64-bit bytes: no buffer can reach this.
TORCH_MAX_BYTES = 1 << 63


class BufferBudgetError(ValueError):
    """Buffers over their byte cap (or beyond what torch can size); nothing was allocated."""


BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: int) -> str:
    """``512 B``, ``12.5 KiB``, ``3.0 MiB`` ... ``1024.0 EiB`` (EiB is the largest unit)."""
    if n < 1024:
        return f"{int(n)} B"
    k = min((int(n).bit_length() - 1) // 10, len(BINARY_UNITS) - 1)
    try:
        return f"{n / 1024**k:.1f} {BINARY_UNITS[k]}"
    except OverflowError:  # beyond any float: only a hostile count gets here
        return f"about 2**{int(n).bit_length() - 1} B"


def format_bytes(n: int) -> str:
    """``5368709120 bytes (5.0 GiB)``; ``1023 bytes``."""
    return f"{n} bytes" if n < 1024 else f"{n} bytes ({human_bytes(n)})"


def byte_cap(
    max_bytes: Optional[int], env: str, default: Optional[int], default_origin: str = "the default"
) -> Tuple[Optional[int], str]:
    """The cap and where it came from: ``max_bytes``, else the environment variable ``env``
    (declared in :mod:`graphslot.env`), else ``default`` (None: no cap)."""
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int (a number of bytes), got {shorten(max_bytes)}")
        return max_bytes, "max_bytes"
    from_env = variable(env).read()
    return (default, default_origin) if from_env is None else (from_env, env)


def check_buffer_bytes(
    spec_name: str, sized: Iterable[Tuple[str, int]], where: str, max_bytes: Optional[int] = None
) -> int:
    """The total of ``sized`` (``(slot name, bytes)`` pairs) at the capacities ``where`` says,
    or a BufferBudgetError: any buffer of 2**63 bytes or more (named), or a total over the cap."""
    cap, origin = byte_cap(max_bytes, MAX_BUFFER_BYTES.name, DEFAULT_MAX_BUFFER_BYTES)
    total = 0
    largest = (0, "")
    for name, nbytes in sized:
        if nbytes >= TORCH_MAX_BYTES:
            raise BufferBudgetError(
                f"spec '{spec_name}', slot '{name}': its buffer would take {nbytes} bytes at "
                f"{where}, beyond what torch can allocate (under 2**63 bytes); lower the "
                "capacities or the params its shape is made of"
            )
        total += nbytes
        largest = max(largest, (nbytes, name))
    if total > cap:
        raise BufferBudgetError(
            f"spec '{spec_name}': its buffers would take {format_bytes(total)} at {where}, over the cap of "
            f"{format_bytes(cap)} ({origin}); the largest is slot '{largest[1]}', {format_bytes(largest[0])}. "
            f"Nothing was allocated. Lower the capacities, or raise the cap: max_bytes=N (the runner "
            f"configs) or the environment variable {MAX_BUFFER_BYTES.name}=N"
        )
    return total
