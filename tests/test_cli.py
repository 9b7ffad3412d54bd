"""The ``graphslot`` command line: exit statuses and what users read."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest

from graphslot.cli.app import COMMANDS
from graphslot.cli.common import human_bytes
from graphslot.spec.loading import SHIPPED_DIR, shipped_spec_names
from graphslot.spec.project import load_project_config

from conftest import cli

BAD_SPEC = textwrap.dedent("""\
    name: bad
    slots:
      - name: input_ids
        shape: [max_num_tokens]
        dtype: int64
        axis: tokens
        padding: foreach_copy
      - name: positions
        shape: [max_num_tokens]
        dtype: int64
        axis: tokens
        padding: keep_pad
        index: true
      - name: lora_ids
        shape: [max_bs]
        dtype: int32
        axis: batch
        padding: zero
    """)


run = cli  # graphslot ARGV in process: (status, stdout, stderr), never a traceback


def table_row(out: str, slot: str) -> list:
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == slot:
            return cells
    raise AssertionError(f"no row for {slot!r} in:\n{out}")


def test_subcommands_are_registered():
    assert {"validate", "show", "schema"} <= set(COMMANDS)


def test_no_command_is_a_usage_error(capsys):
    status, _, err = run(capsys)
    assert status == 2 and "usage: graphslot" in err


NOTHING_TO_VALIDATE = ("graphslot validate: error: nothing to validate ({}): pass spec files, list them under "
                       "[tool.graphslot] specs in pyproject.toml, or pass --shipped for the specs shipped with "
                       "graphslot\n")


def test_validate_without_a_project_says_what_to_do(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "validate") == (2, "", NOTHING_TO_VALIDATE.format("no pyproject.toml found"))
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert run(capsys, "validate") == (2, "", NOTHING_TO_VALIDATE.format(
        "pyproject.toml lists no [tool.graphslot] specs"))


def test_validate_shipped_specs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, _ = run(capsys, "validate", "--shipped")
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == len(shipped_spec_names())
    assert re.fullmatch(r"ok  .*decode\.yaml \(15 slots\)", lines[0])
    assert re.fullmatch(r"ok  .*prefill\.yaml \(11 slots\)", lines[1])


def test_validate_by_name(capsys):
    status, out, _ = run(capsys, "validate", "decode")
    assert status == 0 and out.startswith("ok  ") and "(15 slots)" in out


def test_validate_bad_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(BAD_SPEC)
    status, out, err = run(capsys, "validate", "bad.yaml", "decode")
    assert status == 1
    lines = out.splitlines()
    assert lines[:2] == [
        "bad.yaml:13: slot 'positions': index slots must use padding 'zero' (got 'keep_pad'): "
        "a stale or sentinel tail would index out of the pool",
        "bad.yaml:17: slot 'lora_ids': 'batch' is not a valid axis (one of: bs, tokens, none)",
    ]
    assert lines[2].startswith("ok  ") and lines[2].endswith("decode.yaml (15 slots)")
    assert "2 error(s) in 1 of 2 spec file(s)" in err


def test_validate_yaml_syntax_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.yaml").write_text("name: x\nslots: [\n")
    status, out, _ = run(capsys, "validate", "broken.yaml")
    assert status == 1 and out.startswith("broken.yaml:")


def test_validate_missing_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, _ = run(capsys, "validate", "nope.yaml")
    assert status == 1
    assert out.splitlines() == ["nope.yaml: no such spec file; shipped specs are: decode, prefill, vllm"]


@pytest.mark.parametrize("command", ["validate", "show"])
def test_a_path_that_is_a_directory_is_named_so(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    status, out, err = run(capsys, command, "specs")
    assert status == 1
    assert "specs: is a directory: pass the path of a .yaml spec file (or a spec's name)" in out + err


def test_validate_project_specs(capsys, tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "mine.yaml").write_text((SHIPPED_DIR / "prefill.yaml").read_text())
    (tmp_path / "specs" / "bad.yaml").write_text(BAD_SPEC)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.graphslot]\nspecs = ["specs/mine.yaml", "specs/bad.yaml", "specs/gone.yaml"]\n')
    monkeypatch.chdir(tmp_path)
    status, out, _ = run(capsys, "validate")
    assert status == 1
    assert "ok  specs/mine.yaml (11 slots)" in out.splitlines()
    assert "specs/bad.yaml:17: slot 'lora_ids': 'batch' is not a valid axis (one of: bs, tokens, none)" in out
    assert ("specs/gone.yaml: no such spec file (listed in pyproject.toml [tool.graphslot] specs)"
            in out.splitlines())
    assert sum(line.startswith("ok  ") for line in out.splitlines()) == 1  # the shipped specs: only when asked
    status, out, _ = run(capsys, "validate", "--shipped")
    assert status == 1
    oks = [line for line in out.splitlines() if line.startswith("ok  ")]
    assert len(oks) == 4 and oks[0].endswith("decode.yaml (15 slots)") and oks[1].endswith("prefill.yaml (11 slots)")
    status, out, _ = run(capsys, "validate", "--shipped", "specs/mine.yaml")
    assert status == 0 and len(out.splitlines()) == 4 and out.splitlines()[-1] == "ok  specs/mine.yaml (11 slots)"


def test_validate_in_graphslots_own_repository_lists_the_shipped_specs(capsys, monkeypatch):
    monkeypatch.chdir(SHIPPED_DIR.parent.parent)  # its pyproject.toml lists them under [tool.graphslot] specs
    assert run(capsys, "validate") == (0, "ok  graphslot/slot_specs/decode.yaml (15 slots)\n"
                                          "ok  graphslot/slot_specs/prefill.yaml (11 slots)\n"
                                          "ok  graphslot/slot_specs/vllm.yaml (8 slots; 3 hook imports not checked: "
                                          "pass --import-hooks)\n", "")


def test_validate_project_specs_from_subdirectory(capsys, tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text((SHIPPED_DIR / "decode.yaml").read_text())
    (tmp_path / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["mine.yaml"]\n')
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    status, out, _ = run(capsys, "validate")
    assert status == 0 and out.splitlines()[-1].endswith("mine.yaml (15 slots)")


def test_validate_malformed_pyproject(capsys, tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.graphslot]\nspecs = "mine.yaml"\n')
    monkeypatch.chdir(tmp_path)
    status, _, err = run(capsys, "validate")
    assert status == 1 and "[tool.graphslot] specs must be a list" in err


def test_project_config(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["a.yaml"]\noutput_dir = "gen"\n')
    config = load_project_config(tmp_path)
    assert config.root == tmp_path.resolve()
    assert config.specs == [tmp_path.resolve() / "a.yaml"]
    assert config.raw == {"specs": ["a.yaml"], "output_dir": "gen"}
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert load_project_config(tmp_path).specs == [] and load_project_config(tmp_path).raw == {}


def test_show_decode_defaults(capsys):
    status, out, _ = run(capsys, "show", "decode")
    assert status == 0
    assert table_row(out, "slot") == ["slot", "shape", "dtype", "axis", "padding", "device", "bytes", "enabled"]
    assert table_row(out, "input_ids") == ["input_ids", "[256]", "int64", "tokens", "foreach_copy", "cpu",
                                           "2048", "yes"]
    assert table_row(out, "seq_lens")[4] == "fill_sentinel (1)"
    assert table_row(out, "seq_lens_cpu")[5] == "cpu (host)"
    assert table_row(out, "mrope_positions")[1:4] == ["[3, 256]", "int64", "tokens (dim 1)"]
    assert table_row(out, "encoder_lens")[1:] == ["[256]", "int32", "bs", "fill_once (0)", "cpu", "-", "no"]
    assert table_row(out, "global_num_tokens_gpu")[1] == "[1]"
    # 6 slots of 256 int64 + mrope [3, 256] int64 + two [1] int32
    total = 6 * 2048 + 3 * 2048 + 2 * 4
    assert f"total: {total} bytes (18.0 KiB) in 9 of 15 slots enabled" in out


def test_show_with_params(capsys):
    status, out, _ = run(capsys, "show", "decode", "--param", "dp_size=4", "--param", "require_mlp_tp_gather=true",
                         "--param", "cache_loc_dtype=int32", "--max-bs", "8", "--max-num-tokens", "16")
    assert status == 0
    assert table_row(out, "global_num_tokens_gpu")[1:3] == ["[4]", "int32"]
    assert table_row(out, "out_cache_loc")[1:3] == ["[16]", "int32"]
    assert table_row(out, "req_pool_indices")[1] == "[8]"
    assert "params: cache_loc_dtype=int32, require_mlp_tp_gather=true, dp_size=4" in out


def test_show_preset_and_enabled_slots(capsys):
    status, out, _ = run(capsys, "show", "decode", "--preset", "eager", "--param", "is_encoder_decoder=true")
    assert status == 0
    assert table_row(out, "seq_lens")[4] == "fill_sentinel (0)"
    assert table_row(out, "global_num_tokens_gpu")[-2:] == ["-", "no"]
    assert table_row(out, "encoder_lens")[-2:] == ["1024", "yes"]


@pytest.mark.parametrize("argv, status, message", [
    (["--param", "dp_size=many"], 1, "param 'dp_size' is int, got str 'many'"),
    (["--param", "dp_sise=4"], 1, "unknown param 'dp_sise'; did you mean 'dp_size'?"),
    (["--preset", "eagr"], 1, "unknown preset 'eagr'"),
    (["--param", "dp_size"], 2, "expected NAME=VALUE, got 'dp_size'"),
    (["--param", "dp_size=[1, 2]"], 2, "must be a scalar"),
    (["--max-bs", "0"], 2, "expected a positive integer"),
])
def test_show_errors(capsys, argv, status, message):
    got, out, err = run(capsys, "show", "decode", *argv)
    assert got == status and message in err and out == ""


def test_show_missing_spec(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = run(capsys, "show", "nope.yaml")
    assert status == 1 and "nope.yaml: no such spec file" in err


def test_show_spec_with_engine_hooks(capsys, tmp_path, monkeypatch):
    # Hooks an engine passes to build_registry(hooks=) do not stop `show`.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(textwrap.dedent("""\
        name: s
        slots:
          - name: lora_ids
            shape: [max_bs]
            dtype: int32
            axis: bs
            padding: zero
            post_fill: my_lora_hook
        """))
    status, out, _ = run(capsys, "show", "s.yaml", "--max-bs", "4")
    assert status == 0 and table_row(out, "lora_ids")[1:] == ["[4]", "int32", "bs", "zero", "cpu", "16", "yes"]


def test_schema_command(capsys, tmp_path):
    status, out, _ = run(capsys, "schema")
    assert status == 0 and '"title": "graphslot slot spec"' in out
    target = tmp_path / "schema.json"
    assert run(capsys, "schema", "--output", str(target))[0] == 0
    assert target.read_text(encoding="utf-8") == out


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (12800, "12.5 KiB"), (3 << 20, "3.0 MiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


# --- show --json ---------------------------------------------------------------------


def test_show_json_holds_what_the_table_shows(capsys):
    argv = ["show", "decode", "--preset", "eager", "--param", "dp_size=2", "--max-bs", "8"]
    _, table, _ = run(capsys, *argv)
    status, out, err = run(capsys, *argv, "--json")
    assert status == 0 and err == ""
    shown = json.loads(out)  # stdout is the JSON object and nothing else
    assert {k: shown[k] for k in ("spec", "source", "max_bs", "max_num_tokens", "preset", "changed_params")} == {
        "spec": "decode", "source": "graphslot/slot_specs/decode.yaml", "max_bs": 8, "max_num_tokens": 256,
        "preset": "eager", "changed_params": {"seq_len_fill_value": 0, "register_global_num_tokens": False,
                                              "dp_size": 2}}
    assert "params: seq_len_fill_value=0, dp_size=2, register_global_num_tokens=false" in table
    assert shown["params"]["cache_loc_dtype"] == "int64" and shown["params"]["dp_size"] == 2
    for slot in shown["slots"]:
        padding = (slot["padding"] or "-") + (f" ({slot['pad_value']})" if slot["pad_value"] is not None else "")
        assert slot["reset_to"] == "padded" and not slot["staged"]  # decode: neither changes the cells
        axis = slot["axis"] + (f" (dim {slot['slice_dim']})" if slot["slice_dim"] else "")
        assert table_row(table, slot["name"]) == [
            slot["name"], str(slot["shape"]), slot["dtype"], axis, padding,
            "cpu (host)" if slot["host"] else slot["device"],
            "-" if slot["bytes"] is None else str(slot["bytes"]), "yes" if slot["enabled"] else "no"]
    assert len(shown["slots"]) == 15
    assert (f"total: {shown['total_bytes']} bytes ({human_bytes(shown['total_bytes'])}) in "
            f"{shown['enabled_slots']} of 15 slots enabled" in table)


@pytest.mark.parametrize("preset, reset", [(None, "capacity"), ("cpu", "padded")])
def test_show_states_the_keys_of_every_engine(capsys, preset, reset):
    """extra_rows, reset_to (a str param's value), staged and index: in the JSON, and the two that change what a
    row means (to capacity, staged) in the table."""
    argv = ["show", "vllm", "--max-bs", "4", "--max-num-tokens", "8"] + (["--preset", preset] if preset else [])
    status, table, _ = run(capsys, *argv)
    assert status == 0
    shown = {slot["name"]: slot for slot in json.loads(run(capsys, *argv, "--json")[1])["slots"]}
    keys = ("extra_rows", "reset_to", "staged", "index")
    assert {k: shown["query_start_loc"][k] for k in keys} == {
        "extra_rows": 1, "reset_to": "capacity", "staged": True, "index": False}
    assert {k: shown["slot_mapping"][k] for k in keys} == {
        "extra_rows": 0, "reset_to": reset, "staged": True, "index": "skip"}
    assert shown["query_start_loc"]["shape"] == [5]
    assert table_row(table, "query_start_loc")[4:6] == ["repeat_last (to capacity)", "cpu (staged)"]
    suffix = ", to capacity" if reset == "capacity" else ""
    assert table_row(table, "slot_mapping")[4:6] == [f"fill_sentinel (-1{suffix})", "cpu (staged)"]


def test_show_json_keeps_notes_off_stdout(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(textwrap.dedent("""\
        name: s
        slots:
          - name: lora_ids
            shape: [max_bs]
            dtype: int32
            axis: bs
            padding: fill_once
            pad_value: -1
            post_fill: my_hooks:fill_lora
        """))
    status, out, err = run(capsys, "show", "s.yaml", "--max-bs", "4", "--json")
    assert status == 0 and err == "note: 1 hook import not checked: pass --import-hooks\n"
    assert json.loads(out) == {
        "spec": "s", "source": "s.yaml", "max_bs": 4, "max_num_tokens": 256, "preset": None, "params": {},
        "changed_params": {},
        "slots": [{"name": "lora_ids", "shape": [4], "dtype": "int32", "axis": "bs", "slice_dim": 0,
                   "padding": "fill_once", "pad_value": -1, "device": "cpu", "host": False, "staged": False,
                   "extra_rows": 0, "reset_to": "padded", "index": False, "bytes": 16, "enabled": True}],
        "total_bytes": 16, "enabled_slots": 1, "unchecked_hook_imports": 1}
    status, out, err = run(capsys, "show", "nope.yaml", "--json")
    assert (status, out) == (1, "")
    assert err == "nope.yaml: no such spec file; shipped specs are: decode, prefill, vllm\n"


# --- bench ---------------------------------------------------------------------------

BENCH_HEADER = ("graphslot bench: fill_from + extract of the shipped decode spec (graphslot/slot_specs/decode.yaml), "
                "generated vs interpreted vs hand-written, 1 repeats x 3 iters per batch size")


def test_bench_json_is_pure_and_progress_goes_to_stderr(capsys):
    import platform

    import torch

    status, out, err = run(capsys, "bench", "--json", "--iters", "3", "--repeats", "1")
    result = json.loads(out)
    assert status == (1 if result["gating_missed"] else 0)  # op counts gate; timings do not
    assert all(r["check_us"] >= 0 for r in result["rows"])
    assert {k: result[k] for k in ("device", "torch", "python", "platform", "max_bs", "iters", "repeats")} == {
        "device": "cpu", "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "max_bs": 256, "iters": 3, "repeats": 1}
    assert [(r["raw"], r["padded"]) for r in result["rows"]] == [(3, 4), (30, 32), (200, 256)]
    assert err.splitlines()[:4] == [BENCH_HEADER,  # no terminal: a line per size instead of a bar
                                    "graphslot bench: raw/padded 3/4 timed (1 of 3)",
                                    "graphslot bench: raw/padded 30/32 timed (2 of 3)",
                                    "graphslot bench: raw/padded 200/256 timed (3 of 3)"]
    assert len(err.splitlines()) == 4 + len(result["missed"])  # then one line per missed target


def fake_timings(generated, unchecked, interpreted, hand_written):
    def time_per_call(runners, fb, raw, padded, iters, repeats, tick):
        tick()
        return {"generated": generated, "unchecked": unchecked, "interpreted": interpreted,
                "hand_written": hand_written}
    return time_per_call


def test_bench_reports_a_missed_timing_target_with_its_margin_and_exits_0(capsys, monkeypatch):
    from graphslot.cli import fill_bench

    # the machine is loaded: the unchecked module timed slower than the checked one
    monkeypatch.setattr(fill_bench, "time_per_call", fake_timings(10.0, 12.67, 40.0, 30.0))
    status, out, err = run(capsys, "bench", "--json", "--iters", "3", "--repeats", "1")
    result = json.loads(out)
    assert status == 0 and not result["targets_met"] and not result["gating_missed"]
    assert [(r["check_us"], r["unchecked_us"]) for r in result["rows"]] == [(0.0, 12.67)] * 3  # never negative
    assert err.splitlines()[4:] == [
        f"graphslot bench: note: raw/padded {size}: generated is 4.00x the interpreter, target >= 5.0x, short by "
        "1.00x (a timing: reported, not gated)" for size in ("3/4", "30/32", "200/256")]
    status, out, _ = run(capsys, "bench", "--iters", "3", "--repeats", "1")
    assert "  -" not in out and out.splitlines()[2].endswith("  0.00µs")
    assert out.splitlines()[-4:] == ["targets: generated >= 5.0x the interpreter at every size, <= 2 mutating ops "
                                     "per padded fill, <= 1 on the device: missed:"] + [
        f"  raw/padded {size}: generated is 4.00x the interpreter, target >= 5.0x, short by 1.00x (a timing: "
        "reported, not gated)" for size in ("3/4", "30/32", "200/256")]


def test_bench_names_a_missed_op_count_target_and_exits_1(capsys, monkeypatch):
    from graphslot.cli import fill_bench

    monkeypatch.setattr(fill_bench, "time_per_call", fake_timings(10.0, 9.0, 80.0, 30.0))
    monkeypatch.setattr(fill_bench, "count_mutating_ops", lambda fill, fb, raw, padded: ["copy_"] * 3)
    status, out, err = run(capsys, "bench", "--json", "--iters", "3", "--repeats", "1")
    result = json.loads(out)
    assert status == 1 and result["gating_missed"]
    assert err.splitlines()[4:] == [f"graphslot bench: missed: raw/padded {size}: 3 mutating ops per padded fill, "
                                    "target <= 2, 1 over" for size in ("3/4", "30/32", "200/256")]


def test_bench_measures_the_shipped_decode_spec_and_names_its_file_whatever_the_project(capsys, monkeypatch, tmp_path):
    """A project's own decode spec (here one with a slot the bench's batches do not
    carry) is what `graphslot.load_spec("decode")` gives there; the bench, whose
    hand-written baseline and op targets are the shipped spec's, measures the shipped one
    and says which file that is."""
    from graphslot.cli import fill_bench
    from graphslot.spec.files import display_path
    from graphslot.spec.loading import load_spec, shipped_spec_path

    (tmp_path / "specs").mkdir()
    text = shipped_spec_path("decode").read_text(encoding="utf-8")
    own = text + "  - name: adapter_ids\n    shape: [max_bs]\n    dtype: int64\n    axis: bs\n    padding: zero\n"
    (tmp_path / "specs" / "decode.yaml").write_text(own, encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/decode.yaml"]\n')
    monkeypatch.chdir(tmp_path)
    assert load_spec("decode").path == "specs/decode.yaml"
    monkeypatch.setattr(fill_bench, "time_per_call", fake_timings(10.0, 9.0, 80.0, 30.0))
    shipped = display_path(shipped_spec_path("decode"))
    status, out, err = run(capsys, "bench", "--json", "--iters", "3", "--repeats", "1")
    result = json.loads(out)
    assert (status, result["spec"], result["gating_missed"]) == (0, shipped, False)
    assert {r["generated_ops"] for r in result["rows"]} == {2}
    assert err.splitlines()[0] == BENCH_HEADER.replace("graphslot/slot_specs/decode.yaml", shipped)
    status, out, _ = run(capsys, "bench", "--iters", "3", "--repeats", "1")
    assert out.startswith(f"fill_from + extract, shipped decode spec ({shipped}), max_bs 256, device cpu")

def test_bench_shows_a_bar_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    _, out, err = run(capsys, "bench", "--iters", "3", "--repeats", "1")
    assert out.startswith("fill_from + extract, shipped decode spec (graphslot/slot_specs/decode.yaml), max_bs 256, "
                          "device cpu")
    assert err.startswith(BENCH_HEADER + "\n") and "Timing:" in err and "timed (" not in err
