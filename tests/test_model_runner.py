"""ModelGraphRunner (docs/dispatch.md, "One model, one pool"): on the CPU tape, every step
(full, piecewise or eager) gives the eager logits bit for bit, with the batch size, the
token count and the variant changing every step, mixed prefill + decode batches among
them; and a graph really replayed for each step that says it did, counted where the
graphs run (the backend), not by the runner.
"""

from __future__ import annotations

import contextlib
import random
import re

import pytest
import torch
from torch import nn

from graphslot.graphs import CudaGraphBackend, TapeBackend
from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.numerics import output_check
from graphslot.reference.prefill_adapter import ReferenceLayerStack, ReferencePrefillAdapter
from graphslot.runners.decode import DecodeRunnerConfig
from graphslot.runners.dispatcher import (
    EAGER,
    FULL,
    MORE_TOKENS_THAN_PIECEWISE,
    NO_GRAPHS,
    PIECEWISE,
    Dispatch,
)
from graphslot.runners.keys import GraphKey
from graphslot.runners.model_runner import ModelGraphRunner
from graphslot.runners.prefill import NOT_A_PREFILL, TOO_MANY_REQUESTS, PrefillRunnerConfig

LAYERS = 2  # the reference model's: a piecewise replay runs LAYERS + 1 pieces


# The shipped backends count the replays of their graphs themselves (backend.replays), not
# the runner: what a test reads from them is what ran.
CountingTape = TapeBackend
CountingCuda = CudaGraphBackend


class Requests:
    """The reference engine's requests: their pool slots and cached lengths."""

    def __init__(self, rt, seed=0):
        self.rt = rt
        self.rng = random.Random(seed)
        self.cached = {}  # request slot -> tokens in the KV cache
        self.slots = []  # in arrival order

    def tokens(self, n):
        return [self.rng.randrange(1, 128) for _ in range(n)]

    def prefill(self, lens, continuing=()):
        """New requests of ``lens`` prompt tokens, after the ``continuing`` ones (each one
        new token after its cached prefix): a mixed prefill + decode batch."""
        new = self.rt.req_to_token_pool.alloc(len(lens))
        slots = list(continuing) + new
        prefix = [self.cached[s] for s in continuing] + [0] * len(new)
        fb = make_extend_batch(self.rt, slots, prefix, [self.tokens(1) for _ in continuing]
                               + [self.tokens(n) for n in lens])
        for slot, n in zip(slots, [1] * len(continuing) + list(lens)):
            self.cached[slot] = self.cached.get(slot, 0) + n
        self.slots += new
        return fb

    def decode(self, n=None, slots=None):
        """A decode step of the first ``n`` requests, or of ``slots``."""
        slots = self.slots[:n] if slots is None else slots
        fb = make_decode_batch(self.rt, slots, [self.cached[s] for s in slots], self.tokens(len(slots)))
        for slot in slots:
            self.cached[slot] += 1
        return fb


def runtime():
    return build_reference_model(max_num_reqs=64)


def model_runner(rt, backend, decode_adapter=None, prefill_adapter=None, **kwargs):
    decode = DecodeRunnerConfig(capture_bs=[1, 2, 4], context_buckets=kwargs.pop("context_buckets", [16, 64]))
    return ModelGraphRunner(decode_adapter or ReferenceDecodeAdapter(rt),
                            prefill_adapter or ReferencePrefillAdapter(rt, decode_batches=True),
                            max_bs=8, max_num_tokens=64, backend=backend, decode_config=decode,
                            prefill_config=PrefillRunnerConfig(token_buckets=[16, 32, 64]), progress=False, **kwargs)


def pieces(choice):
    """Graph replays a step of ``choice`` makes on the backend."""
    return {FULL: 1, PIECEWISE: LAYERS + 1, EAGER: 0}[choice.mode]


def run_steps(rt, runner, backend, steps, eager=None):
    """Each ``(make batch, expected Dispatch)``: the runner first, then eager (which
    rewrites the same K/V); the same logits, and the graphs the backend replayed."""
    check = output_check(rt.device)
    eager = eager or rt.forward
    for i, (make, expected) in enumerate(steps):
        fb = make()
        before = backend.replays
        out = runner(fb).clone()
        replayed = backend.replays - before
        assert runner.last_dispatch == expected, f"step {i}"
        assert replayed == pieces(expected), f"step {i}: {replayed} graph replays for {expected}"
        reference = eager(fb)
        assert out.shape == reference.shape and check(out, reference), f"step {i}: {expected} differs from eager"


def serving_steps(reqs):
    """A serving trace: prefills, decode steps of 1 to 8 requests and of two context
    buckets, mixed prefill + decode batches, and steps no graph holds. The comments say
    what the requests hold after the step."""
    return [
        (lambda: reqs.prefill([5, 3, 7]), Dispatch(PIECEWISE, GraphKey(16))),  # A5 B3 C7
        (lambda: reqs.decode(3), Dispatch(FULL, GraphKey(4, 16))),  # A6 B4 C8
        # mixed: A, B, C one token each, D and E their prompts (13 tokens)
        (lambda: reqs.prefill([4, 6], continuing=reqs.slots[:3]), Dispatch(PIECEWISE, GraphKey(16))),
        (lambda: reqs.decode(5), Dispatch(PIECEWISE, GraphKey(16))),  # more requests than the largest full graph
        (lambda: reqs.decode(1), Dispatch(FULL, GraphKey(1, 16))),
        (lambda: reqs.prefill([10, 9, 12], continuing=reqs.slots[:2]), Dispatch(PIECEWISE, GraphKey(64))),  # 33
        (lambda: reqs.decode(8), Dispatch(PIECEWISE, GraphKey(16))),
        (lambda: reqs.decode(2), Dispatch(FULL, GraphKey(2, 16))),
        (lambda: reqs.prefill([20]), Dispatch(PIECEWISE, GraphKey(32))),  # I20
        (lambda: reqs.decode(slots=[reqs.slots[-1], reqs.slots[0]]), Dispatch(FULL, GraphKey(2, 64))),  # I21
        (lambda: reqs.prefill([40, 40]), Dispatch(EAGER, None, MORE_TOKENS_THAN_PIECEWISE)),
        (lambda: reqs.decode(4), Dispatch(FULL, GraphKey(4, 16))),
        (lambda: reqs.prefill([1] * 9), Dispatch(EAGER, None, TOO_MANY_REQUESTS)),  # the prefill runner declines
        (lambda: reqs.decode(3), Dispatch(FULL, GraphKey(4, 16))),
    ]


def test_every_step_full_piecewise_or_eager_equals_eager_and_a_graph_replayed():
    rt = runtime()
    backend = CountingTape()
    runner = model_runner(rt, backend)
    assert sorted(runner.dispatcher.keys(FULL)) == sorted(GraphKey(bs, ctx) for bs in (1, 2, 4) for ctx in (16, 64))
    assert runner.dispatcher.keys(PIECEWISE) == [GraphKey(16), GraphKey(32), GraphKey(64)]
    backend.replays = 0
    steps = serving_steps(Requests(rt))
    run_steps(rt, runner, backend, steps)
    assert runner.metrics() == {
        "steps": len(steps), "replays": {FULL: 6, PIECEWISE: 6}, "replays_per_variant": {"": 12},
        "eager_fallbacks": 2, "eager_reasons": {MORE_TOKENS_THAN_PIECEWISE: 1, TOO_MANY_REQUESTS: 1},
        "graphs": {FULL: 6, PIECEWISE: 3}}


def replace_weight(rt):
    """A new Parameter for one weight of the layer stack (what a weight reload does)."""
    proj = rt.model.layers[0].mlp.down_proj
    proj.weight = nn.Parameter(proj.weight * 1.5, requires_grad=False)


def test_capture_release_and_recapture_change_the_keys_and_nothing_else_does():
    rt = runtime()
    backend = CountingTape()
    runner = model_runner(rt, backend, defer_capture=True)
    assert {r.graph_pool for r in runner.runners.values()} == {runner.graph_pool} == {backend.pool}
    assert len(runner.dispatcher) == 0 and all(not r.graphs for r in runner.runners.values())
    reqs = Requests(rt, seed=1)
    uncaptured = [(lambda: reqs.prefill([3, 5]), Dispatch(EAGER, None, NO_GRAPHS)),
                  (lambda: reqs.decode(2), Dispatch(EAGER, None, NO_GRAPHS))]
    run_steps(rt, runner, backend, uncaptured)
    runner.capture()
    keys = {mode: runner.dispatcher.keys(mode) for mode in (FULL, PIECEWISE)}
    assert len(keys[FULL]) == 6 and len(keys[PIECEWISE]) == 3
    captured = [(lambda: reqs.decode(2), Dispatch(FULL, GraphKey(2, 16))),
                (lambda: reqs.prefill([6], continuing=reqs.slots[:2]), Dispatch(PIECEWISE, GraphKey(16)))]
    run_steps(rt, runner, backend, captured)
    runner.release()
    assert len(runner.dispatcher) == 0 and all(not r.graphs for r in runner.runners.values())
    released = [(lambda: reqs.decode(3), Dispatch(EAGER, None, NO_GRAPHS)),
                (lambda: reqs.prefill([2], continuing=reqs.slots[:1]), Dispatch(EAGER, None, NO_GRAPHS))]
    run_steps(rt, runner, backend, released)
    replace_weight(rt)
    runner.recapture()
    assert {mode: runner.dispatcher.keys(mode) for mode in (FULL, PIECEWISE)} == keys
    run_steps(rt, runner, backend, captured + [(lambda: reqs.decode(3), Dispatch(FULL, GraphKey(4, 16)))])
    assert runner.metrics()["eager_reasons"] == {NO_GRAPHS: 4}


def test_without_decode_batches_the_prefill_runner_declines_and_the_step_runs_eager():
    rt = runtime()
    backend = CountingTape()
    runner = ModelGraphRunner(ReferenceDecodeAdapter(rt), ReferencePrefillAdapter(rt), max_bs=4, max_num_tokens=16,
                              backend=backend, decode_config=DecodeRunnerConfig(capture_bs=[2]),
                              prefill_config=PrefillRunnerConfig(token_buckets=[16]), progress=False)
    reqs = Requests(rt, seed=2)
    steps = [(lambda: reqs.prefill([2, 3, 4]), Dispatch(PIECEWISE, GraphKey(16))),
             (lambda: reqs.decode(2), Dispatch(FULL, GraphKey(2))),
             (lambda: reqs.decode(3), Dispatch(EAGER, None, NOT_A_PREFILL))]
    run_steps(rt, runner, backend, steps)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_graphs_every_step_matches_eager_and_replays_a_graph_from_one_pool():
    rt = build_reference_model(device="cuda", max_num_reqs=64)
    backend = CountingCuda("cuda")
    runner = model_runner(rt, backend)
    assert {r.graph_pool for r in runner.runners.values()} == {runner.graph_pool}
    backend.replays = 0
    run_steps(rt, runner, backend, serving_steps(Requests(rt)))
    runner.recapture()
    run_steps(rt, runner, backend, serving_steps(Requests(rt, seed=5))[:4])
    runner.release()
    assert len(runner.dispatcher) == 0


def test_bad_modes_and_missing_adapters_are_named():
    rt = runtime()
    with pytest.raises(ValueError, match=r"^modes must name one or more of: full, piecewise; got \['breakable'\]$"):
        ModelGraphRunner(ReferenceDecodeAdapter(rt), None, modes=("breakable",))
    with pytest.raises(ValueError, match=r"^mode 'piecewise' needs a prefill adapter \(prefill_adapter is None\)"):
        ModelGraphRunner(ReferenceDecodeAdapter(rt), None)
    with pytest.raises(ValueError, match=r"^mode 'full' needs a decode adapter"):
        ModelGraphRunner(None, ReferencePrefillAdapter(rt))


# ------------------------------------------------------------------------- variants


def biased_logits(model, fb, bias):
    """The reference model with ``bias`` added to the last layer's hidden states."""
    hidden = model.embed(fb.input_ids)
    for layer in model.layers:
        hidden = layer(fb.positions, hidden, fb)
    return model.logits(hidden + bias)


def variant_of(fb):
    return getattr(fb, "variant", "")


class BiasedStack(nn.Module):
    """The reference layer stack, then the variant's bias: what a graph of the variant runs."""

    def __init__(self, layers, bias):
        super().__init__()
        self.stack = ReferenceLayerStack(layers)
        self.bias = bias

    def forward(self, positions, hidden, fb):
        return self.stack(positions, hidden, fb) + self.bias


class Biases:
    """Variants ("", "lora"), each adding its own bias to the hidden states; ``variant(fb)``
    reads ``fb.variant``; ``for_variant`` binds one."""

    variants = ("", "lora")

    def init_variants(self, biases, bound):
        self.biases = biases
        self.bound = bound

    def variant(self, fb):
        return variant_of(fb)

    def forward_eager(self, fb):
        self.runtime.attn_backend.init_forward_metadata(fb)
        with torch.no_grad():
            return biased_logits(self.runtime.model, fb, self.biases[variant_of(fb)])

    def static_tensors(self):
        yield from super().static_tensors()
        yield from self.biases.values()


class BiasedDecode(Biases, ReferenceDecodeAdapter):
    def __init__(self, rt, biases, bound=""):
        super().__init__(rt)
        self.init_variants(biases, bound)

    def for_variant(self, variant):
        return BiasedDecode(self.runtime, self.biases, variant)

    def forward(self, fb):
        return biased_logits(self.runtime.model, fb, self.biases[self.bound])


class BiasedPrefill(Biases, ReferencePrefillAdapter):
    def __init__(self, rt, biases, bound=""):
        super().__init__(rt, decode_batches=True)
        self.init_variants(biases, bound)

    def for_variant(self, variant):
        return BiasedPrefill(self.runtime, self.biases, variant)

    def layer_stack(self, model):
        return BiasedStack(model.layers, self.biases[self.bound])


def with_variant(fb, variant):
    fb.variant = variant
    return fb


def test_each_variant_replays_its_own_graphs_and_equals_its_eager_forward():
    rt = runtime()
    gen = torch.Generator().manual_seed(3)
    biases = {v: torch.randn(rt.config.hidden_size, generator=gen) for v in Biases.variants}
    decode = BiasedDecode(rt, biases)
    backend = CountingTape()
    runner = model_runner(rt, backend, decode_adapter=decode, prefill_adapter=BiasedPrefill(rt, biases),
                          context_buckets=None)
    assert set(runner.runners) == {(mode, v) for mode in (FULL, PIECEWISE) for v in ("", "lora")}
    full, lora = runner.runners[(FULL, "")], runner.runners[(FULL, "lora")]
    assert all(a.buffer.data_ptr() == b.buffer.data_ptr()  # one BufferPool: the variants share their buffers
               for a, b in zip(full.registry.active, lora.registry.active))
    assert len(runner.dispatcher.keys(FULL)) == 6 and len(runner.dispatcher.keys(PIECEWISE)) == 6
    backend.replays = 0
    reqs = Requests(rt, seed=4)
    steps = [
        (lambda: with_variant(reqs.prefill([4, 6]), "lora"), Dispatch(PIECEWISE, GraphKey(16, None, "lora"))),
        (lambda: with_variant(reqs.decode(2), ""), Dispatch(FULL, GraphKey(2, None, ""))),
        (lambda: with_variant(reqs.decode(2), "lora"), Dispatch(FULL, GraphKey(2, None, "lora"))),
        (lambda: with_variant(reqs.prefill([9, 8], continuing=reqs.slots[:2]), ""), Dispatch(PIECEWISE, GraphKey(32))),
        (lambda: with_variant(reqs.decode(3), "lora"), Dispatch(FULL, GraphKey(4, None, "lora"))),
        (lambda: with_variant(reqs.decode(4), ""), Dispatch(FULL, GraphKey(4))),
        (lambda: with_variant(reqs.decode(1), "lora"), Dispatch(FULL, GraphKey(1, None, "lora"))),
        (lambda: with_variant(reqs.prefill([35, 35], continuing=reqs.slots[:1]), "lora"),
         Dispatch(EAGER, None, MORE_TOKENS_THAN_PIECEWISE)),
        (lambda: with_variant(reqs.decode(6), "lora"), Dispatch(PIECEWISE, GraphKey(16, None, "lora"))),
    ]
    run_steps(rt, runner, backend, steps, eager=decode.forward_eager)
    assert runner.metrics()["replays_per_variant"] == {"": 3, "lora": 5}
    # the variant matters: the last step's batch under the other variant's eager forward differs
    fb = with_variant(reqs.decode(2), "lora")
    out = runner(fb).clone()
    assert not torch.equal(out, decode.forward_eager(with_variant(fb, "")))
    assert torch.equal(out, decode.forward_eager(with_variant(fb, "lora")))


def test_an_adapter_with_variants_but_no_for_variant_is_refused_naming_it():
    class NoBinding(ReferenceDecodeAdapter):
        variants = ("", "lora")

    rt = runtime()
    with pytest.raises(TypeError, match=r"^NoBinding declares variants \['', 'lora'\] but has no for_variant"):
        ModelGraphRunner(NoBinding(rt), None, modes=("full",), defer_capture=True)


def test_a_staged_step_is_refused_once_another_runner_of_the_model_staged_into_the_shared_state():
    """The phase runners of one model share their buffers (one BufferPool) and the model's
    attention metadata: a step staged on one is stale once another stages (it would replay
    the other's batch)."""
    rt = runtime()
    backend = CountingTape()
    runner = model_runner(rt, backend)
    reqs = Requests(rt, seed=6)
    runner(reqs.prefill([3, 4, 5]))
    full, piecewise = runner.runners[(FULL, "")], runner.runners[(PIECEWISE, "")]
    decode = full.prepare(reqs.decode(2))
    piecewise.stage(reqs.prefill([4]))
    with pytest.raises(RuntimeError, match="buffers were filled again since it was prepared"):
        full.launch(decode)
    staged = piecewise.stage(reqs.prefill([6]))
    full.prepare(reqs.decode(3))
    with pytest.raises(RuntimeError, match="buffers were filled again since it was prepared"):
        piecewise.launch(staged)


def graph_counts(runner):
    return {where: len(phase.graphs) for where, phase in runner.runners.items()}


def generations(runner):
    return {where: phase.generation for where, phase in runner.runners.items()}


@pytest.mark.parametrize("call", ["release", "recapture"])
def test_release_or_recapture_during_a_step_changes_no_runner(call):
    """Refused during any phase runner's step, the call releases none of the others either."""
    rt = runtime()
    backend = CountingTape()
    runner = model_runner(rt, backend)
    reqs = Requests(rt, seed=7)
    runner(reqs.prefill([3, 4]))
    counts = graph_counts(runner)
    released_or_captured = generations(runner)
    keys = {mode: runner.dispatcher.keys(mode) for mode in (FULL, PIECEWISE)}

    class Caller:
        def after_fill(self, raw_bs, padded_bs):
            getattr(runner, call)()

    full = runner.runners[(FULL, "")]
    full.add_observer(Caller())
    with pytest.raises(RuntimeError, match=rf"^{call}\(\) was called during a decode step"):
        runner(reqs.decode(2))
    full.remove_observer(full._observers[0])
    assert graph_counts(runner) == counts and generations(runner) == released_or_captured
    assert {mode: runner.dispatcher.keys(mode) for mode in (FULL, PIECEWISE)} == keys
    run_steps(rt, runner, backend, [(lambda: reqs.prefill([5], continuing=reqs.slots[:2]),
                                     Dispatch(PIECEWISE, GraphKey(16))),
                                    (lambda: reqs.decode(2), Dispatch(FULL, GraphKey(2, 16)))])


def test_recapture_enters_the_capture_context_once_and_a_failed_one_leaves_every_runner_released():
    entries = []
    broken = []

    @contextlib.contextmanager
    def capture_context():
        entries.append(1)
        if broken:
            raise RuntimeError("the engine's capture context broke")
        yield None

    rt = runtime()
    backend = CountingTape()
    runner = model_runner(rt, backend, capture_context=capture_context)
    keys = {mode: runner.dispatcher.keys(mode) for mode in (FULL, PIECEWISE)}
    assert len(entries) == 1
    runner.recapture()
    assert len(entries) == 2  # once for both phases, as capture()
    broken.append(True)
    replace_weight(rt)  # the graphs from before read the old weight
    with pytest.raises(RuntimeError, match="the engine's capture context broke"):
        runner.recapture()
    assert len(runner.dispatcher) == 0 and not any(graph_counts(runner).values())
    reqs = Requests(rt, seed=8)
    run_steps(rt, runner, backend, [(lambda: reqs.prefill([3, 4]), Dispatch(EAGER, None, NO_GRAPHS)),
                                    (lambda: reqs.decode(2), Dispatch(EAGER, None, NO_GRAPHS))])
    broken.clear()
    runner.recapture()  # every key again
    assert {mode: runner.dispatcher.keys(mode) for mode in (FULL, PIECEWISE)} == keys
    run_steps(rt, runner, backend, [(lambda: reqs.prefill([5], continuing=reqs.slots[:2]),
                                     Dispatch(PIECEWISE, GraphKey(16))),
                                    (lambda: reqs.decode(2), Dispatch(FULL, GraphKey(2, 16)))])


@pytest.mark.parametrize("variant", [["lora"], None, 3])
def test_a_variant_that_is_not_a_string_is_refused_naming_the_adapter(variant):
    """A list from ``variant(fb)`` failed as "unhashable type: 'list'" in the dispatcher."""

    class Odd(ReferenceDecodeAdapter):
        def variant(self, fb):
            return variant

    rt = runtime()
    runner = ModelGraphRunner(Odd(rt), None, modes=("full",), max_bs=2, backend=CountingTape(), progress=False,
                              decode_config=DecodeRunnerConfig(capture_bs=[2]))
    reqs = Requests(rt, seed=9)
    rt.forward(reqs.prefill([2, 3]))
    with pytest.raises(TypeError, match=rf"^Odd.variant\(fb\) must return a str \(one of its variants \[''\]\), "
                                        rf"got {re.escape(repr(variant))}"):
        runner(reqs.decode(2))
