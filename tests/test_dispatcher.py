"""The dispatcher as a specification (docs/dispatch.md, "The batch descriptor and the
dispatcher"): a table of steps and the graph each replays, or why it runs eager; then a
property: whatever the keys and the step, the key chosen fits the step and no key that
fits is smaller.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphslot.runners.dispatcher import (
    CONTEXT_BEYOND_BUCKETS,
    EAGER,
    EMPTY_BATCH,
    FULL,
    MORE_REQUESTS_THAN_FULL,
    MORE_REQUESTS_THAN_SLOTS,
    MORE_TOKENS_THAN_PIECEWISE,
    NO_GRAPH_OF_VARIANT,
    NO_GRAPHS,
    NOT_UNIFORM,
    PIECEWISE,
    Dispatch,
    Dispatcher,
)
from graphslot.runners.keys import BatchDescriptor, GraphKey

#: Full graphs of 1, 2, 4, 8 requests at context buckets 128 and 512, for the base variant
#: and, at sizes 1 and 4 only, for "lora"; piecewise graphs of 16, 64 and 256 tokens, base only.
FULL_KEYS = [GraphKey(bs, ctx) for bs in (1, 2, 4, 8) for ctx in (128, 512)]
FULL_KEYS += [GraphKey(bs, ctx, "lora") for bs in (1, 4) for ctx in (128, 512)]
PIECEWISE_KEYS = [GraphKey(n) for n in (16, 64, 256)]


def decode(bs, context, variant=""):
    return BatchDescriptor(num_tokens=bs, num_reqs=bs, uniform=True, context=context, variant=variant)


def mixed(tokens, reqs, variant=""):
    return BatchDescriptor(num_tokens=tokens, num_reqs=reqs, uniform=False, variant=variant)


TABLE = [
    # a uniform decode step: the smallest full graph holding its requests and its context
    (decode(3, 100), Dispatch(FULL, GraphKey(4, 128))),
    (decode(4, 128), Dispatch(FULL, GraphKey(4, 128))),
    (decode(4, 129), Dispatch(FULL, GraphKey(4, 512))),
    (decode(1, 1), Dispatch(FULL, GraphKey(1, 128))),
    # beyond the full graphs: piecewise serves it, by tokens
    (decode(9, 100), Dispatch(PIECEWISE, GraphKey(16))),
    (decode(2, 600), Dispatch(PIECEWISE, GraphKey(16))),
    # the variant: its own full graphs; none of size 2, so 4; none piecewise, so eager beyond
    (decode(2, 100, "lora"), Dispatch(FULL, GraphKey(4, 128, "lora"))),
    (decode(5, 100, "lora"), Dispatch(EAGER, None, MORE_REQUESTS_THAN_FULL)),
    (decode(3, 600, "lora"), Dispatch(EAGER, None, CONTEXT_BEYOND_BUCKETS)),
    (mixed(10, 3, "lora"), Dispatch(EAGER, None, NOT_UNIFORM)),
    (decode(1, 10, "spec"), Dispatch(EAGER, None, NO_GRAPH_OF_VARIANT)),
    # a prefill, or a mixed prefill + decode batch: piecewise, by tokens
    (mixed(10, 3), Dispatch(PIECEWISE, GraphKey(16))),
    (mixed(16, 1), Dispatch(PIECEWISE, GraphKey(16))),
    (mixed(17, 9), Dispatch(PIECEWISE, GraphKey(64))),
    (mixed(256, 40), Dispatch(PIECEWISE, GraphKey(256))),
    (mixed(257, 3), Dispatch(EAGER, None, MORE_TOKENS_THAN_PIECEWISE)),
    # nothing to run
    (mixed(0, 0), Dispatch(EAGER, None, EMPTY_BATCH)),
    (decode(0, 0), Dispatch(EAGER, None, EMPTY_BATCH)),
]


@pytest.mark.parametrize(("desc", "expected"), TABLE, ids=lambda x: repr(x) if isinstance(x, BatchDescriptor) else "")
def test_each_step_gets_the_graph_the_table_says(desc, expected):
    dispatcher = Dispatcher({FULL: FULL_KEYS, PIECEWISE: PIECEWISE_KEYS})
    assert dispatcher.dispatch(desc) == expected


def test_keys_without_a_bucket_serve_every_context_after_the_bucketed_ones_of_their_size():
    dispatcher = Dispatcher({FULL: [GraphKey(4), GraphKey(4, 256), GraphKey(8, 64)]})
    assert dispatcher.dispatch(decode(3, 200)).key == GraphKey(4, 256)
    assert dispatcher.dispatch(decode(3, 9000)).key == GraphKey(4)
    assert dispatcher.dispatch(decode(3, None)).key == GraphKey(4)  # an unknown context: only a bucketless key
    assert dispatcher.dispatch(decode(5, 10)).key == GraphKey(8, 64)


def test_piecewise_keys_with_request_slots_hold_only_that_many_requests():
    dispatcher = Dispatcher({PIECEWISE: [GraphKey(32, 4), GraphKey(32, 8), GraphKey(64, 4)]})
    assert dispatcher.dispatch(mixed(20, 3)).key == GraphKey(32, 4)
    assert dispatcher.dispatch(mixed(20, 6)).key == GraphKey(32, 8)
    assert dispatcher.dispatch(mixed(40, 6)) == Dispatch(EAGER, None, MORE_REQUESTS_THAN_SLOTS)


def test_capture_and_release_change_what_replays_and_nothing_else_does():
    dispatcher = Dispatcher({FULL: FULL_KEYS})
    assert dispatcher.dispatch(mixed(10, 3)) == Dispatch(EAGER, None, NOT_UNIFORM)
    dispatcher.add(PIECEWISE, GraphKey(16))
    assert dispatcher.dispatch(mixed(10, 3)) == Dispatch(PIECEWISE, GraphKey(16))
    dispatcher.remove(FULL, GraphKey(4, 128))
    assert dispatcher.dispatch(decode(3, 100)) == Dispatch(FULL, GraphKey(4, 512))
    dispatcher.remove(FULL, *[key for key in FULL_KEYS if key != GraphKey(4, 128)])
    assert dispatcher.dispatch(decode(3, 100)) == Dispatch(PIECEWISE, GraphKey(16))
    assert dispatcher.keys(FULL) == [] and dispatcher.keys(PIECEWISE) == [GraphKey(16)]
    dispatcher.clear()
    assert len(dispatcher) == 0 and dispatcher.dispatch(decode(3, 100)) == Dispatch(EAGER, None, NO_GRAPHS)


def test_bad_keys_and_modes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"^unknown dispatch mode 'breakable'; choose one of: full, piecewise$"):
        Dispatcher({"breakable": [GraphKey(4)]})
    with pytest.raises(ValueError, match=r"a full graph key needs a size .* >= 1, got GraphKey\(size=0"):
        Dispatcher({FULL: [GraphKey(0)]})
    with pytest.raises(KeyError):
        Dispatcher().remove(FULL, GraphKey(4))


# ------------------------------------------------------------------------- the property


def fits(mode, key, desc):
    """The specification of a fit, written out apart from the dispatcher."""
    if key.variant != desc.variant:
        return False
    if mode == FULL:
        bucket_ok = key.bucket is None or (desc.context is not None and key.bucket >= desc.context)
        return desc.uniform and key.size >= desc.num_reqs and bucket_ok
    return key.size >= desc.num_tokens and (key.bucket is None or key.bucket >= desc.num_reqs)


def smaller(a, b):
    """Whether key ``a`` is smaller than ``b``: by size, then bucket, no bucket last."""
    inf = float("inf")
    return (a.size, inf if a.bucket is None else a.bucket) < (b.size, inf if b.bucket is None else b.bucket)


variants = st.sampled_from(["", "lora", "spec"])
keys = st.builds(GraphKey, st.integers(1, 64), st.one_of(st.none(), st.integers(1, 64)), variants)
descriptors = st.builds(BatchDescriptor, st.integers(0, 80), st.integers(0, 80), st.booleans(),
                        st.one_of(st.none(), st.integers(1, 80)), variants)


@settings(max_examples=300, deadline=None)
@given(full=st.lists(keys, max_size=12), piecewise=st.lists(keys, max_size=12), desc=descriptors)
def test_the_chosen_key_fits_and_no_smaller_key_does(full, piecewise, desc):
    choice = Dispatcher({FULL: full, PIECEWISE: piecewise}).dispatch(desc)
    empty = desc.num_tokens < 1 or desc.num_reqs < 1
    fitting = {mode: [k for k in keys if fits(mode, k, desc)] for mode, keys in ((FULL, full), (PIECEWISE, piecewise))}
    if empty or not (fitting[FULL] or fitting[PIECEWISE]):
        assert choice.mode == EAGER and choice.key is None and choice.reason
        return
    mode = FULL if fitting[FULL] else PIECEWISE  # full first
    assert choice.mode == mode and choice.reason is None
    assert choice.key in fitting[mode]
    assert not any(smaller(other, choice.key) for other in fitting[mode])
