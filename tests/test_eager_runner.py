"""The eager path through the slots computes what plain eager computes."""

from __future__ import annotations

import pytest
import torch

from graphslot.reference import Scheduler, build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.runners.eager import NO_COPY_ENV, EagerRunner, next_power_of_two


class Spy(ReferenceDecodeAdapter):
    """Remembers the batch the model was run on."""

    def forward_eager(self, fb):
        self.seen = fb
        return super().forward_eager(fb)


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_eager_through_the_registry_equals_plain_eager(mode):
    rt = build_reference_model()
    runner = EagerRunner(ReferenceDecodeAdapter(rt), max_bs=4, impl=mode)
    kinds = set()

    def both(fb):
        through = runner(fb)
        plain = rt.forward(fb)
        assert torch.equal(through, plain)
        kinds.add(fb.forward_mode)
        return plain

    Scheduler(rt, seed=3, num_requests=10, max_running=8).run(both, both, max_steps=40)
    assert len(kinds) == 2  # extend and decode
    assert runner.registry.impl == mode and runner.rebuilds > 0


def test_capacity_grows_to_the_next_power_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    rt = build_reference_model()
    runner = EagerRunner(ReferenceDecodeAdapter(rt), max_bs=4, max_num_tokens=4)
    before = runner.registry.slot("input_ids").buffer
    rpi = rt.req_to_token_pool.alloc(5)
    runner(make_extend_batch(rt, rpi[:3], [0] * 3, [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13]]))
    assert runner.capacity == (4, 16) and runner.rebuilds == 1
    assert runner.registry.slot("input_ids").buffer is not before
    runner(make_extend_batch(rt, rpi[3:], [0] * 2, [[1], [2]]))
    assert runner.capacity == (4, 16) and runner.rebuilds == 1  # fits: buffers stay
    runner(make_decode_batch(rt, rpi, [4, 5, 4, 1, 1], [1] * 5))
    assert runner.capacity == (8, 16) and runner.rebuilds == 2


def test_eager_preset_carries_dp_counts_from_the_batch():
    rt = build_reference_model()
    adapter = Spy(rt)
    runner = EagerRunner(adapter, max_bs=4, params={"require_gathered_buffer": True,
                                                    "require_mlp_tp_gather": True, "dp_size": 2})
    assert runner.registry.params["seq_len_fill_value"] == 0
    assert not runner.registry.has_slot("global_num_tokens_gpu")
    rpi = rt.req_to_token_pool.alloc(2)
    fb = make_extend_batch(rt, rpi, [0, 0], [[1, 2], [3]])
    fb.global_num_tokens_gpu = torch.tensor([3, 7], dtype=torch.int32)
    fb.global_num_tokens_cpu = [3, 7]
    runner(fb)
    assert adapter.seen.global_num_tokens_gpu is fb.global_num_tokens_gpu
    assert fb.global_num_tokens_gpu.tolist() == [3, 7]
    assert adapter.seen.input_ids.data_ptr() == runner.registry.slot("input_ids").buffer.data_ptr()


@pytest.mark.parametrize("via", ["flag", "env"])
def test_no_copy_runs_on_the_batch_tensors(via, monkeypatch):
    rt = build_reference_model()
    adapter = Spy(rt)
    if via == "env":
        monkeypatch.setenv(NO_COPY_ENV, "1")
        runner = EagerRunner(adapter)
    else:
        monkeypatch.delenv(NO_COPY_ENV, raising=False)
        runner = EagerRunner(adapter, no_copy=True)
    assert runner.no_copy
    rpi = rt.req_to_token_pool.alloc(2)
    fb = make_extend_batch(rt, rpi, [0, 0], [[1, 2], [3]])
    runner(fb)
    for name in ("input_ids", "positions", "seq_lens", "out_cache_loc"):
        assert getattr(adapter.seen, name).data_ptr() == getattr(fb, name).data_ptr()


def test_env_var_off_means_copy(monkeypatch):
    monkeypatch.setenv(NO_COPY_ENV, "0")
    assert not EagerRunner(ReferenceDecodeAdapter(build_reference_model())).no_copy


def test_a_spec_of_your_own_is_used_and_must_have_the_eager_preset(tmp_path):
    import graphslot as gs
    from graphslot.spec.loading import spec_path

    text = spec_path("decode").read_text(encoding="utf-8").replace("name: decode", "name: my_decode", 1)
    (tmp_path / "my_decode.yaml").write_text(text, encoding="utf-8")
    rt = build_reference_model()
    runner = EagerRunner(ReferenceDecodeAdapter(rt), spec=tmp_path / "my_decode.yaml", max_bs=4)
    assert runner.registry.spec.name == "my_decode"
    fb = make_decode_batch(rt, rt.req_to_token_pool.alloc(2), [3, 5], [7, 8])
    assert torch.equal(runner(fb), rt.forward(fb))

    bare = gs.load_spec("decode").model_copy(update={"presets": {}})
    with pytest.raises(ValueError, match="EagerRunner needs a spec with an 'eager' preset.*spec 'decode'"):
        EagerRunner(ReferenceDecodeAdapter(rt), spec=bare)
