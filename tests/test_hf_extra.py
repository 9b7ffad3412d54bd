"""The transformers integration is an extra: nothing else imports it, and without it (or
with a release too old) importing it is one line naming the extra."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import graphslot.integrations

MODULE = "graphslot.integrations.transformers"


def forget_integration(monkeypatch):
    """Make the next import of the integration run its module code again."""
    for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(graphslot.integrations, "transformers", raising=False)


def test_without_transformers_the_error_names_the_extra(monkeypatch):
    forget_integration(monkeypatch)
    monkeypatch.setitem(sys.modules, "transformers", None)  # what a missing package looks like to import
    with pytest.raises(ImportError) as info:
        importlib.import_module(MODULE)
    assert str(info.value) == f"{MODULE} needs transformers>=5.4.0: pip install 'graphslot[hf]'"

    from graphslot.cli.demo_hf import run_hf_demo

    with pytest.raises(ImportError, match=r"pip install 'graphslot\[hf\]'"):
        run_hf_demo("hf-llama", steps=1, backend="cpu", progress=False)


def test_a_release_too_old_is_refused(monkeypatch):
    transformers = pytest.importorskip("transformers")
    forget_integration(monkeypatch)
    monkeypatch.setattr(transformers, "__version__", "5.3.0")
    with pytest.raises(ImportError) as info:
        importlib.import_module(MODULE)
    assert str(info.value) == (f"{MODULE} needs transformers>=5.4.0, found 5.3.0: "
                               "pip install -U 'graphslot[hf]'")


def test_unknown_demo_models_are_named():
    from graphslot.cli.demo_hf import run_hf_demo

    with pytest.raises(ValueError, match=r"unknown demo model 'hf-gpt_neo'; choose one of: hf-llama, hf-mistral, "
                                         r"hf-qwen2, hf-qwen3"):
        run_hf_demo("hf-gpt_neo")


def test_graphslot_and_its_runners_do_not_import_transformers():
    code = ("import sys, graphslot, graphslot.runners.decode, graphslot.cli.app, graphslot.cli.demo_hf, "
            "graphslot.integrations; print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' "
            "or m.startswith('graphslot.integrations.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
