"""What the runners read off a batch of any type, and what they check before capture.

The adapters' readers work on sglang's ``ForwardBatch`` and on a plain dataclass of
tensors alike (:func:`count_requests`). Before capturing anything, a runner checks the
adapter's dummy batch (:func:`check_dummy_batch`): it stands for every batch the engine
will pass, so a field the spec copies that it lacks, or a reader that fails on it, is
reported at construction, naming the adapter method to fix, rather than as a
``SlotError`` from deep inside the first capture or an ``AttributeError`` from the first
live batch.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from ..spec.errors import SlotError
from ..spec.kinds import Axis


def count_requests(adapter: Any, base: str, fb: Any) -> int:
    """``fb.batch_size``, else the rows of a 1-D ``fb.seq_lens`` (one per request)."""
    n = getattr(fb, "batch_size", None)
    if n is not None:
        return int(n)
    seq_lens = getattr(fb, "seq_lens", None)
    if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1:
        return int(seq_lens.shape[0])
    raise AttributeError(f"{type(adapter).__name__}.batch_size: a batch of type {type(fb).__name__} has neither "
                         f"`batch_size` nor a 1-D `seq_lens` tensor; override {base}.batch_size to count the "
                         "requests of your batch type")


def describe_dummy(adapter: Any, dummy: Any) -> str:
    return f"the {type(dummy).__name__} from {type(adapter).__name__}.make_dummy_batch"


def check_dummy_batch(adapter: Any, registry: Any, dummy: Any, readers: Sequence[str], base: str) -> None:
    """Raise, naming the fix, when ``dummy`` lacks a field the spec copies or one of the
    adapter's ``readers`` fails on it (``base``: the adapter base class, for messages)."""
    source = describe_dummy(adapter, dummy)
    missing = [slot.name for slot in registry.checker.plain
               if not slot.resolved.optional and getattr(dummy, slot.name, None) is None]
    if missing:
        names = ", ".join(f"'{name}'" for name in missing)
        many = len(missing) > 1
        raise SlotError(
            f"spec '{registry.spec.name}': {source} has no {names} (None or missing), but the spec copies "
            f"{'these fields' if many else 'this field'} from every batch (slot{'s' if many else ''} {names}); "
            f"give the batch type {'them' if many else 'it'} and set {'them' if many else 'it'} in "
            "make_dummy_batch (an empty tensor: the dummy has no real rows), or use a spec without the "
            f"slot{'s' if many else ''} (or with `optional: true`)")
    for reader in readers:
        try:
            getattr(adapter, reader)(dummy)
        except (AttributeError, TypeError) as exc:
            raise TypeError(f"{type(adapter).__name__}.{reader} fails on {source} ({type(exc).__name__}: {exc}); "
                            f"every batch the runner is given would fail the same way: override "
                            f"{base}.{reader} for this batch type") from exc


def check_slice_output(adapter: Any) -> None:
    """An override of ``slice_output`` written for its old signature fails here, not at
    the first replay."""
    try:
        inspect.signature(adapter.slice_output).bind(None, 0, 0, padded_bs=0, padded_num_tokens=0)
    except TypeError:
        raise TypeError(f"{type(adapter).__name__}.slice_output must take (output, raw_bs, raw_num_tokens, *, "
                        "padded_bs, padded_num_tokens): the runner passes the padded sizes so that every "
                        "tensor's padded rows can be told and cut") from None


def check_batch_rows(adapter: Any, registry: Any, fb: Any, raw_bs: int) -> None:
    """SlotError when a per-request field of ``fb`` (a plain slot on the ``bs`` axis) has
    another row count than ``raw_bs``, the requests ``adapter.batch_size`` read: such a
    batch is miscounted, not a step of another forward mode."""
    for slot in registry.checker.plain:
        spec = slot.resolved
        value = getattr(fb, slot.name, None)
        if spec.axis != Axis.BS or not isinstance(value, torch.Tensor) or value.dim() <= spec.slice_dim:
            continue
        rows = int(value.shape[spec.slice_dim])
        if rows != raw_bs:
            raise SlotError(
                f"spec '{registry.spec.name}', slot '{slot.name}': {type(adapter).__name__}.batch_size says the "
                f"{type(fb).__name__} holds {raw_bs} request(s), but its field '{slot.name}' (one row per request) "
                f"has {rows} along dim {spec.slice_dim} (shape {list(value.shape)}); set the batch's batch_size to "
                "its number of requests (or override batch_size to count them)")
