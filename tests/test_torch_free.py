"""The spec toolchain runs without torch (issue 11); the runtime is unchanged.

``graphslot validate/show/schema/generate`` and ``--help`` must never import torch (it
is most of their start-up time), and ``import graphslot; gs.build_registry(...)`` must
work as before. The commands run in fresh interpreters in which torch cannot be
imported: a meta-path finder refuses it and records every attempt.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

import graphslot as gs
from graphslot.spec.dtypes import (TORCH_MISSING, DTYPES, DTypeName, dtype_name, parse_dtype, torch_dtype,
                                   value_fits_dtype)

REPO = Path(__file__).resolve().parent.parent

# Installed at the front of sys.meta_path before graphslot is imported: importing torch
# (or any torch submodule) fails, and the attempt is recorded.
BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys
    ATTEMPTS = []

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                ATTEMPTS.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, BlockTorch())
""")

REPORT = textwrap.dedent("""
    import json
    print("@@REPORT@@" + json.dumps({
        "attempts": ATTEMPTS,
        "loaded": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        **RESULT,
    }))
""")

CLI_COMMAND_MODULES = ["validate", "show", "schema", "generate", "bench", "demo", "verify", "new_spec", "plan_sizes"]
TOOLCHAIN_MODULES = [
    "graphslot", "graphslot.env", "graphslot.cli", "graphslot.cli.app", "graphslot.cli.common",
    "graphslot.codegen.generator", "graphslot.codegen.emitter", "graphslot.cli.aot", "graphslot.cli.pyproject_edit",
    *(f"graphslot.cli.{name}" for name in CLI_COMMAND_MODULES),
    *sorted(f"graphslot.spec.{p.stem}"
            for p in (Path(__file__).resolve().parent.parent / "graphslot" / "spec").glob("*.py")
            if p.stem != "__init__"),
]

COMMANDS = [
    ["validate"],
    ["validate", "decode", "graphslot/slot_specs/prefill.yaml"],
    ["show", "decode"],
    ["show", "decode", "--param", "cache_loc_dtype=int32", "--param", "dp_size=2", "--max-bs", "8"],
    ["show", "decode", "--preset", "eager"],
    ["show", "prefill"],
    ["show", "decode", "--json"],
    ["validate", "--shipped"],
    ["schema"],
    ["generate", "--check"],
    ["--help"],
    ["show", "--help"],
    ["new-spec", "--help"],
    ["demo", "--help"],
    ["bench", "--help"],
]


def run_python(code: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Runs ``code`` on this checkout's graphslot, even where a test changes directory before importing it."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    this_checkout = {"PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **this_checkout, **(env or {})})


def report_of(proc: subprocess.CompletedProcess) -> Dict[str, Any]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@REPORT@@")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1].removeprefix("@@REPORT@@"))


def run_commands(commands: List[List[str]], block_torch: bool) -> Dict[str, Any]:
    """Each command's exit status and output, run in one fresh interpreter; with
    ``block_torch`` torch cannot be imported there, else it is imported first."""
    code = (BLOCK_TORCH if block_torch else "ATTEMPTS = []\nimport sys, torch\n") + textwrap.dedent(f"""
        import contextlib, io
        import graphslot.cli.app as cli
        RESULT = {{"runs": []}}
        for argv in {commands!r}:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(argv)
            RESULT["runs"].append([argv, code, out.getvalue(), err.getvalue()])
    """) + REPORT
    return report_of(run_python(code))


def test_toolchain_modules_import_without_torch():
    code = BLOCK_TORCH + "import importlib\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in TOOLCHAIN_MODULES) + "RESULT = {}\n" + REPORT
    report = report_of(run_python(code))
    assert report["attempts"] == [] and report["loaded"] == []


def test_toolchain_commands_run_without_torch_and_print_what_they_print_with_it():
    blocked = run_commands(COMMANDS, block_torch=True)
    assert blocked["attempts"] == [] and blocked["loaded"] == []
    for argv, code, out, err in blocked["runs"]:
        assert code == 0, (argv, out, err)
    with_torch = run_commands(COMMANDS, block_torch=False)
    assert "torch" in with_torch["loaded"]
    assert blocked["runs"] == with_torch["runs"]


def test_show_reports_dtype_params_and_bytes_without_torch():
    runs = run_commands([["show", "decode", "--param", "cache_loc_dtype=torch.int32", "--max-bs", "8",
                          "--max-num-tokens", "16"]], block_torch=True)["runs"]
    (_, code, out, err), = runs
    assert code == 0, err
    assert "params: cache_loc_dtype=int32" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("out_cache_loc "))
    assert row[2] == "int32" and row[-2] == str(16 * 4)  # [16] int32: 64 bytes, computed without torch


def test_the_runtime_without_torch_says_so_in_one_line():
    code = BLOCK_TORCH + textwrap.dedent("""
        import contextlib, io
        import graphslot, graphslot.cli.app as cli
        RESULT = {"runs": []}
        for argv in (["demo", "--steps", "1"], ["demo", "--workload", "prefill"], ["bench"]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                RESULT["runs"].append([cli.main(argv), err.getvalue().splitlines()[-1]])
        try:
            graphslot.build_registry("decode", device="cpu", max_bs=4, max_num_tokens=4)
        except ModuleNotFoundError as exc:
            RESULT["api"] = [exc.name, str(exc)]
    """) + REPORT
    report = report_of(run_python(code))
    for (code, last), command in zip(report["runs"], ("demo", "demo", "bench")):
        assert code == 1 and last == f"graphslot {command}: error: {TORCH_MISSING}"
    assert report["api"] == ["torch", TORCH_MISSING]


def test_new_spec_runs_without_torch(tmp_path):
    code = BLOCK_TORCH + textwrap.dedent(f"""
        import contextlib, io, os
        os.chdir({str(tmp_path)!r})
        import graphslot.cli.app as cli
        RESULT = {{"runs": []}}
        for argv in (["new-spec", "--from", "decode", "specs/decode.yaml"], ["validate"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                RESULT["runs"].append([cli.main(argv), out.getvalue()])
    """) + REPORT
    report = report_of(run_python(code))
    assert report["attempts"] == [] and report["loaded"] == []
    (created, out), (validated, checked) = report["runs"]
    assert created == 0 and "created  specs/decode.yaml" in out
    assert validated == 0 and "ok  specs/decode.yaml (15 slots)" in checked


def test_spec_errors_are_reported_without_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nslots:\n  - {name: x, shape: [max_bs], dtype: uint8, axis: bs, padding: fill_sentinel, "
                   "pad_value: 256}\n  - {name: y, shape: [max_bs], dtype: int46, axis: bs, padding: zero}\n")
    blocked = run_commands([["validate", str(bad)]], block_torch=True)
    with_torch = run_commands([["validate", str(bad)]], block_torch=False)
    assert blocked["attempts"] == [] and blocked["runs"] == with_torch["runs"]
    (_, code, out, _), = blocked["runs"]
    assert code == 1
    assert "pad_value 256 (int) does not fit dtype uint8" in out
    assert "unknown dtype 'int46'" in out and "did you mean 'int6'?" in out  # torch's own names, sub-byte ones too


def test_graphslot_validate_prints_what_it_printed_before():
    proc = subprocess.run([sys.executable, "-m", "graphslot.cli", "validate"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ("ok  graphslot/slot_specs/decode.yaml (15 slots)\n"
                           "ok  graphslot/slot_specs/prefill.yaml (11 slots)\n"
                           "ok  graphslot/slot_specs/vllm.yaml (8 slots; 3 hook imports not checked: "
                           "pass --import-hooks)\n")
    assert proc.stderr == ""


def test_import_graphslot_and_build_registry_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        import sys
        import graphslot
        RESULT = {"torch_after_import": "torch" in sys.modules}
        reg = graphslot.build_registry("decode", device="cpu", max_bs=4, max_num_tokens=4)
        import torch
        RESULT["registry"] = isinstance(reg, graphslot.SlotRegistry) and reg.impl == "generated"
        RESULT["buffer"] = str(reg.slot("out_cache_loc").buffer.dtype)
        RESULT["param"] = reg.params["cache_loc_dtype"] is torch.int64
        ATTEMPTS = []
    """) + REPORT
    report = report_of(run_python(code))
    assert report["torch_after_import"] is False
    assert report["registry"] and report["param"] and report["buffer"] == "torch.int64"


@pytest.mark.parametrize("value", [torch.int32, "int32", "torch.int32", "int"])
def test_dtype_params_accept_torch_dtypes_and_names(value):
    for mode in ("generated", "interpreted"):
        reg = gs.build_registry("decode", max_bs=4, max_num_tokens=4, params={"cache_loc_dtype": value}, impl=mode,
                                device="cpu")
        assert reg.params["cache_loc_dtype"] is torch.int32
        assert reg.slot("out_cache_loc").buffer.dtype is torch.int32
        assert reg.slot("out_cache_loc").resolved.dtype is torch.int32
    resolved = gs.resolve_params(gs.load_spec("decode"), {"cache_loc_dtype": value})
    assert resolved["cache_loc_dtype"] is torch.int32
    names = gs.resolve_params(gs.load_spec("decode"), {"cache_loc_dtype": value}, torch_dtypes=False)
    assert isinstance(names["cache_loc_dtype"], DTypeName) and names["cache_loc_dtype"] == "int32"


def test_public_names_are_all_there():
    for name in gs.__all__:
        assert getattr(gs, name) is not None, name
    assert set(gs.__all__) <= set(dir(gs))
    with pytest.raises(AttributeError):
        gs.no_such_name  # noqa: B018


# --- the torch-free dtype table is torch's -------------------------------------------------


def torch_dtypes() -> Dict[str, torch.dtype]:
    return {name: d for name, d in vars(torch).items() if isinstance(d, torch.dtype) and not name.startswith("_")}


def test_dtype_table_matches_torch():
    assert set(DTYPES) == set(torch_dtypes())
    for name, dtype in torch_dtypes().items():
        info = DTYPES[name]
        assert info.name == str(dtype).removeprefix("torch."), name
        assert info.itemsize == dtype.itemsize, name
        kind = ("bool" if dtype == torch.bool else "complex" if dtype.is_complex
                else "float" if dtype.is_floating_point else "int")
        assert info.kind == kind, name
        if kind == "int":
            try:
                iinfo = torch.iinfo(dtype)
                assert (info.min, info.max) == (iinfo.min, iinfo.max), name
            except TypeError:
                assert info.min is None and info.max is None, name
        if kind == "float":
            try:
                assert info.max == torch.finfo(dtype).max, name
            except (TypeError, NotImplementedError):
                assert info.max is None, name
        assert parse_dtype(dtype) == parse_dtype(name) == parse_dtype("torch." + name) == info.name
        assert dtype_name(dtype) == dtype_name(name) == info.name
        assert torch_dtype(name) is dtype and torch_dtype(parse_dtype(name)) is dtype


def _fits_with_torch(value: Any, dtype: torch.dtype) -> bool:
    """The check as it was written against torch (before issue 11)."""
    if dtype == torch.bool:
        return isinstance(value, bool) or (type(value) is int and value in (0, 1))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if dtype.is_complex:
        return True
    if dtype.is_floating_point:
        if isinstance(value, float) and not math.isfinite(value):
            return True
        try:
            return abs(float(value)) <= torch.finfo(dtype).max
        except OverflowError:
            return False
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return False
        value = int(value)
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        return isinstance(value, int) and -(2**63) <= value < 2**63
    return info.min <= value <= info.max


VALUES = [True, False, 0, 1, -1, 2, 127, 128, -129, 255, 256, 65504, 65505, 2**31 - 1, 2**31, -(2**31) - 1,
          2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**400, 0.0, 1.0, 1.5, -2.0, 448.0, 449.0, 57344.0, 1e38,
          3.5e38, 1e300, float("inf"), float("-inf"), float("nan"), "1", None, 1j]


def test_pad_value_fit_matches_the_torch_based_check():
    for name, dtype in torch_dtypes().items():
        if name == "float4_e2m1fn_x2":  # torch.finfo has no range for it: the old check raised
            assert not any(value_fits_dtype(v, name) for v in VALUES if isinstance(v, (int, float))
                           and not isinstance(v, bool) and not (isinstance(v, float) and not math.isfinite(v)))
            continue
        for value in VALUES:
            assert value_fits_dtype(value, name) == _fits_with_torch(value, dtype), (name, value)
            assert value_fits_dtype(value, dtype) == _fits_with_torch(value, dtype), (name, value)


# --- torch's NumPy warning is silenced where graphslot imports torch ------------------------


def test_numpy_warning_is_silenced_where_graphslot_imports_torch(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import warnings\n"
        "warnings.warn(\"Failed to initialize NumPy: No module named 'numpy'\", UserWarning)\n"
        "class Tensor: pass\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    strict = "import warnings\nwarnings.filterwarnings('error', message='Failed to initialize NumPy')\n"
    quiet = run_python(strict + textwrap.dedent("""
        from graphslot.spec.dtypes import import_torch
        before = list(warnings.filters)
        torch = import_torch()
        assert warnings.filters == before, "the filter must be restored"
        print("ok", torch.Tensor.__name__)
    """), env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.split() == ["ok", "Tensor"]
    # Imported by the engine itself, the warning is torch's own business (here: an error).
    loud = run_python(strict + "import torch\n", env)
    assert loud.returncode != 0 and "Failed to initialize NumPy" in loud.stderr


def test_import_graphslot_loads_neither_pydantic_nor_yaml_and_a_checked_in_module_no_generator():
    """``import graphslot`` is the version and the error types (the spec model loads when
    a spec is first read); building from a checked-in generated module renders nothing,
    so neither jinja2 nor graphslot's generator is imported (torch itself imports tqdm)."""
    code = textwrap.dedent("""
        import sys
        import graphslot
        RESULT = {"heavy_after_import": sorted({"pydantic", "yaml", "torch", "jinja2"} & set(sys.modules))}
        import torch
        before = set(sys.modules)
        import graphslot.generated.decode_default as module
        reg = graphslot.build_registry(module, device="cpu", max_bs=4, max_num_tokens=4)
        new = set(sys.modules) - before
        RESULT["new"] = sorted(n for n in new if n.split(".")[0] in ("jinja2", "tqdm")
                               or n in ("graphslot.codegen.generator", "graphslot.log"))
        RESULT["filled"] = reg.impl
        ATTEMPTS = []
    """) + REPORT
    report = report_of(run_python(code))
    assert report["heavy_after_import"] == []
    assert report["new"] == [] and report["filled"] == "generated"
