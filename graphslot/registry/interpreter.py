"""The interpreter: the executable definition of the slot semantics (``graphslot/slot_specs/README.md``),
written for clarity, not speed: what generated code is proven equal to."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from .base import SlotRegistry


class InterpretedRegistry(SlotRegistry):
    """The reference semantics, slot by slot."""

    impl = "interpreted"

    def fill_from(self, fb, *, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> None:
        self._fill(fb, (raw_bs, padded_bs, raw_num_tokens, padded_num_tokens), side_inputs, frozenset())

    def _fill_skipping(self, skip: frozenset) -> Callable[..., None]:
        def fill_from(fb, *, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None) -> None:
            self._fill(fb, (raw_bs, padded_bs, raw_num_tokens, padded_num_tokens), side_inputs, skip)

        return fill_from

    # Sources are copied as data: a source that requires grad is copied by value, and
    # no buffer ever requires grad or records history.
    @torch.no_grad()
    def _fill(self, fb, counts, side_inputs, skip) -> None:
        check = self.checker
        raw_bs, padded_bs, raw_num_tokens, padded_num_tokens = counts = check.step(*counts)
        ctx = self.make_context(*counts, self.params, side_inputs)
        active = [slot for slot in self.active if slot.name not in skip] if skip else self.active

        # 0. every source (batch fields, source hooks) is read and checked before
        #    anything is written (slots being skipped are left alone entirely)
        copies = []
        hook_copies = []
        for slot in check.plain:
            if slot.name in skip:
                continue
            src = check.plain_source(slot, fb, raw_bs, raw_num_tokens)
            if src is not None:
                head = slot.head(slot.count(raw_bs, raw_num_tokens))
                copies += zip(head.unbind(0), src.unbind(0)) if slot.resolved.rows else [(head, src)]
        for slot in active:
            hook = slot.hooks.get("source") if slot.resolved.copy_from_fb else None
            src = None if hook is None else check.hook_source(slot.name, hook(fb, ctx))
            if src is not None:
                d = slot.resolved.slice_dim
                buffer = slot.filled
                hook_copies.append((buffer.narrow(d, 0, src.shape[d]) if src.dim() else buffer, src))

        # 1. copy heads (a staged slot's into its host buffer); device copies grouped by dtype pair, one kernel each
        groups: Dict[tuple, list] = {}
        for dst, src in copies:
            groups.setdefault((dst.device, dst.dtype, src.dtype), []).append((dst, src))
        try:
            for pairs in groups.values():
                torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
        except Exception as exc:  # a source overlapping what it is copied into, say: name the slot
            check.diagnose(fb, raw_bs, raw_num_tokens, exc, skip)

        # 2. make the padded tail safe: [raw:padded] (extra rows included), or to the end under reset_to: capacity
        for slot in active:
            spec = slot.resolved
            if spec.resets_tail:
                start = slot.count(raw_bs, raw_num_tokens)
                end = slot.tail_end(padded_bs, padded_num_tokens)
                if start < end:
                    slot.filled.narrow(spec.slice_dim, start, end - start).fill_(spec.tail_value)

        # 3. source hooks' results go to [:len(src)], after the resets
        for dst, src in hook_copies:
            dst.copy_(src)

        # 4. computed slots
        for slot in active:
            hook = slot.hooks.get("post_fill")
            if hook is not None:
                hook(slot.filled, fb, ctx)

        # 5. repeat tails: each repeat_last tail takes its head's last row (an empty head: zeros), after every hook
        for slot in active:
            spec = slot.resolved
            if not spec.repeats_last:
                continue
            start = slot.count(raw_bs, raw_num_tokens)
            end = slot.tail_end(padded_bs, padded_num_tokens)
            if start < end:
                tail = slot.filled.narrow(spec.slice_dim, start, end - start)
                if start:
                    tail.copy_(slot.filled.narrow(spec.slice_dim, start - 1, 1).expand_as(tail))
                else:
                    tail.zero_()

        # 6. stage: one non-blocking copy host to device per staged slot whose buffers are two
        for slot in active:
            if slot.host is not None and slot.host is not slot.buffer:
                whole = slot.resolved.to_capacity or not slot.resolved.axis.sliced
                n = None if whole else slot.count(padded_bs, padded_num_tokens)
                dst = slot.buffer if n is None else slot.buffer.narrow(slot.resolved.slice_dim, 0, n)
                dst.copy_(slot.head(n), non_blocking=True)

    def extract(self, fb, *, padded_bs, padded_num_tokens):
        padded_bs, padded_num_tokens = self.checker.view(padded_bs, padded_num_tokens)
        fields = {"batch_size": padded_bs}
        for slot in self.active:
            spec = slot.resolved
            if spec.structured or (spec.optional and spec.plain_copy and getattr(fb, spec.name, None) is None):
                continue  # dotted: no view field; absent this step: carry the None, never a stale buffer
            fields[spec.name] = slot.slice_for(padded_bs, padded_num_tokens)
        return self.make_view(fb, fields)
