"""graphslot/slot_specs/vllm.yaml and the parts of graphslot.integrations.vllm that need no vLLM: the step's host
arithmetic and the source hooks against vLLM 0.32's formulas written out token by token, the fill's heads and
tails under both builds (the GPU build's semantics checked on the CPU with distinct host and device tensors, as
vLLM's CpuGpuBuffer has them there), the refusals, and importing without vLLM. tests/test_vllm_plugin.py runs the
plugin inside vLLM (in the vLLM venv)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphslot import api
from graphslot.integrations.vllm import adopted_buffers, hooks
from graphslot.integrations.vllm import runner as runner_fill
from graphslot.integrations.vllm.step import VllmStep
from graphslot.integrations.vllm.support import (VllmRefused, check_version, config_refusals, refuse,
                                                 runner_refusals)
from graphslot.spec.loading import load_spec, shipped_spec_path, spec_from_dict

ROOT = Path(__file__).resolve().parent.parent
MAX_REQS = 6
MAX_TOKENS = 48
MAX_BLOCKS = 8
BLOCK_SIZE = 4
MODEL_LEN = MAX_BLOCKS * BLOCK_SIZE
GARBAGE = -7777


@st.composite
def steps(draw):
    """A step as vLLM's scheduler makes one: R requests, each with tokens computed so far and tokens scheduled
    now (at least one), within the model length and the token budget; a random token table and block table."""
    num_reqs = draw(st.integers(1, MAX_REQS))
    computed = []
    scheduled = []
    budget = MAX_TOKENS
    for _ in range(num_reqs):
        done = draw(st.integers(0, MODEL_LEN - 2))
        now = draw(st.integers(1, max(1, min(MODEL_LEN - done, budget - (num_reqs - len(scheduled) - 1)))))
        budget -= now
        computed.append(done)
        scheduled.append(now)
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    totals = [c + s + int(rng.integers(0, 3)) for c, s in zip(computed, scheduled)]  # some requests not yet done
    state = np.zeros(MAX_REQS, dtype=np.int32)
    state[:num_reqs] = computed
    token_ids = torch.from_numpy(rng.integers(0, 1000, (MAX_REQS, MODEL_LEN)).astype(np.int32))
    block_table = rng.integers(1, 500, (MAX_REQS, MAX_BLOCKS)).astype(np.int32)
    step = VllmStep(num_reqs, np.array(scheduled, dtype=np.int32), state, np.array(totals), token_ids, block_table,
                    BLOCK_SIZE)
    return step, computed, scheduled, totals


def reference(computed, scheduled, totals, token_ids, block_table):
    """vLLM 0.32's _prepare_inputs, one token at a time."""
    ids, positions, slots, starts = [], [], [0], []
    for req, (done, now) in enumerate(zip(computed, scheduled)):
        for offset in range(now):
            pos = done + offset
            ids.append(int(token_ids[req, pos]))
            positions.append(pos)
            starts.append(int(block_table[req, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
        slots.append(slots[-1] + now)
    seq_lens = [d + n for d, n in zip(computed, scheduled)]
    discard = [s < t for s, t in zip(seq_lens, totals)]
    return dict(input_ids=ids, positions=positions, slot_mapping=starts, query_start_loc=slots, seq_lens=seq_lens,
                discard_request_mask=discard)


@settings(max_examples=60, deadline=None)
@given(steps())
def test_the_step_and_hooks_compute_what_vllm_computes(drawn):
    step, computed, scheduled, totals = drawn
    want = reference(computed, scheduled, totals, step.token_ids, step.block_table)
    assert step.num_tokens == sum(scheduled)
    assert hooks.input_ids(step, None).tolist() == want["input_ids"]
    assert hooks.positions(step, None).tolist() == want["positions"]
    assert hooks.slot_mapping(step, None).tolist() == want["slot_mapping"]
    assert hooks.input_ids(step, None).dtype == torch.int32 and hooks.slot_mapping(step, None).dtype == torch.int64
    assert step.query_start_loc.tolist() == want["query_start_loc"] and step.query_start_loc.dtype == torch.int32
    assert step.seq_lens.tolist() == want["seq_lens"] and step.seq_lens.dtype == torch.int32
    assert step.discard_request_mask.tolist() == want["discard_request_mask"]


def staged_buffers(state, block_table):
    """Distinct host and device tensors for every slot (the GPU build's layout, on the CPU), filled with garbage;
    num_computed_tokens' and block_table's hosts are the engine's state."""
    def pair(shape, dtype):
        return (torch.full(shape, GARBAGE, dtype=dtype), torch.full(shape, GARBAGE, dtype=dtype))

    def mask():
        return (torch.ones(MAX_REQS, dtype=torch.bool), torch.ones(MAX_REQS, dtype=torch.bool))

    return {"input_ids": pair((MAX_TOKENS,), torch.int32), "positions": pair((MAX_TOKENS,), torch.int64),
            "query_start_loc": pair((MAX_REQS + 1,), torch.int32), "seq_lens": pair((MAX_REQS,), torch.int32),
            "num_computed_tokens": (torch.from_numpy(state), torch.full((MAX_REQS,), GARBAGE, dtype=torch.int32)),
            "discard_request_mask": mask(),
            "block_table": (torch.from_numpy(block_table), torch.full((MAX_REQS, MAX_BLOCKS), GARBAGE,
                                                                       dtype=torch.int32)),
            "slot_mapping": pair((MAX_TOKENS,), torch.int64)}


@pytest.mark.parametrize("impl", ["interpreted", "generated"])
@pytest.mark.parametrize("preset", [None, "cpu"])
@settings(max_examples=25, deadline=None)
@given(drawn=steps())
def test_the_fill_writes_heads_and_the_tails_vllm_writes(impl, preset, drawn):
    step, computed, scheduled, totals = drawn
    state = np.zeros(MAX_REQS, dtype=np.int32)
    state[: len(computed)] = computed
    table = step.block_table.copy()
    step.block_table = table
    given_buffers = staged_buffers(state, table)
    reg = api.build(shipped_spec_path("vllm"), device="cpu", max_bs=MAX_REQS, max_num_tokens=MAX_TOKENS,
                    params={"max_blocks": MAX_BLOCKS}, preset=preset, impl=impl, adopt=given_buffers)
    reqs = step.num_reqs
    tokens = step.num_tokens
    reg.fill_from(step, raw_bs=reqs, padded_bs=reqs, raw_num_tokens=tokens, padded_num_tokens=tokens)
    want = reference(computed, scheduled, totals, step.token_ids, table)
    for host, device in (given_buffers[name] for name in ("input_ids", "positions", "slot_mapping")):
        assert host.tolist()[:tokens] == device.tolist()[:tokens]
    assert given_buffers["input_ids"][1][:tokens].tolist() == want["input_ids"]
    assert given_buffers["positions"][1][:tokens].tolist() == want["positions"]
    slot_tail = [-1] * (MAX_TOKENS - tokens) if preset is None else [GARBAGE] * (MAX_TOKENS - tokens)
    for buffer in given_buffers["slot_mapping"]:
        assert buffer.tolist() == want["slot_mapping"] + slot_tail  # GPU build: -1 to capacity; CPU: [:T] only
    for buffer in given_buffers["query_start_loc"]:  # repeat_last to capacity, host and device
        assert buffer.tolist() == want["query_start_loc"] + [tokens] * (MAX_REQS - reqs)
    for buffer in given_buffers["seq_lens"]:  # zero to capacity, host and device
        assert buffer.tolist() == want["seq_lens"] + [0] * (MAX_REQS - reqs)
    assert given_buffers["discard_request_mask"][1][:reqs].tolist() == want["discard_request_mask"]
    computed_host, computed_device = given_buffers["num_computed_tokens"]
    assert computed_device.tolist() == computed + [GARBAGE] * (MAX_REQS - reqs)  # rows [:R] staged, tail stale
    assert computed_host.tolist() == state.tolist()  # the engine's state is read, never written
    table_host, table_device = given_buffers["block_table"]
    assert torch.equal(table_device[:reqs], table_host[:reqs]) and bool((table_device[reqs:] == GARBAGE).all())
    assert np.array_equal(table_host.numpy(), step.block_table)


def test_one_tensor_for_host_and_device_is_staged_in_name_only():
    spec = load_spec(shipped_spec_path("vllm"))
    buffers = {}
    for slot in spec.slots:
        shape = {"max_num_tokens": (MAX_TOKENS,), "max_bs": (MAX_REQS,), "max_bs + 1": (MAX_REQS + 1,)}.get(
            str(slot.shape[0]), (MAX_REQS,))
        if slot.name == "block_table":
            shape = (MAX_REQS, MAX_BLOCKS)
        tensor = torch.zeros(shape, dtype=getattr(torch, slot.dtype))
        buffers[slot.name] = SimpleNamespace(cpu=tensor, gpu=tensor)  # vLLM's CPU build: .gpu is .cpu
    reg = api.build(spec, device="cpu", max_bs=MAX_REQS, max_num_tokens=MAX_TOKENS, params={"max_blocks": MAX_BLOCKS},
                    preset="cpu", adopt=buffers)
    for slot in reg.active:
        assert slot.buffers() == (buffers[slot.name].cpu,), slot.name


def test_the_spec_is_shipped_generated_and_its_presets_differ_only_in_the_slot_mapping_tail():
    spec = load_spec(shipped_spec_path("vllm"))
    assert [s.name for s in spec.slots] == ["input_ids", "positions", "query_start_loc", "seq_lens",
                                            "num_computed_tokens", "discard_request_mask", "block_table",
                                            "slot_mapping"]
    assert all(s.staged for s in spec.slots)
    assert dict(spec.presets) == {"cpu": {"slot_mapping_reset": "padded"}}
    default = (ROOT / "graphslot/generated/vllm_default.py").read_text()
    cpu = (ROOT / "graphslot/generated/vllm_cpu.py").read_text()
    assert "host_slot_mapping[raw_num_tokens:max_num_tokens]" in default
    assert "host_slot_mapping[raw_num_tokens:padded_num_tokens]" in cpu


def test_the_plugin_is_registered_with_vllms_loader():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry = project["project"]["entry-points"]["vllm.general_plugins"]
    assert entry == {"graphslot": "graphslot.integrations.vllm.patching:load_plugin"}
    assert "graphslot/slot_specs/vllm.yaml" in project["tool"]["graphslot"]["specs"]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cu130", " 0.32.0 "])
def test_the_version_it_is_built_for_runs(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.32.1", "0.32.0rc1", "0.32.0.dev3", "0.32", "unknown"])
def test_another_version_is_refused_in_one_line_naming_both(version):
    with pytest.raises(VllmRefused) as info:
        check_version(version)
    message = str(info.value)
    assert message == (f"graphslot.integrations.vllm is built for vLLM 0.32.0, found vLLM {version}: install "
                       "vllm==0.32.0, or set GRAPHSLOT_VLLM=0 to run stock vLLM")


def config(**changes):
    """A stand-in VllmConfig the plugin runs on, with ``changes`` (dotted: ``model.uses_mrope``)."""
    parts = {"model": SimpleNamespace(uses_mrope=False, enable_prompt_embeds=False),
             "scheduler": SimpleNamespace(async_scheduling=False),
             "parallel": SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1)}
    top = {"use_v2_model_runner": False, "speculative_config": None, "lora_config": None}
    for key, value in changes.items():
        if "." in key:
            part, name = key.split(".")
            setattr(parts[part], name, value)
        else:
            top[key] = value
    return SimpleNamespace(model_config=parts["model"], scheduler_config=parts["scheduler"],
                           parallel_config=parts["parallel"], **top)


@pytest.mark.parametrize("change, named", [
    ({"use_v2_model_runner": True}, "Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner)"),
    ({"speculative_config": object()}, "speculative decoding"),
    ({"model.uses_mrope": True}, "M-RoPE"),
    ({"model.enable_prompt_embeds": True}, "prompt embeds"),
    ({"scheduler.async_scheduling": True}, "async scheduling (--no-async-scheduling turns it off)"),
    ({"parallel.decode_context_parallel_size": 2}, "decode context parallelism (DCP=2)"),
    ({"parallel.prefill_context_parallel_size": 2}, "prefill context parallelism (PCP=2)"),
    ({"lora_config": object()}, "LoRA"),
])
def test_an_unsupported_configuration_is_refused_naming_the_feature(change, named):
    assert config_refusals(config()) == []
    found = config_refusals(config(**change))
    assert len(found) == 1 and found[0].startswith(named)
    with pytest.raises(VllmRefused) as info:
        refuse(found, "the worker's vLLM configuration")
    message = str(info.value)
    assert "\n" not in message and message.startswith("graphslot.integrations.vllm does not support " + named)
    assert message.endswith("): turn it off, or set GRAPHSLOT_VLLM=0 to run stock vLLM")


def test_a_runner_with_other_kv_cache_groups_is_refused():
    token_slots = "token_to_kv_slot"
    group = SimpleNamespace(slot_mapping_mode=token_slots)
    mamba = SimpleNamespace(slot_mapping_mode=SimpleNamespace(value="none"))

    def runner(*groups, prev=None):
        batch = SimpleNamespace(block_table=SimpleNamespace(block_tables=list(groups)), prev_sampled_token_ids=prev)
        return SimpleNamespace(vllm_config=config(), input_batch=batch)

    assert runner_refusals(runner(group), token_slots) == []
    assert runner_refusals(runner(group, group), token_slots) == [
        "2 KV-cache groups (a hybrid or multi-group model; the plugin fills one)"]
    assert runner_refusals(runner(mamba), token_slots) == [
        "KV-cache groups without a token slot mapping (slot_mapping_mode none)"]
    assert runner_refusals(runner(group, prev=torch.zeros(1)), token_slots) == [
        "async scheduling (the previous step's sampled tokens are on the device)"]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_importing_the_plugin_imports_no_vllm_switched_off_it_does_nothing_and_on_it_needs_vllm():
    proc = run_python("""
        import os, sys
        os.environ.pop("GRAPHSLOT_VLLM", None)
        import graphslot.integrations.vllm as plugin
        plugin.load_plugin()
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")), plugin.installed())
        sys.modules["vllm"] = None  # vLLM not installed, whatever this interpreter has
        os.environ["GRAPHSLOT_VLLM"] = "1"
        try:
            plugin.load_plugin()
        except ImportError as exc:
            print(exc)
    """)
    assert proc.returncode == 0, proc.stderr
    off, on = proc.stdout.splitlines()
    assert off == "[] False"
    assert on.startswith("graphslot.integrations.vllm needs vLLM 0.32.0 installed and importable: ")


class Runner(SimpleNamespace):
    """A stand-in runner, hashable by identity as vLLM's are (the plugin keeps per-runner state in weak
    dictionaries)."""

    __hash__ = object.__hash__


def cpu_gpu(shape, dtype):
    """A stand-in for vLLM's CpuGpuBuffer as the GPU build has it: two tensors."""
    return SimpleNamespace(cpu=torch.zeros(shape, dtype=dtype), gpu=torch.zeros(shape, dtype=dtype))


def fake_runner(**extra):
    """A stand-in GPUModelRunner on the CPU with the buffers the plugin adopts (distinct host and device)."""
    group = SimpleNamespace(block_table=cpu_gpu((MAX_REQS, MAX_BLOCKS), torch.int32),
                            slot_mapping=cpu_gpu((MAX_TOKENS,), torch.int64), slot_mapping_mode="token_to_kv_slot",
                            max_num_blocks_per_req=MAX_BLOCKS, block_size=BLOCK_SIZE)
    batch = SimpleNamespace(block_table=Groups([group]), prev_sampled_token_ids=None,
                            num_computed_tokens_cpu_tensor=torch.zeros(MAX_REQS, dtype=torch.int32))
    return Runner(input_batch=batch, vllm_config=config(), device=torch.device("cpu"), max_num_reqs=MAX_REQS,
                  max_num_tokens=MAX_TOKENS, input_ids=cpu_gpu((MAX_TOKENS,), torch.int32),
                  positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
                  query_start_loc=cpu_gpu((MAX_REQS + 1,), torch.int32),
                  seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
                  optimistic_seq_lens_cpu=torch.zeros(MAX_REQS, dtype=torch.int32),
                  num_computed_tokens=torch.zeros(MAX_REQS, dtype=torch.int32),
                  discard_request_mask=cpu_gpu((MAX_REQS,), torch.bool), **extra)


class Groups(list):
    """vLLM's MultiGroupBlockTable: indexable, and its groups as ``block_tables``."""

    @property
    def block_tables(self):
        return list(self)


def test_a_replaced_input_batch_is_adopted_again():
    runner = fake_runner()
    before = runner_fill.STATS["registries"]
    first = runner_fill.fill_of(runner, "token_to_kv_slot")
    assert runner_fill.fill_of(runner, "token_to_kv_slot") is first  # once per runner
    assert first.registry.slot("block_table").buffer is runner.input_batch.block_table[0].block_table.gpu
    runner.input_batch = fake_runner().input_batch  # may_reinitialize_input_batch
    second = runner_fill.fill_of(runner, "token_to_kv_slot")
    assert second is not first and runner_fill.registry_of(runner) is second.registry
    assert second.registry.slot("block_table").buffer is runner.input_batch.block_table[0].block_table.gpu
    assert second.registry.slot("slot_mapping").buffer is runner.input_batch.block_table[0].slot_mapping.gpu
    assert second.registry.host_buffer("positions") is first.registry.host_buffer("positions")  # kept
    assert runner_fill.STATS["registries"] - before == 2


def test_a_slot_a_fork_adds_is_adopted_from_the_runner_attribute_of_its_name():
    """A fork adds a slot for its runner's own CpuGpuBuffer: the plugin's buffers= finds it by name, and the
    slot's source hook reads the runner through the step."""
    runner = fake_runner(request_scale=cpu_gpu((MAX_REQS,), torch.float32),
                         scale_of_request=torch.arange(MAX_REQS, dtype=torch.float32) / 2)
    group = runner.input_batch.block_table[0]
    buffers = adopted_buffers(runner)
    assert list(buffers) == [s.name for s in load_spec(shipped_spec_path("vllm")).slots]
    assert buffers["request_scale"] is runner.request_scale and "nothing_here" not in buffers
    data = load_spec(shipped_spec_path("vllm")).to_dict()
    data["slots"].append({"name": "request_scale", "shape": ["max_bs"], "dtype": "float32", "axis": "bs",
                          "padding": "zero", "staged": True, "source": "fork_scale"})
    spec = spec_from_dict(data, label="<code: a vLLM fork>")
    reg = api.build(spec, device="cpu", max_bs=MAX_REQS, max_num_tokens=MAX_TOKENS, params={"max_blocks": MAX_BLOCKS},
                    preset="cpu", adopt=buffers,
                    hooks={"fork_scale": lambda fb, ctx: fb.runner.scale_of_request[: ctx.raw_bs]})
    step = VllmStep(2, np.array([3, 1], dtype=np.int32), np.zeros(MAX_REQS, dtype=np.int32), np.array([9, 9]),
                    torch.zeros((MAX_REQS, MODEL_LEN), dtype=torch.int32), group.block_table.cpu.numpy(), BLOCK_SIZE)
    step.runner = runner
    reg.fill_from(step, raw_bs=2, padded_bs=2, raw_num_tokens=4, padded_num_tokens=4)
    assert runner.request_scale.gpu.tolist() == [0.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert runner.query_start_loc.gpu.tolist() == [0, 3, 4, 4, 4, 4, 4]


def test_a_value_graphslot_vllm_does_not_take_is_an_error_naming_it(monkeypatch):
    import graphslot.integrations.vllm as plugin
    from graphslot.env import EnvError

    monkeypatch.setenv("GRAPHSLOT_VLLM", "maybe")
    with pytest.raises(EnvError, match=r"^GRAPHSLOT_VLLM='maybe' is not a boolean"):
        plugin.load_plugin()


def test_verify_poisons_and_audits_a_device_slot_a_fork_adds():
    """`graphslot verify` of a fork's spec: a slot on the device alone (neither staged nor `device: cpu`) has its
    tail poisoned on its one buffer, and its buffer is no audit candidate (both once asked for a host buffer)."""
    from graphslot.integrations.vllm.verify import audit_candidates, poison_tail
    from graphslot.tools.poison import Poisoner

    runner = fake_runner(request_scale=torch.zeros(MAX_REQS, dtype=torch.int32))
    data = load_spec(shipped_spec_path("vllm")).to_dict()
    data["slots"].append({"name": "request_scale", "shape": ["max_bs"], "dtype": "int32", "axis": "bs",
                          "padding": "keep_pad", "source": "fork_scale"})
    spec = spec_from_dict(data, label="<code: a vLLM fork>")
    reg = api.build(spec, device="cpu", max_bs=MAX_REQS, max_num_tokens=MAX_TOKENS, params={"max_blocks": MAX_BLOCKS},
                    preset="cpu", adopt=adopted_buffers(runner),
                    hooks={"fork_scale": lambda fb, ctx: torch.tensor([5, 6], dtype=torch.int32)})
    slot = reg.slot("request_scale")
    slot.buffer.copy_(torch.tensor([5, 6, 0, 0, 0, 0], dtype=torch.int32))
    poisoner = Poisoner()
    poison_tail(slot, poisoner, 2, 4, "stale")
    assert runner.request_scale.tolist() == [5, 6, 5, 6, 5, 6]  # the rows past the step's 2: its rows again
    candidates = audit_candidates(runner, reg)
    assert "runner.request_scale" not in candidates and "runner.positions" not in candidates


def test_a_poisoned_tail_that_leaks_makes_the_slot_unsafe_naming_the_first_leak():
    """`graphslot verify`'s verdict on a vLLM slot whose tail was poisoned: a run that failed or tokens that changed
    make it UNSAFE, its detail naming the first leak; no leak, safe, naming both patterns."""
    from graphslot.integrations.vllm.verify import leaks_verdict

    slot = SimpleNamespace(name="positions", resolved=SimpleNamespace(padding="keep_pad"),
                           buffer=torch.zeros(4, dtype=torch.int64))
    failed = {"pattern": "stale", "requests": [], "error": "ValueError: boom"}
    changed = {"pattern": "other seen values", "requests": [1, 3]}
    fix = "; reset the tail every step (padding zero or fill_sentinel with reset_to: capacity)"
    first_failed = leaks_verdict(slot, [failed, changed])
    assert (first_failed.slot, first_failed.policy, first_failed.verdict) == ("positions", "keep_pad", "UNSAFE")
    assert first_failed.detail == "the run fails with the tail poisoned (ValueError: boom)" + fix
    assert first_failed.leaks == [failed, changed]
    assert leaks_verdict(slot, [changed]).detail == ("poisoning the tail (other seen values) changes the tokens of "
                                                     "requests [1, 3]" + fix)
    safe = leaks_verdict(slot, [])
    assert (safe.verdict, safe.leaks) == ("safe", [])
    assert safe.detail == ("tail poisoned (stale, other seen values) after every step's fill: "
                           "the tokens equal the clean run's")
