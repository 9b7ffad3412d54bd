"""`graphslot verify`: the padding of a model's spec proven safe, or the leaking slot named;
the stale-input audit names the batch field a graph reads without a slot."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

import graphslot as gs
import verify_targets
from conftest import parse
from graphslot.cli.app import main
from graphslot.spec.files import display_path
from graphslot.reference.verify_target import reference_prefill_target, reference_target
from graphslot.runners.prefill import PrefillGraphRunner
from graphslot.tools.audit import audit_external_inputs
from graphslot.tools.poison import Poisoner, poisonable
from graphslot.tools.verify import TargetError, format_report, sample_raw_sizes, span, verify_runner
from verify_targets import hf_target, keep_pad_out_cache_loc_spec, stale_logit_bias, stale_prefill_bias


def verdicts(report):
    return {s.slot: s for s in report.slots}


def test_reference_model_passes_verify():
    target = reference_target("cpu", max_bs=8)
    target.runner(target.make_batch(3))
    before = (target.runner.metrics(), dict(target.runner.histogram.counts))
    report = verify_runner(target)
    # verify's own replays leave what the runner served untouched
    assert (target.runner.metrics(), dict(target.runner.histogram.counts)) == before
    assert before[1] == {3: 1}
    assert report.safe and report.problems == [] and report.external_inputs == []
    assert {padded for _, padded in report.cases} == {4, 8}  # every size that has a tail (2 and 1 have none)
    slots = verdicts(report)
    assert slots["input_ids"].verdict == "safe" and slots["input_ids"].policy == "foreach_copy"
    assert "poisoned (stale, other seen values) in 3 step(s)" in slots["input_ids"].detail
    assert slots["positions"].detail == "tail reset to 0 every step"
    assert slots["global_num_tokens_gpu"].verdict == "n/a"
    table = format_report(report)
    assert table.splitlines()[0].split() == ["slot", "policy", "verdict", "detail"]
    assert table.endswith("verdict: safe")


def test_a_stale_kv_slot_tail_is_named_with_the_policy_that_fixes_it():
    spec = gs.parse_spec(keep_pad_out_cache_loc_spec(), path="keep_pad.yaml")
    report = verify_runner(reference_target("cpu", max_bs=4, spec=spec))
    assert not report.safe
    unsafe = [s for s in report.slots if s.verdict == "UNSAFE"]
    assert [s.slot for s in unsafe] == ["out_cache_loc"]  # one slot at a time: only the culprit
    assert unsafe[0].policy == "keep_pad"
    rows = sorted({r for leak in unsafe[0].leaks for r in leak["rows"]})
    assert rows and set(rows) <= {0, 1, 2}  # raw 3 -> padded 4: the leak reaches real rows
    assert unsafe[0].detail.startswith(f"the tail leaks into real rows {span(rows)} (")
    assert "use padding 'zero'" in unsafe[0].detail
    assert unsafe[0].leaks[0]["padded_bs"] == 4 and unsafe[0].leaks[0]["raw_bs"] == 3


def test_the_audit_names_a_batch_field_that_is_not_a_slot():
    target = stale_logit_bias(max_bs=2)
    [found] = audit_external_inputs(target.runner)
    assert found.name == "fb.logit_bias" and found.is_batch_field
    assert found.shape == (128,) and found.dtype == "float32" and found.sizes == [1, 2]
    assert "declare it as a slot of the spec" in found.describe()
    report = verify_runner(target)
    assert not report.safe and all(s.verdict != "UNSAFE" for s in report.slots)


def test_the_audit_works_for_a_backend_that_cannot_list_inputs():
    class Opaque:  # a graph that only replays, as a CUDA graph does
        def __init__(self, graph):
            self.output, self.replay = graph.output, graph.replay

    runner = stale_logit_bias(max_bs=2).runner
    runner.graphs = {bs: Opaque(g) for bs, g in runner.graphs.items()}
    [tensor] = runner.external_inputs(2)  # captured again on the tape
    assert tensor.shape == (128,)


def test_sampled_raw_sizes_cover_the_longest_tail_of_every_size():
    assert sample_raw_sizes([8, 4, 2, 1], 1, 0) == [(3, 4), (5, 8)]
    cases = sample_raw_sizes([8, 4, 2, 1], 2, 0)
    assert cases[:2] == [(3, 4), (5, 8)] and cases[2][1] == 8 and cases[2][0] in (6, 7)
    assert sample_raw_sizes([1, 2], 3, 0) == []  # no raw size pads: nothing to poison
    assert span([0, 1, 2, 5, 7, 8]) == "0..2, 5, 7..8"


POISON_SPEC = """
name: p
slots:
  - {name: ids, shape: [max_bs], dtype: int64, axis: bs, padding: foreach_copy}
  - {name: scale, shape: [max_bs, 2], dtype: float32, axis: bs, padding: keep_pad}
  - {name: mask, shape: [max_bs], dtype: bool, axis: bs, padding: fill_once, pad_value: true}
  - {name: seq, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
"""


def test_poison_patterns_per_dtype():
    reg = gs.build_registry(parse(POISON_SPEC), max_bs=6, max_num_tokens=6, impl="interpreted", device="cpu")
    assert [s.name for s in reg.active if poisonable(s)] == ["ids", "scale", "mask"]
    ids, scale, mask = (reg.slot(n) for n in ("ids", "scale", "mask"))
    ids.buffer[:2] = torch.tensor([5, 9])
    scale.buffer[:2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask.buffer[:2] = torch.tensor([True, False])
    poisoner = Poisoner()
    poisoner.observe(ids, 2)
    for slot in (ids, scale, mask):
        assert poisoner.write(slot, 2, 5, "stale") is None
    assert ids.buffer[:5].tolist() == [5, 9, 5, 9, 5]  # real rows repeated over the tail
    assert scale.buffer[2:5].tolist() == [[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]]
    for slot in (ids, scale, mask):
        poisoner.write(slot, 2, 5, "hostile")
    assert ids.buffer[2:5].tolist() == [9, 0, 9]  # the next value seen (0: the allocation value)
    assert scale.buffer[2:5].isnan().all() and mask.buffer[2:5].tolist() == [False, True, False]
    assert ids.buffer[5] == 0 and ids.buffer[:2].tolist() == [5, 9]  # only [raw:padded] is written
    assert poisoner.write(ids, 4, 4, "stale") == "no padded rows"


def test_cli_verify_reference_json():
    from io import StringIO
    import contextlib

    out = StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["verify", "--backend", "cpu", "--max-bs", "4", "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["mode"] == "verify" and result["safe"] is True and result["backend"] == "cpu"
    assert result["cases"] == [{"raw_bs": 3, "padded_bs": 4}]
    assert {s["slot"]: s["verdict"] for s in result["slots"]}["input_ids"] == "safe"


def test_cli_verify_a_spec_with_a_leaking_tail_exits_1(tmp_path, capsys):
    path = tmp_path / "decode.yaml"
    path.write_text(keep_pad_out_cache_loc_spec())
    assert main(["verify", "--backend", "cpu", "--max-bs", "4", "--spec", str(path)]) == 1
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.startswith("out_cache_loc ")]
    assert row.split()[1:3] == ["keep_pad", "UNSAFE"]
    assert out.rstrip().endswith("verdict: UNSAFE")


def verify_error(capsys, *argv) -> tuple:
    """(exit status, last stderr line) of ``graphslot verify ARGV``; never a traceback."""
    status = main(["verify", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, err.splitlines()[-1]


def test_cli_verify_entry_points(capsys):
    assert main(["verify", "verify_targets:stale_logit_bias"]) == 1
    out = capsys.readouterr().out
    assert "fb.logit_bias [128] float32: read by the graph of size(s) 1, 2, 4" in out
    assert main(["verify", "verify_targets:reference_tuple"]) == 0
    capsys.readouterr()
    assert verify_error(capsys, "verify_targets:not_a_target") == (2, (
        "graphslot verify: error: target 'verify_targets:not_a_target': returned int; expected a VerifyTarget or a "
        "(DecodeGraphRunner, make_batch[, release]) tuple"))
    assert verify_error(capsys, "verify_targets:no_such_function") == (2, (
        "graphslot verify: error: target 'verify_targets:no_such_function': module 'verify_targets' has no "
        "attribute 'no_such_function'"))
    assert verify_error(capsys, "verify_targets") == (2, (
        "graphslot verify: error: TARGET must be package.module:function, got 'verify_targets'"))
    assert verify_error(capsys, "x:y", "--reference") == (2, "graphslot verify: error: give TARGET or --reference, "
                                                             "not both")


@pytest.fixture
def target_dir(tmp_path, monkeypatch):
    """A directory on sys.path (and the current one); ``target_dir(name, text)`` writes
    the module ``name`` there, forgotten by sys.modules after the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, text: str) -> None:
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.invalidate_caches()

    return write


@pytest.mark.parametrize("name, text, error", [
    ("target_syntax", "import graphslot\n\nx = (1\n",
     "cannot import it (target_syntax.py:3: SyntaxError: '(' was never closed)"),
    ("target_raises", "import graphslot\nraise RuntimeError('needs a GPU')\n",
     "cannot import it (target_raises.py:2: RuntimeError: needs a GPU)"),
    ("target_imports_missing", "import not_a_module_anywhere\n",
     "cannot import it (target_imports_missing.py:1: ModuleNotFoundError: No module named 'not_a_module_anywhere')"),
    ("target_exits", "import sys\nsys.exit(3)\n", "cannot import it (target_exits.py:2: SystemExit: 3)"),
])
def test_a_target_that_cannot_be_imported_is_one_line_naming_it(capsys, target_dir, name, text, error):
    target_dir(name, text)
    assert verify_error(capsys, f"{name}:make") == (2, f"graphslot verify: error: target '{name}:make': {error}")


def test_a_missing_target_module_is_one_line(capsys, target_dir):
    assert verify_error(capsys, "no_such_target_module:make") == (2, (
        "graphslot verify: error: target 'no_such_target_module:make': cannot import it (ModuleNotFoundError: No "
        "module named 'no_such_target_module')"))


def test_a_target_that_raises_when_called_is_one_line_naming_where(capsys):
    status, line = verify_error(capsys, "verify_targets:raises_when_called")
    assert status == 2 and line == (
        "graphslot verify: error: target 'verify_targets:raises_when_called': calling it raised "
        f"({display_path(Path(verify_targets.__file__))}:{raises_line()}: RuntimeError: no model checkpoint "
        "configured)")


def raises_line() -> int:
    source, start = inspect.getsourcelines(verify_targets.raises_when_called)
    return start + next(i for i, line in enumerate(source) if "raise RuntimeError" in line)


def test_a_make_batch_that_ignores_n_is_a_target_error_not_an_unsafe_slot(capsys):
    message = "make_batch(3) returned a batch of 4 requests; make_batch(n) must make a batch of exactly n requests"
    with pytest.raises(TargetError) as info:
        verify_runner(verify_targets.ignores_n())
    assert str(info.value) == message
    assert verify_error(capsys, "verify_targets:ignores_n") == (
        2, f"graphslot verify: error: target 'verify_targets:ignores_n': {message}")


def test_a_make_batch_that_raises_is_a_target_error():
    target = reference_target("cpu", max_bs=4)

    def make_batch(n):
        raise KeyError(n)

    target.make_batch = make_batch
    with pytest.raises(TargetError) as info:
        verify_runner(target)
    line = inspect.getsourcelines(make_batch)[1] + 1
    assert str(info.value) == f"make_batch(3) raised ({display_path(Path(__file__))}:{line}: KeyError: 3)"


@pytest.mark.parametrize("options, named", [
    (["--spec", "decode.yaml"], "--spec"),
    (["--max-bs", "4", "--backend", "cpu"], "--max-bs, --backend"),
    (["--backend", "auto"], "--backend"),
])
def test_reference_model_options_with_a_target_are_a_usage_error(capsys, options, named):
    assert verify_error(capsys, "verify_targets:reference_tuple", *options) == (2, (
        f"graphslot verify: error: {named} apply only to the reference model, not to TARGET "
        "'verify_targets:reference_tuple', whose runner has its own spec, sizes and backend"))


def test_the_transformers_integration_passes_verify():
    pytest.importorskip("transformers")
    report = verify_runner(hf_target("llama"))
    assert report.safe and report.cases == [(3, 4)]
    assert verdicts(report)["input_ids"].verdict == "safe"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_on_cuda_graphs():
    report = verify_runner(reference_target("cuda", max_bs=8))
    assert report.backend == "cuda" and report.safe, format_report(report)
    spec = gs.parse_spec(keep_pad_out_cache_loc_spec(), path="keep_pad.yaml")
    bad = verify_runner(reference_target("cuda", max_bs=8, spec=spec))
    assert [s.slot for s in bad.slots if s.verdict == "UNSAFE"] == ["out_cache_loc"], format_report(bad)


def _must_not_build(*args, **kwargs):
    raise AssertionError("the reference model was built")


@pytest.mark.parametrize("argv, message", [
    (["--max-bs", "1000000"], "argument --max-bs: 1000000 is over the limit of 256 (graphs are captured at sizes up "
                              "to it, and their memory grows with it)"),
    (["--seed", str(10**23)], "argument --seed: expected an integer from 0 to 2**64-1 (what torch.manual_seed "
                              "takes), got '100000000000000000000000'"),
    (["--seed", "-1"], "argument --seed: expected an integer from 0 to 2**64-1 (what torch.manual_seed takes), "
                       "got '-1'"),
    (["--spec", "prefill"], "argument --spec: spec 'prefill' (graphslot/slot_specs/prefill.yaml) is not a decode "
                            "spec: it declares no param 'seq_len_fill_value', which the reference model's decode "
                            "runner sets; give a decode spec (the shipped 'decode', or a copy of it)"),
])
def test_cli_verify_refuses_a_reference_option_it_cannot_use_before_building_anything(monkeypatch, capsys, argv,
                                                                                        message):
    """`--max-bs 1000000` grew until the kernel killed it, `--seed 10**23` ended in torch's
    "Overflow when unpacking long long", `--spec prefill` blamed the shipped prefill.yaml."""
    monkeypatch.setattr("graphslot.reference.verify_target.build_reference_model", _must_not_build)
    assert verify_error(capsys, "--backend", "cpu", *argv) == (2, f"graphslot verify: error: {message}")


def test_cli_verify_takes_the_largest_seed_torch_takes(capsys):
    assert main(["verify", "--backend", "cpu", "--max-bs", "2", "--no-audit", "--seed", str(2**64 - 1)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("verdict: safe")


# --------------------------------------------------------------------- the prefill runner


@pytest.mark.parametrize("capture", ["full", "breakable", "piecewise"])
def test_the_reference_prefill_runner_passes_verify(capture):
    target = reference_prefill_target("cpu", capture=capture)
    report = verify_runner(target)
    assert report.safe, format_report(report)
    assert {padded for _, padded in report.cases} == {16, 32}  # token buckets: raw tokens -> bucket
    assert (1, 16) in report.cases and (17, 32) in report.cases  # the longest tail of each
    assert {s.slot for s in report.slots} >= {"input_ids", "positions", "out_cache_loc"}
    assert target.runner.metrics()["replays"] == 0  # verify's replays stay out of the metrics


def test_a_stale_kv_slot_tail_of_a_prefill_spec_is_poisoned_and_named():
    spec = gs.parse_spec(keep_pad_out_cache_loc_spec("prefill"), path="keep_pad_prefill.yaml")
    target = reference_prefill_target("cpu", capture="breakable")
    target.runner = PrefillGraphRunner(target.runner.adapter, target.runner.config, spec=spec)
    report = verify_runner(target)
    assert not report.safe
    [unsafe] = [s for s in report.slots if s.verdict == "UNSAFE"]
    assert unsafe.slot == "out_cache_loc" and unsafe.policy == "keep_pad"
    assert {leak["padded_bs"] for leak in unsafe.leaks} <= {16, 32} and "use padding 'zero'" in unsafe.detail


def test_the_audit_names_a_batch_field_a_prefill_graph_reads():
    target = stale_prefill_bias()
    [found] = audit_external_inputs(target.runner)
    assert found.name == "fb.hidden_bias" and found.is_batch_field and found.sizes == [16, 32]
    report = verify_runner(target)
    assert not report.safe and report.external_inputs and all(s.verdict != "UNSAFE" for s in report.slots)


def test_cli_verify_runs_a_prefill_target(capsys):
    assert main(["verify", "graphslot.reference.verify_target:reference_prefill_target"]) == 0
    out = capsys.readouterr().out
    assert "steps replayed (raw->padded): 1->16" in out and out.rstrip().endswith("verdict: safe")
    assert main(["verify", "verify_targets:stale_prefill_bias"]) == 1
    assert "fb.hidden_bias" in capsys.readouterr().out
