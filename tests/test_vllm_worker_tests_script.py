"""benchmarks/vllm_worker_tests.py's own parts, without vLLM: what it extracts from the sdist, how it reads pytest's
results and compares the two runs, and its refusals (a wrong archive, a cache inside the repository). .ci/vllm runs
the script itself, against vLLM 0.32.0's tests."""

from __future__ import annotations

import io
import tarfile

import pytest

from test_bench_hf_decode import load_script

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.v1.worker.test_gpu_input_batch" name="test_a[1]"/>
<testcase classname="tests.v1.worker.test_gpu_input_batch" name="test_b"><skipped message="why"/></testcase>
<testcase classname="tests.v1.worker.test_gpu_model_runner.TestX" name="test_c"><failure message="no"/></testcase>
<testcase classname="tests.v1.worker.test_gpu_model_runner" name="test_d"><error message="fixture"/></testcase>
</testsuite></testsuites>"""


@pytest.fixture(scope="module")
def script():
    return load_script("vllm_worker_tests")


def test_only_the_tests_pyproject_and_version_file_are_extracted(script):
    top = "vllm-0.32.0/"
    assert script.wanted_member(top + "tests/v1/worker/test_gpu_model_runner.py") == \
        "tests/v1/worker/test_gpu_model_runner.py"
    assert script.wanted_member(top + "pyproject.toml") == "pyproject.toml"
    assert script.wanted_member(top + "vllm/_version.py") == "vllm/_version.py"
    for name in (top + "vllm/__init__.py", top + "setup.py", top + "tests/../vllm/x.py", "other/tests/x.py",
                 top + "/etc/passwd"):
        assert script.wanted_member(name) is None, name


def test_the_extraction_leaves_no_vllm_package_to_shadow_the_installed_one(script, tmp_path):
    archive = tmp_path / "vllm.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in (("tests/conftest.py", "x = 1\n"), ("vllm/_version.py", "commit_id = 'g5df63a720'\n"),
                           ("vllm/__init__.py", ""), ("pyproject.toml", "")):
            data = text.encode()
            member = tarfile.TarInfo(f"vllm-0.32.0/{name}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    dest = script.extract(archive, tmp_path / "src")
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        ".extracted", "pyproject.toml", "tests/conftest.py", "vllm_version.py"]
    assert script.vllm_commit(dest) == "5df63a720"


def test_junit_results_are_read_per_test_and_per_file(script, tmp_path):
    junit = tmp_path / "run.xml"
    junit.write_text(JUNIT)
    tests = script.outcomes(junit)
    assert tests == {"tests.v1.worker.test_gpu_input_batch::test_a[1]": "passed",
                     "tests.v1.worker.test_gpu_input_batch::test_b": "skipped",
                     "tests.v1.worker.test_gpu_model_runner.TestX::test_c": "failed",
                     "tests.v1.worker.test_gpu_model_runner::test_d": "error"}
    assert script.per_file(tests, "tests/v1/worker/test_gpu_model_runner.py") == dict(
        passed=0, failed=1, error=1, skipped=0)
    assert script.per_file(tests, "tests/v1/worker/test_gpu_input_batch.py") == dict(
        passed=1, failed=0, error=0, skipped=1)


def test_the_report_names_each_test_whose_outcome_differs(script):
    def run(tests):
        counts = {o: list(tests.values()).count(o) for o in script.OUTCOMES}
        return {"tests": tests, "counts": counts, "seconds": 1.0, "exit_status": 0, "log": "x.log"}

    same = "tests.v1.worker.test_gpu_input_batch::test_a"
    other = "tests.v1.worker.test_gpu_model_runner_prefill_tail_classification::test_b"
    lines = script.report({"stock": run({same: "passed", other: "passed"}),
                           "graphslot": run({same: "passed", other: "failed"})})
    assert [line for line in lines if line.startswith("differs")] == [f"differs: {other}: stock passed, graphslot "
                                                                      "failed"]
    assert "| total | 2 | 0 | 0 | 0 | 1 | 1 | 0 | 0 |" in lines


def test_a_wrong_archive_and_a_cache_inside_the_repository_are_refused(script, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(script, "check_environment", lambda: None)
    wrong = tmp_path / "vllm-0.32.0.tar.gz"
    wrong.write_bytes(b"not vllm")
    assert script.main(["--sdist", str(wrong), "--cache-dir", str(tmp_path / "cache")]) == 1
    assert f"--sdist {wrong}: sha256 " in capsys.readouterr().err
    assert script.main(["--cache-dir", str(script.REPO / "build" / "vllm")]) == 1
    assert "inside this repository" in capsys.readouterr().err


def test_an_environment_without_what_vllms_tests_import_is_named(script, tmp_path, capsys, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "tblib" else object())
    assert script.main(["--cache-dir", str(tmp_path / "cache")]) == 1
    assert capsys.readouterr().err.startswith(f"vllm_worker_tests: {script.sys.executable} has no tblib: pip "
                                              "install tblib")
    assert not (tmp_path / "cache").exists()
