"""benchmarks/gpu_proof.py, the script a lent GPU runs once (issue 45): its --smoke run on
the CPU exercises every part end to end (about 3 minutes here: every piece is a process
of its own), and the orchestrator records a piece that fails or hangs and goes on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gpu_proof  # noqa: E402
import proof_report  # noqa: E402

PART_FILES = {1: "part1_correctness.json", 2: "part2_fill.json", 3: "part3_capture.json", 4: "part4_serving.json"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_proof")
    rc = gpu_proof.main(["--smoke", "--out", str(out), "--work", str(tmp_path_factory.mktemp("gpu_proof_work"))])
    return rc, out, {part: json.loads((out / name).read_text()) for part, name in PART_FILES.items()}


def test_smoke_runs_every_part_and_every_piece_to_its_end(smoke):
    rc, out, parts = smoke
    assert rc == 0
    env = json.loads((out / "environment.json").read_text())
    assert env["torch"] and env["wheels"]["installed"] == []  # --smoke runs on this machine's packages
    assert env["problems"] == [] and env["graphslot"]  # the preflight found graphslot importable
    for part, result in parts.items():
        assert result["part"] == part and result["smoke"] is True and result["state"] == "done"
        assert set(result) == {"part", "name", "smoke", "state", "budget_s", "seconds", "pieces", "summary"}
        for name, piece in result["pieces"].items():
            assert piece["rc"] == 0 and not piece["timed_out"], (name, piece.get("tail"))
            assert isinstance(piece["result"], dict), name
        assert result["summary"]["every_piece_ran"] is True


def test_out_holds_what_a_device_call_brings_back(smoke):
    """A device call brings back at most 8 files of $OUT, none more than 2 folders down:
    the part files, the environment and one log; the pieces' logs and results stay in --work."""
    rc, out, parts = smoke
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert files == ["environment.json", "part1_correctness.json", "part2_fill.json", "part3_capture.json",
                     "part4_serving.json", "pieces.log"]
    log = (out / "pieces.log").read_text()
    names = [name for result in parts.values() for name in result["pieces"]]
    assert [line.split(" ")[1] for line in log.splitlines() if line.startswith("==== ")] == names


def test_part1_checks_tests_demos_and_the_batcher_around_reduce_overhead(smoke):
    summary = smoke[2][1]["summary"]
    # On the CPU every CUDA test skips, each saying why; the two-GPU one says so.
    assert summary["tests"]["skipped"] > 0 and summary["tests"]["failed"] == 0
    assert summary["two_gpu_skips"] >= 1
    assert summary["demo_mismatches"] == {"decode full (cli)": 0, "prefill breakable+piecewise (cli)": 0,
                                          "decode breakable": 0, "decode piecewise": 0}
    assert set(summary["batcher_tokens_equal"]) == {
        "batch 1", "batch 2", "batch 4", "trace", "reduce-overhead batch 1", "reduce-overhead batch 2",
        "after reduce-overhead: batch", "after reduce-overhead: trace"}
    assert all(summary["batcher_tokens_equal"].values()) and summary["correct"] is True
    batcher = smoke[2][1]["pieces"]["batcher"]["result"]
    trace = batcher["trace"]
    assert trace["steps_changing_size"] == trace["steps"]  # the batch changes size every step


def test_part2_times_the_dropin_against_both_sglang_paths(smoke):
    result = smoke[2][2]
    fill = result["pieces"]["fill"]["result"]
    if fill.get("skipped"):
        assert fill["sglang"] is None and "sglang missing" in fill["skipped"]
        return
    assert [(r["raw"], r["padded"]) for r in fill["rows"]] == [(3, 4), (30, 32), (200, 256)]
    assert fill["null_figures"].startswith("CUDA only")  # why the launches below are null
    for row in fill["rows"]:
        for name in ("graphslot", "sglang", "sglang_fast_path"):
            assert row[f"{name}_us"] > 0 and row[f"{name}_launches"] is None  # kernels: CUDA only
        assert row["sglang_same_buffers"] and row["sglang_fast_path_same_buffers"]
    assert result["summary"]["targets"]["one_gpu_event_per_padded_fill"] is None


def test_part3_captures_in_every_mode_and_times_the_gap(smoke):
    summary = smoke[2][3]["summary"]
    assert set(summary["capture"]) == {"full", "breakable", "piecewise"}
    assert summary["capture"]["piecewise"]["dynamo_graphs"] == 1  # one trace for every size (issue 43)
    assert summary["capture"]["full"]["dynamo_graphs"] == 0
    full = summary["capture"]["full"]
    assert full["reserved"] is None and full["reserved_met"] is None  # CUDA's allocator only
    assert full["seconds"] > 0 and full["seconds_met"] == (full["seconds"] <= 5.0)
    assert summary["gap"]["bs"] == 8 and summary["gap"]["gap_met"] is None


def test_part4_serves_every_engine_and_the_trace(smoke):
    result = smoke[2][4]
    serving = result["pieces"]["serving"]["result"]
    assert set(serving["batches"]) == {"1", "2", "4"}
    for row in serving["batches"].values():
        assert set(row) == {"generate", "graphslot", "reduce_overhead", "hf_cb"}
        assert all(e["equal"] == e["total"] and e["tokens_per_s"] > 0 for e in row.values())
    assert {"graphslot", "reduce_overhead_per_size", "reduce_overhead_padded_to_max"} <= set(serving["trace"])
    assert result["summary"]["targets"]["ahead_of_reduce_overhead_on_trace"] in (True, False)


# -- the orchestrator alone (no torch in the pieces: seconds) ------------------------------
def fake_piece(name: str, code: str) -> gpu_proof.Piece:
    return gpu_proof.Piece(name, [sys.executable, "-c", code], kind="stdout_json")


def test_a_failing_or_hanging_piece_is_recorded_and_the_next_part_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    part2_file = out / "part2_fill.json"
    # "watch" prints the part's file as it stands while "watch" itself runs.
    watch = f"import time; time.sleep(2); print(open({str(part2_file)!r}).read())"
    pieces = {2: [fake_piece("crash", "import sys; print('boom: CUDA error', file=sys.stderr); sys.exit(3)"),
                  fake_piece("watch", watch), fake_piece("hang", "import time; time.sleep(600)")],
              3: [fake_piece("fine", "print('{\"x\": 1}')")]}
    monkeypatch.setattr(gpu_proof, "plan", lambda part, smoke, work: pieces[part])
    monkeypatch.setattr(gpu_proof, "preflight", lambda env, wheels, cuda: {"wheels": wheels, "problems": []})
    monkeypatch.setattr(gpu_proof, "PROGRESS_S", 0.5)
    monkeypatch.setitem(gpu_proof.PARTS, 2, ("fill", 6, 0))  # the hanging piece gets what is left of 6 s
    assert gpu_proof.main(["--smoke", "--parts", "2,3", "--out", str(out), "--work", str(tmp_path / "work")]) == 1
    part2 = json.loads(part2_file.read_text())["pieces"]
    assert part2["crash"]["rc"] == 3 and "boom: CUDA error" in part2["crash"]["tail"]
    assert part2["hang"]["timed_out"] is True and part2["hang"]["seconds"] < 30
    # While "watch" ran, the part's file already held the crash and "watch" itself, running.
    seen = part2["watch"]["result"]
    assert seen["state"] == "running" and seen["pieces"]["crash"]["rc"] == 3
    assert seen["pieces"]["watch"]["running"] is True and "hang" not in seen["pieces"]
    part3 = json.loads((out / "part3_capture.json").read_text())["pieces"]
    assert part3["fine"]["rc"] == 0 and part3["fine"]["result"] == {"x": 1} and "tail" not in part3["fine"]
    out = capsys.readouterr().out
    assert ("crash: FAILED (rc 3)" in out and "hang: TIMED OUT" in out
            and "failed or cut: part 2 crash, part 2 hang" in out)


def test_without_graphslot_importable_it_stops_in_seconds_saying_why(tmp_path, monkeypatch, capsys):
    """The wheels missing (here: a pydantic that does not import) fail every piece: the
    preflight finds it, and no part starts."""
    blocked = tmp_path / "blocked" / "pydantic"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('no pydantic on this machine')\n")
    monkeypatch.setenv("PYTHONPATH", str(blocked.parent))
    monkeypatch.setattr(gpu_proof, "plan", lambda part, smoke, work: pytest.fail("a part started"))
    out = tmp_path / "out"
    assert gpu_proof.main(["--smoke", "--out", str(out), "--work", str(tmp_path / "work")]) == 2
    env = json.loads((out / "environment.json").read_text())
    assert len(env["problems"]) == 1 and env["problems"][0].startswith(
        "graphslot does not import or cannot build the decode registry (ImportError: no pydantic on this machine)")
    assert not list(out.glob("part*.json"))
    assert "gpu_proof: cannot run here, no part started" in capsys.readouterr().out


def test_pytest_output_is_read_with_its_skip_reasons():
    text = ("ss.F\n=== short test summary info ===\nSKIPPED [1] tests/test_dp.py:508: needs 2 CUDA GPUs\n"
            "SKIPPED [3] tests/test_a.py:9: needs a CUDA GPU\nFAILED tests/test_b.py::test_x - assert 0\n"
            "1 failed, 1 passed, 4 skipped, 70 deselected in 3.21s\n")
    got = proof_report.parse_pytest(text)
    assert (got["failed"], got["passed"], got["skipped"], got["deselected"]) == (1, 1, 4, 70)
    assert [s["reason"] for s in got["two_gpu_skips"]] == ["needs 2 CUDA GPUs"]
    assert got["failures"] == ["FAILED tests/test_b.py::test_x - assert 0"]


def test_bad_parts_are_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_proof.main(["--smoke", "--parts", "1,7"])
    assert "--parts takes part numbers among [1, 2, 3, 4], e.g. 1,3; got '1,7'" in capsys.readouterr().err


def test_the_fill_keeps_every_registry_measured_when_one_fails(tmp_path, monkeypatch):
    """On a GPU, sglang's own path runs its Triton kernel: that failing must not take the
    drop-in's figures (measured first) or the other sglang path with it."""
    import proof_fill
    import sglang_loader

    try:
        sgl = sglang_loader.load()
    except ImportError as exc:
        pytest.skip(f"sglang 0.5.23 not installed: {exc}")
    registry = sgl.registry.CudaGraphBufferRegistry
    real_fill = registry.fill_from

    def fill_from(self, fb, **counts):
        if sgl.registry.envs.SGLANG_OPT_CUDA_GRAPH_FILL_FAST_PATH.get():
            raise RuntimeError("triton: out of resources (test)")
        return real_fill(self, fb, **counts)

    monkeypatch.setattr(registry, "fill_from", fill_from)
    path = tmp_path / "fill.json"
    assert proof_fill.main(["--result", str(path), "--smoke"]) == 1
    result = json.loads(path.read_text())
    assert [(r["raw"], r["padded"]) for r in result["rows"]] == [(3, 4), (30, 32), (200, 256)]
    for r in result["rows"]:
        assert r["graphslot_us"] > 0 and r["sglang_us"] > 0 and r["sglang_same_buffers"] is True
        assert r["sglang_fast_path_us"] is None and r["vs_fast_path"] is None
    assert result["errors"] == {f"sglang_fast_path {raw}/{pad}": "RuntimeError: triton: out of resources (test)"
                                for raw, pad in ((3, 4), (30, 32), (200, 256))}
    assert result["targets"]["faster_than_fast_path_everywhere"] is None
    assert "n/a" in "\n".join(proof_report.fill_table(result))  # the table prints the missing ratio


@pytest.mark.parametrize("fails", [False, True])
def test_hf_cb_leaves_the_model_on_its_own_attention_even_when_it_fails(fails):
    """transformers 5.17's continuous batching switches the model to paged attention before
    its warm-up and restores it only past it: a failed hf_cb (5.17 on this CPU: a
    MemoryError) left the next engines on paged attention, and reduce-overhead's tokens
    differed from generate's at every later batch size."""
    import torch

    import proof_common
    import proof_serving

    model = proof_common.build_llama(True, torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7, 8]])
    want = model(input_ids=ids).logits

    def hf_cb():
        model.set_attn_implementation("paged|sdpa")
        if fails:
            raise MemoryError("Memory footprint 29927424 is more than available memory 0")
        model.set_attn_implementation("sdpa")
        return "tokens"

    if fails:
        with pytest.raises(MemoryError):
            proof_serving.keeping_attention(model, hf_cb)
    else:
        assert proof_serving.keeping_attention(model, hf_cb) == "tokens"
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(input_ids=ids).logits, want)


def test_a_summary_or_table_that_breaks_on_a_piece_s_figures_ends_no_run(tmp_path, monkeypatch, capsys):
    """proof_report reads the pieces' JSON: figures of a shape it did not expect (a KeyError
    there) ended the orchestrator, and every later part with it."""
    pieces = {2: [fake_piece("odd", "print('{\"rows\": [{}]}')")], 3: [fake_piece("fine", "print('{\"x\": 1}')")]}
    real_summarize = proof_report.summarize
    real_table = proof_report.table

    def summarize(part, records):
        if part == 2:
            raise KeyError("graphslot_us")
        return real_summarize(part, records)

    def table(result):
        if result["part"] == 2:
            raise KeyError("vs_fast_path")
        return real_table(result)

    monkeypatch.setattr(gpu_proof, "plan", lambda part, smoke, work: pieces[part])
    monkeypatch.setattr(gpu_proof, "preflight", lambda env, wheels, cuda: {"wheels": wheels, "problems": []})
    monkeypatch.setattr(proof_report, "summarize", summarize)
    monkeypatch.setattr(proof_report, "table", table)
    out = tmp_path / "out"
    assert gpu_proof.main(["--smoke", "--parts", "2,3", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    part2 = json.loads((out / "part2_fill.json").read_text())
    assert part2["summary"] == {"error": "summarize: KeyError: 'graphslot_us'"}
    assert part2["pieces"]["odd"]["result"] == {"rows": [{}]}
    assert json.loads((out / "part3_capture.json").read_text())["pieces"]["fine"]["result"] == {"x": 1}
    assert "== part 2: fill: no table (table: KeyError: 'vs_fast_path'); part2_fill.json holds the figures" in (
        capsys.readouterr().out)
