"""DecodeGraphRunner.stage(fb, needed=, context=, longest=) (the DP runner passes what the ranks
agreed on): a graph smaller than the batch needs, in rows or in context, is refused naming
the argument. A bucket below the batch's longest context replayed a graph that attends to
fewer positions than the batch has (silently wrong on a bucketed attention); too few or
too many rows failed with a SlotError about counts or an IndexError."""

from __future__ import annotations

import pytest
import torch

from graphslot.graphs import TapeBackend
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from test_model_runner import Requests, runtime


@pytest.fixture
def setup():
    rt = runtime()
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), DecodeRunnerConfig(
        capture_bs=[1, 2, 4], context_buckets=[16, 64], max_bs=4, backend=TapeBackend(), progress=False))
    reqs = Requests(rt, seed=1)
    rt.forward(reqs.prefill([30, 5, 6]))  # the first request's context is past the 16 bucket
    return rt, runner, reqs


@pytest.mark.parametrize("kwargs, message", [
    (dict(context=16), r"^stage\(context=16\): the batch's longest context is 31, more than the bucket"),
    (dict(needed=2), r"^stage\(needed=2\): the batch has 3 request\(s\); needed must be an int from 3 to 4 "),
    (dict(needed=8), r"^stage\(needed=8\): the batch has 3 request\(s\); needed must be an int from 3 to 4 "),
    (dict(needed=2.5), r"^stage\(needed=2.5\): the batch has 3 request\(s\); needed must be an int from 3 to 4 "),
])
def test_a_graph_smaller_than_the_batch_needs_is_refused_naming_the_argument(setup, kwargs, message):
    rt, runner, reqs = setup
    fills = runner.fills
    with pytest.raises(ValueError, match=message):
        runner.stage(reqs.decode(3), **kwargs)
    assert runner.fills == fills  # refused before the fill


@pytest.mark.parametrize("kwargs", [dict(), dict(needed=3, context=64), dict(needed=4)])
def test_a_graph_large_enough_replays_the_eager_logits(setup, kwargs):
    rt, runner, reqs = setup
    fb = reqs.decode(3)
    staged = runner.stage(fb, **kwargs)
    out = runner.launch(staged).clone()
    assert (staged.bs, staged.context) == (4, 64)
    assert torch.allclose(out, rt.forward(fb), atol=1e-5)


def test_needed_is_a_python_int_only(setup):
    """Unlike the runner's config counts (``checked_count`` takes anything with ``__index__``, a numpy
    integer too: test_runner_arguments), ``needed`` is the int the DP runner's agreement gives: a bool, a
    numpy integer or a 0-d tensor is refused with the ValueError naming it, as a float is."""
    np = pytest.importorskip("numpy")
    rt, runner, reqs = setup
    fills = runner.fills
    refused = r"^stage\(needed=.*\): the batch has \d request\(s\); needed must be an int "
    for fb, needed in ((reqs.decode(1), True), (reqs.decode(3), np.int64(3)), (reqs.decode(3), torch.tensor(3))):
        with pytest.raises(ValueError, match=refused):
            runner.stage(fb, needed=needed)
    assert runner.fills == fills
    assert runner.stage(reqs.decode(1), needed=1).bs == 1  # the int itself is taken


def test_a_longest_context_given_is_not_read_again(setup, monkeypatch):
    """``longest=``: the caller read it (the DP runner, before its exchange); stage checks and pads with it."""
    rt, runner, reqs = setup
    fb = reqs.decode(3)
    monkeypatch.setattr(runner.adapter, "context_len", lambda fb: pytest.fail("context_len read again"))
    with pytest.raises(ValueError, match=r"^stage\(context=16\): the batch's longest context is 31, more than"):
        runner.stage(fb, context=16, longest=31)
    assert runner.stage(fb, context=64, longest=31).context == 64
    assert runner.stage(fb, longest=31).context == 64
