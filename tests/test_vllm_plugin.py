"""graphslot.integrations.vllm inside vLLM 0.32 (CPU build, in-process engine): one tiny random Llama, built once
for the module, runs a mixed offline workload stock and with the plugin.

- greedy tokens with the plugin equal stock vLLM's, request by request, also with every slot buffer garbage over
  its whole capacity before every step;
- a differential at every step: vLLM's own ``_prepare_inputs`` runs, its outputs are kept, every buffer it wrote is
  poisoned, graphslot's runs on the same state, and each slot's head, the tails vLLM writes, the host views vLLM
  reads later and the return value must equal vLLM's;
- the version refusal, switched off = untouched, ``stats()``, the INFO line, a configuration refused;
- ``graphslot verify graphslot.integrations.vllm.verify:target`` on this engine: the shipped spec safe, a spec
  without ``positions`` unsafe, ``runner.positions`` a stale input.

The engine and the workload are ``graphslot.integrations.vllm.workload``'s.

Skipped where vLLM is not installed (the system python); CI runs them in the vLLM venv.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: patches reach it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; else the CPU worker sizes the cache from free memory
vllm = pytest.importorskip("vllm", reason="vllm not installed; CI runs them in .venv-vllm")

from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402
from vllm.v1.worker.worker_base import WorkerBase  # noqa: E402

import graphslot.integrations.vllm as plugin  # noqa: E402
from graphslot.integrations.vllm import patching  # noqa: E402
from graphslot.integrations.vllm.workload import MAX_NEW, generate, tiny_engine  # noqa: E402
from graphslot.spec.loading import load_spec, shipped_spec_path  # noqa: E402

STATE_SLOTS = {s.name for s in load_spec(shipped_spec_path("vllm")).slots if not s.copy_from_fb}  # host = vLLM state
POISON = -123457


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    plugin.uninstall()
    yield tiny_engine(tmp_path_factory.mktemp("tiny_llama"))
    plugin.uninstall()


@pytest.fixture(scope="module")
def stock(llm):
    """Stock vLLM's tokens per request, and its steps (``_prepare_inputs`` calls)."""
    assert not plugin.installed()
    calls = []
    tokens = generate(llm, lambda inner, runner, *args: calls.append(1) or inner(runner, *args))
    return tokens, len(calls)


@pytest.fixture
def installed():
    plugin.install()
    yield
    plugin.uninstall()


def writable(runner):
    """Every buffer the plugin's fill writes, whole: each slot's host and device tensors (one, when they are one
    tensor) but the hosts that are vLLM's own state, and the bookkeeping ``_prepare_inputs`` writes besides."""
    found = {}
    for name, value in plugin.adopted_buffers(runner).items():
        host, device = (value.cpu, value.gpu) if hasattr(value, "gpu") else value
        if name not in STATE_SLOTS:
            found[f"{name} (host)"] = host
        if device is not host:
            found[name] = device
    for name in ("prev_positions", "num_accepted_tokens"):
        found[f"{name} (host)"] = getattr(runner, name).cpu
    return found


def poison(runner):
    for tensor in {t.data_ptr(): t for t in writable(runner).values()}.values():
        if tensor.dtype == torch.bool:
            tensor.logical_not_()  # every element differs from what was there
        else:
            tensor.fill_(POISON)


def views(runner, scheduler_output, returned):
    """What a step defines, as vLLM 0.32 writes it on the CPU build: each slot's head (host and device), the tails
    vLLM writes (query_start_loc to capacity, seq_lens zero to capacity), the host views vLLM reads later, and
    ``_prepare_inputs``' return value. Copies."""
    reqs = runner.input_batch.num_reqs
    tokens = scheduler_output.total_num_scheduled_tokens
    group = runner.input_batch.block_table[0]
    out = {"input_ids": runner.input_ids.gpu[:tokens], "input_ids (host)": runner.input_ids.cpu[:tokens],
           "positions": runner.positions[:tokens],
           "query_start_loc": runner.query_start_loc.gpu, "query_start_loc (host)": runner.query_start_loc.cpu,
           "seq_lens": runner.seq_lens, "seq_lens (host)": runner.optimistic_seq_lens_cpu,
           "num_computed_tokens": runner.num_computed_tokens[:reqs],
           "discard_request_mask": runner.discard_request_mask.gpu[:reqs],
           "discard_request_mask (host)": runner.discard_request_mask.cpu[:reqs],
           "block_table": group.block_table.gpu[:reqs], "slot_mapping": group.slot_mapping.gpu[:tokens],
           "slot_mapping (host)": group.slot_mapping.cpu[:tokens],
           "prev_positions (host)": runner.prev_positions.cpu[:reqs],
           "num_accepted_tokens": runner.num_accepted_tokens.gpu,
           "logits_indices": returned[0]}
    out = {name: tensor.clone() for name, tensor in out.items()}
    out["returned"] = (returned[1], returned[2])
    return out


def test_tokens_equal_stock_request_by_request(llm, stock, installed):
    before = plugin.stats()["steps"]
    assert generate(llm) == stock[0]
    assert plugin.stats()["steps"] - before == stock[1]  # every step went through graphslot
    assert stock[1] > 10 and [len(t) for t in stock[0]] == MAX_NEW


def test_tokens_equal_stock_with_every_slot_buffer_garbage_before_every_step(llm, stock, installed):
    poisoned = []

    def garbage_first(inner, runner, *args):
        poison(runner)
        poisoned.append(len(writable(runner)))
        return inner(runner, *args)

    assert generate(llm, garbage_first) == stock[0]
    assert len(poisoned) == stock[1] and min(poisoned) >= 10


def test_every_step_writes_what_vllm_writes(llm, stock, installed):
    stock_prepare = patching._ORIGINALS["prepare_inputs"]
    differences = []
    steps = []

    def differential(inner, runner, scheduler_output, counts):
        want = views(runner, scheduler_output, stock_prepare(runner, scheduler_output, counts))
        poison(runner)
        returned = inner(runner, scheduler_output, counts)
        got = views(runner, scheduler_output, returned)
        steps.append((runner.input_batch.num_reqs, scheduler_output.total_num_scheduled_tokens))
        for name in want:
            same = want[name] == got[name] if name == "returned" else torch.equal(want[name], got[name])
            if not same:
                differences.append(f"step {len(steps)} {steps[-1]}: {name}: vLLM {want[name]}, graphslot {got[name]}")
        return returned

    assert generate(llm, differential) == stock[0]
    assert differences == []
    assert len(steps) == stock[1]
    assert len({reqs for reqs, _ in steps}) >= 4 and {tokens for _, tokens in steps} >= {64, 1}  # batches vary


def test_one_registry_per_runner_on_its_own_buffers(llm, installed):
    runners = []
    generate(llm, lambda inner, runner, *args: runners.append(runner) or inner(runner, *args))
    runner = runners[0]
    assert all(r is runner for r in runners)
    reg = plugin.registry_of(runner)
    assert reg is not None and reg.slot_names() == [s.name for s in load_spec(shipped_spec_path("vllm")).slots]
    assert reg.slot("input_ids").buffer is runner.input_ids.gpu and reg.host_buffer("input_ids") is runner.input_ids.cpu
    assert reg.slot("seq_lens").buffer is runner.seq_lens
    assert reg.host_buffer("seq_lens") is runner.optimistic_seq_lens_cpu
    assert reg.slot("slot_mapping").buffer is runner.input_batch.block_table[0].slot_mapping.gpu
    assert reg.host_buffer("num_computed_tokens") is runner.input_batch.num_computed_tokens_cpu_tensor


def test_the_install_says_which_vllm_spec_and_slots_at_info(caplog):
    plugin.uninstall()
    with caplog.at_level(logging.INFO, logger="graphslot"):
        plugin.install()
    plugin.uninstall()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("graphslot")]
    assert lines == ["vLLM 0.32.0: GPUModelRunner._prepare_inputs fills graphslot spec 'vllm' "
                     "(graphslot/slot_specs/vllm.yaml; preset cpu on the CPU build); slots input_ids, positions, "
                     "query_start_loc, seq_lens, num_computed_tokens, discard_request_mask, block_table, slot_mapping"]


def test_another_vllm_version_is_refused_naming_both(monkeypatch):
    plugin.uninstall()
    stock_prepare = GPUModelRunner._prepare_inputs
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(plugin.VllmRefused) as info:
        plugin.install()
    assert str(info.value) == ("graphslot.integrations.vllm is built for vLLM 0.32.0, found vLLM 0.33.1: install "
                               "vllm==0.32.0, or set GRAPHSLOT_VLLM=0 to run stock vLLM")
    assert GPUModelRunner._prepare_inputs is stock_prepare and not plugin.installed()


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("off", False), ("", False), ("1", True),
                                       ("yes", True)])
def test_the_plugin_entry_point_follows_graphslot_vllm(monkeypatch, value, on):
    plugin.uninstall()
    stock_prepare = GPUModelRunner._prepare_inputs
    stock_init = WorkerBase.__init__
    if value is None:
        monkeypatch.delenv("GRAPHSLOT_VLLM", raising=False)
    else:
        monkeypatch.setenv("GRAPHSLOT_VLLM", value)
    try:
        plugin.load_plugin()
        assert plugin.installed() is on
        assert (GPUModelRunner._prepare_inputs is stock_prepare) is not on
        assert (WorkerBase.__init__ is stock_init) is not on
    finally:
        plugin.uninstall()
    assert GPUModelRunner._prepare_inputs is stock_prepare and WorkerBase.__init__ is stock_init


def changed(config, part, **values):
    """A copy of the VllmConfig ``config`` whose ``part`` (model_config, ...) is a copy with ``values`` set."""
    new = copy.copy(config)
    piece = copy.copy(getattr(config, part))
    for name, value in values.items():
        object.__setattr__(piece, name, value)
    object.__setattr__(new, part, piece)
    return new


@pytest.mark.parametrize("part, values, named", [
    ("model_config", {"enable_prompt_embeds": True}, "prompt embeds (enable_prompt_embeds)"),
    ("scheduler_config", {"async_scheduling": True}, "async scheduling (--no-async-scheduling turns it off)"),
])
def test_a_worker_of_an_unsupported_configuration_is_refused(llm, installed, part, values, named):
    config = llm.llm_engine.vllm_config
    WorkerBase(config, 0, 0, "tcp://127.0.0.1:1")  # the engine's own configuration runs
    with pytest.raises(plugin.VllmRefused) as info:
        WorkerBase(changed(config, part, **values), 0, 0, "tcp://127.0.0.1:1")
    assert str(info.value) == (f"graphslot.integrations.vllm does not support {named} (the worker's vLLM "
                               "configuration): turn it off, or set GRAPHSLOT_VLLM=0 to run stock vLLM")


def verify_cli(monkeypatch, capsys, target):
    """``graphslot verify graphslot.integrations.vllm.verify:target`` with ``target`` in place of the one that builds
    its own engine: (exit status, stdout)."""
    from graphslot.cli.app import main
    from graphslot.integrations.vllm import verify

    monkeypatch.setattr(verify, "target", lambda: target)
    status = main(["verify", "graphslot.integrations.vllm.verify:target"])
    return status, capsys.readouterr().out


def test_verify_finds_the_shipped_spec_safe(llm, stock, monkeypatch, capsys):
    from graphslot.integrations.vllm.verify import VllmVerify

    status, out = verify_cli(monkeypatch, capsys, VllmVerify(llm))
    assert status == 0, out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[1:9]}
    assert rows == {"input_ids": ["foreach_copy", "safe"], "positions": ["keep_pad", "safe"],
                    "query_start_loc": ["repeat_last", "safe"], "seq_lens": ["zero", "safe"],
                    "num_computed_tokens": ["keep_pad", "safe"], "discard_request_mask": ["keep_pad", "safe"],
                    "block_table": ["keep_pad", "safe"], "slot_mapping": ["fill_sentinel", "safe"]}
    assert "tail poisoned (stale, other seen values) after every step's fill" in out  # the tails were poisoned
    assert f"{stock[1]} steps of 14 requests" in out and out.rstrip().endswith("verdict: safe")
    assert not plugin.installed()  # verify leaves the plugin as it found it


def test_verify_finds_an_input_the_spec_does_not_write_stale(llm, stock, monkeypatch, capsys, tmp_path):
    import yaml

    from graphslot.integrations.vllm.verify import VllmVerify

    spec = yaml.safe_load(shipped_spec_path("vllm").read_text())
    spec["slots"] = [slot for slot in spec["slots"] if slot["name"] != "positions"]  # nothing writes positions
    broken = tmp_path / "vllm.yaml"
    broken.write_text(yaml.safe_dump(spec))
    status, out = verify_cli(monkeypatch, capsys, VllmVerify(llm, spec=broken))
    assert status == 1, out
    assert "stale inputs:\n  runner.positions [64] int64: poisoned before each step's _prepare_inputs" in out
    assert "problem: the tokens differ from stock vLLM's in requests" in out
    assert out.rstrip().endswith("verdict: UNSAFE")
    plugin.install()
    try:
        assert generate(llm) == stock[0]  # the shipped spec again from the next step on
    finally:
        plugin.uninstall()
