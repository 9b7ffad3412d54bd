"""An engine adopting graphslot from docs/engine.md alone, in a project of its own.

The page's engine module (its own spec with a field of its own, batch dataclass, torch
model and DecodeAdapter subclass, a runner on the tape backend) is written, as the page
shows it, to ``myengine/engine.py`` of a scratch project; ``graphslot verify`` runs on it
in a subprocess, as the engine's CI would: no weight is declared by hand, yet none is a
stale input. An adapter missing hooks is told all of them at once, and the shipped
reference model refuses a spec with a field it cannot know, pointing to the target route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphslot.spec.loading import spec_path
from test_docs import file_blocks

ROOT = Path(__file__).resolve().parent.parent

BROKEN = '''\
from graphslot.runners import DecodeAdapter, DecodeGraphRunner
from myengine.engine import SPEC, TinyLM, make_step


class Unfinished(DecodeAdapter):
    def __init__(self, model):
        self.model = model

    def forward(self, b):
        return self.model(b.input_ids, b.positions, b.lora_ids)


def make_target():
    runner = DecodeGraphRunner(Unfinished(TinyLM()), spec=SPEC, max_bs=4, progress=False)
    return runner, lambda n: make_step([1] * n, [0] * n, [0] * n)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scratch_engine")
    package = root / "myengine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for path, code in file_blocks().items():
        (root / path).write_text(code)
    (package / "broken.py").write_text(BROKEN)
    return root


def graphslot(project: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "graphslot.cli", *argv], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)


def test_verify_passes_on_the_engine_of_the_docs_with_no_weight_declared(project):
    assert "static_tensors" not in (project / "myengine" / "engine.py").read_text()
    done = graphslot(project, "verify", "myengine.engine:make_target")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ("graphslot verify: myengine.engine:make_target: capturing, auditing inputs, replaying "
                           "poisoned tails\n")
    lines = done.stdout.splitlines()
    assert [line.split()[:3] for line in lines[1:4]] == [
        ["input_ids", "foreach_copy", "safe"], ["positions", "zero", "safe"], ["lora_ids", "zero", "safe"]]
    assert "external inputs" not in done.stdout and lines[-1] == "verdict: safe"


def test_verify_json_of_the_engine_lists_no_stale_input(project):
    done = graphslot(project, "verify", "myengine.engine:make_target", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["safe"] and report["external_inputs"] == []
    assert report["target"] == "myengine" and report["cases"] == [{"raw_bs": 3, "padded_bs": 4}]


def test_an_adapter_missing_hooks_names_them_all_at_once(project):
    done = graphslot(project, "verify", "myengine.broken:make_target")
    assert done.returncode == 2 and done.stdout == ""
    [_, error] = done.stderr.splitlines()
    assert error == (  # where: the engine's line that built the runner, not graphslot's raise
        "graphslot verify: error: target 'myengine.broken:make_target': calling it raised (myengine/broken.py:14: "
        "AdapterContractError: Unfinished (a DecodeAdapter) does not implement 4 required hooks: forward_eager, "
        "make_dummy_batch, init_capture_metadata, init_replay_metadata; see DecodeAdapter's docstring, or "
        "docs/engine.md)")


def test_the_reference_model_refuses_a_spec_with_a_field_of_the_engine_and_points_to_the_target(project):
    text = spec_path("decode").read_text() + ("  - {name: lora_ids, shape: [max_bs], dtype: int32, axis: bs, "
                                              "padding: zero, index: true}\n")
    (project / "decode.yaml").write_text(text)
    done = graphslot(project, "verify", "--spec", "decode.yaml")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[1] == (
        "graphslot verify: error: the reference model: spec 'decode' (decode.yaml) copies 'lora_ids', which the "
        "reference model's batches do not have and its model does not read; verify the spec on your own runner, "
        "whose batches set it: `graphslot verify yourpackage.module:make_target` (docs/engine.md, \"Checking your "
        "runner\")")
