"""The adapter contract at runner construction, and what an adapter declares static.

An engine's adapter that lacks hooks is told every missing one at once, with its class,
when the runner is built (not one empty NotImplementedError per capture); the device is
the adapter's or its model's, never a silent CPU default; a model's parameters and
buffers are static by default, so the stale-input audit and ``graphslot verify`` pass on
a user's runner without ``static_tensors()``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphslot.runners import (AdapterContractError, DecodeAdapter, DecodeGraphRunner, EagerRunner, PrefillAdapter,
                               PrefillGraphRunner, ReplayGuardError)
from graphslot.runners.contract import check_adapter, named_statics
from graphslot.tools import VerifyTarget, audit_external_inputs, verify_runner

import tiny_engine
from tiny_engine import SPEC, Adapter, Model, step


# --------------------------------------------------------------------- missing hooks


class OnlyForward(DecodeAdapter):
    device = torch.device("cpu")

    def forward(self, b):
        return b.input_ids


def test_every_missing_decode_hook_is_named_at_once_with_the_adapter_class():
    with pytest.raises(AdapterContractError) as info:
        DecodeGraphRunner(OnlyForward(), spec=SPEC, max_bs=2, progress=False)
    assert str(info.value) == (
        "OnlyForward (a DecodeAdapter) does not implement 4 required hooks: forward_eager, make_dummy_batch, "
        "init_capture_metadata, init_replay_metadata; see DecodeAdapter's docstring, or docs/engine.md")
    assert isinstance(info.value, TypeError)


def test_the_eager_runner_needs_only_forward_eager():
    with pytest.raises(AdapterContractError, match=r"^OnlyForward \(a DecodeAdapter\) does not implement 1 required "
                                                   r"hook: forward_eager; "):
        EagerRunner(OnlyForward(), spec="decode")


def test_every_missing_prefill_hook_is_named_at_once():
    class Stackless(PrefillAdapter):
        device = torch.device("cpu")
        hidden_size = 8

        def embed(self, fb):
            return fb.input_ids

    with pytest.raises(AdapterContractError) as info:
        PrefillGraphRunner(Stackless(), max_num_tokens=8, progress=False)
    assert str(info.value) == (
        "Stackless (a PrefillAdapter) does not implement 8 required hooks: model, layer_stack, hidden_dtype, "
        "logits, forward_eager, make_dummy_batch, init_capture_metadata, init_replay_metadata; see "
        "PrefillAdapter's docstring, or docs/engine.md")


def test_hooks_set_on_the_instance_or_as_attributes_count():
    class Assembled(OnlyForward):
        make_dummy_batch = staticmethod(lambda bs, n: step(0))

        def __init__(self):
            self.forward_eager = self.forward
            self.init_capture_metadata = self.init_replay_metadata = lambda *args: None

    runner = DecodeGraphRunner(Assembled(), spec=SPEC, max_bs=2, progress=False)
    assert runner.captured_sizes == [2, 1]


# --------------------------------------------------------------------------- device


def test_without_a_device_or_a_model_the_runner_says_so_and_uses_no_default():
    class Deviceless(Adapter):
        def __init__(self):
            pass

    with pytest.raises(AdapterContractError) as info:
        DecodeGraphRunner(Deviceless(), spec=SPEC, max_bs=2, progress=False)
    assert str(info.value) == (
        "Deviceless (a DecodeAdapter) has no `device` and no model with weights to take it from (no nn.Module "
        "attribute with parameters or buffers): set `device = torch.device(...)` on the adapter; see "
        "DecodeAdapter's docstring, or docs/engine.md")


def test_missing_hooks_and_device_are_one_error():
    class Bare(DecodeAdapter):
        pass

    with pytest.raises(AdapterContractError, match=r"^Bare \(a DecodeAdapter\) does not implement 5 required hooks: "
                                                   r"forward, forward_eager, make_dummy_batch, init_capture_metadata, "
                                                   r"init_replay_metadata; and it has no `device` and no model"):
        DecodeGraphRunner(Bare(), spec=SPEC, max_bs=2)


def test_the_device_is_taken_from_the_models_weights():
    runner = tiny_engine.runner(2)
    assert runner.device == torch.device("cpu") and runner.registry.slot("input_ids").buffer.device.type == "cpu"
    # any device: the model's, not a default (meta needs no memory and is no CPU)
    assert check_adapter(Adapter(Model().to("meta")), DecodeAdapter, DecodeAdapter.REQUIRED_HOOKS) == \
        torch.device("meta")


def test_a_model_on_several_devices_is_an_error_naming_them():
    model = Model()
    model.head.to("meta")
    with pytest.raises(AdapterContractError, match=r"its model's weights are on several devices \(model.embed.weight "
                                                   r"on cpu, model.head.weight on meta\), so the runner cannot pick "
                                                   r"one: set `device"):
        check_adapter(Adapter(model), DecodeAdapter, DecodeAdapter.REQUIRED_HOOKS)


def test_an_explicit_device_wins_over_the_models():
    adapter = Adapter(Model().to("meta"))
    adapter.device = "cpu"
    assert check_adapter(adapter, DecodeAdapter, DecodeAdapter.REQUIRED_HOOKS) == torch.device("cpu")


# ---------------------------------------------------------------- static by default


def test_a_models_parameters_and_buffers_are_static_by_default():
    runner = tiny_engine.runner(4)
    names = [name for name, _ in named_statics(runner.adapter)]
    assert names == ["model.embed.weight", "model.head.weight", "model.head.bias", "model.scale"]
    assert audit_external_inputs(runner) == []  # before: all four, "never refilled"
    report = verify_runner(VerifyTarget(runner, step, label="tiny"))
    assert report.safe and report.external_inputs == [] and report.cases == [(3, 4)]


def test_a_tensor_outside_the_model_is_still_a_stale_input():
    offset = torch.ones(32)

    class ReadsOffset(Adapter):
        def forward(self, b):
            return super().forward(b) + offset

    runner = DecodeGraphRunner(ReadsOffset(Model()), spec=SPEC, max_bs=2, backend="cpu", progress=False)
    [stale] = audit_external_inputs(runner)
    assert stale.name is None and stale.shape == (32,) and stale.sizes == [1, 2]


def test_static_modules_can_be_narrowed_and_static_tensors_add_more():
    class Explicit(Adapter):
        def static_modules(self):
            return [("model.head", self.model.head)]

        def named_static_tensors(self):
            yield "embedding table", self.model.embed.weight
            yield "scale", self.model.scale

    assert [name for name, _ in named_statics(Explicit(Model()))] == [
        "embedding table", "scale", "model.head.weight", "model.head.bias"]


def test_the_replay_guard_names_a_rebound_weight_by_its_model_path():
    runner = tiny_engine.runner(2, guard=True)
    runner.adapter.model.head.weight.data = torch.zeros(32, 8)
    with pytest.raises(ReplayGuardError, match=r"^replay guard: static tensor 'model.head.weight' moved since "
                                               r"capture: was \[32, 8\] float32 at 0x"):
        runner(step(2))


def test_a_prefill_adapter_may_set_its_model_as_an_attribute():
    class Stack(nn.Module):
        def forward(self, positions, hidden, view):
            return hidden * 2

    class Plain(PrefillAdapter):
        hidden_size, hidden_dtype = 4, torch.float32

        def __init__(self):
            self.model = nn.Linear(4, 4)  # no property needed: an attribute is a hook

        def layer_stack(self, model):
            return Stack()

    assert check_adapter(Plain(), PrefillAdapter, ("model", "layer_stack", "hidden_size", "hidden_dtype")) == \
        torch.device("cpu")
    assert [name for name, _ in named_statics(Plain())] == ["model.weight", "model.bias"]
