"""``install()`` / ``uninstall()`` against sglang 0.5.23's installed sources, and the
plugin entry point through sglang's own plugin loader.

sglang's runner modules do not import on a CPU machine without sglang's dependencies
(kernels, triton, PIL, zmq, ...). So the tests read the runners' real source files from
the installed wheel and build each runner module from exactly its own import
statements of registry names, executed under the runner's module name: the module's
globals then hold what the real runner binds, which is where the runner's code looks
them up when it builds a registry. Every module of the wheel that imports from the
registry is found by parsing the wheel, so a runner that starts importing a registry
name fails the table test.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
import types
from pathlib import Path
from typing import Dict, List, Set

import pytest
import torch

import sglang_loader

try:
    SGL = sglang_loader.load()
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang's buffer registry cannot be imported: {exc}", allow_module_level=True)

import graphslot.integrations.sglang as dropin
from graphslot.integrations.sglang import patching as install_mod

REGISTRY = install_mod.REGISTRY_MODULE
PACKAGE_ROOT = Path(SGL.registry.__file__).resolve().parents[3]  # .../site-packages
ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
#: Modules that import registry names and need no patching, and why.
NOT_PATCHED = {
    # binds CudaGraphBufferRegistry for an annotation and sglang's same_tensor_view
    "sglang.srt.model_executor.runner.early_verify_metadata": {"CudaGraphBufferRegistry", "same_tensor_view"},
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE_ROOT).with_suffix("").parts)


def registry_imports(path: Path) -> List[ast.ImportFrom]:
    """The module's ``from <registry module> import ...`` statements (absolute or relative)."""
    name = module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: -node.level]
                base = ".".join(parent + ([base] if base else []))
            if base == REGISTRY:
                found.append(node)
        elif isinstance(node, ast.Import):
            assert all(alias.name != REGISTRY for alias in node.names), f"{name} imports the registry module whole"
    return found


def importers() -> Dict[str, Set[str]]:
    """Every module of the installed sglang that imports registry names, and the names."""
    out: Dict[str, Set[str]] = {}
    for path in (PACKAGE_ROOT / "sglang").rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "cuda_graph_buffer_registry" not in text or module_name(path) == REGISTRY:
            continue
        names = {alias.asname or alias.name for node in registry_imports(path) for alias in node.names}
        if names:
            out[module_name(path)] = names
    return out


def annotation_only(module: str, name: str) -> bool:
    """Whether ``name`` is used in ``module`` only inside annotations (and its import)."""
    tree = ast.parse((PACKAGE_ROOT / Path(*module.split("."))).with_suffix(".py").read_text(encoding="utf-8"))
    in_annotations = set()
    for node in ast.walk(tree):
        for ann in ([node.annotation] if isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation else []) + (
                [node.returns] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns else []):
            in_annotations |= {id(n) for n in ast.walk(ann)}
    return all(id(n) in in_annotations for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name)


def test_patch_table_covers_every_module_that_binds_registry_names():
    found = importers()
    tests_ = {m for m in found if ".test." in f".{m}." or m.split(".")[-1].startswith("test_")}
    runners = {m: names for m, names in found.items() if m not in tests_ and m not in NOT_PATCHED}
    table = {module: set(names) for module, names in dropin.PATCH_TABLE[1:]}
    assert runners == table
    for module, names in NOT_PATCHED.items():
        assert found[module] == names
        assert annotation_only(module, "CudaGraphBufferRegistry")
    assert set(dropin.PATCH_TABLE[0][1]) >= set().union(*table.values())
    # what sglang's own registry module defines, the drop-in replaces (same_tensor_view kept)
    assert set(dropin.PATCH_TABLE[0][1]) | {"same_tensor_view"} >= {
        n for n in vars(SGL.registry) if not n.startswith("_") and (
            isinstance(getattr(SGL.registry, n), type) or n.startswith("build_"))
        and getattr(getattr(SGL.registry, n), "__module__", "") == REGISTRY}


@pytest.fixture
def runners(monkeypatch):
    """``load(name)``: the runner module ``name`` as its real import statements bind it,
    registered in sys.modules (removed after the test); sglang's originals restored."""
    registry = sys.modules[REGISTRY]
    originals = {n: getattr(registry, n) for n in dropin.PATCH_TABLE[0][1]}
    for module, _ in dropin.PATCH_TABLE[1:]:
        monkeypatch.delitem(sys.modules, module, raising=False)

    def load(name: str) -> types.ModuleType:
        path = (PACKAGE_ROOT / Path(*name.split("."))).with_suffix(".py")
        module = types.ModuleType(name)
        module.__package__ = name.rpartition(".")[0]
        for node in registry_imports(path):
            exec(compile(ast.fix_missing_locations(ast.Module([node], [])), str(path), "exec"), module.__dict__)
        # the runner's call site: the factory looked up in the module's globals at call time
        exec("def build(factory, **kw):\n    return globals()[factory](**kw)\n", module.__dict__)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    yield load
    dropin.uninstall()
    for n, obj in originals.items():
        assert getattr(registry, n) is obj, f"{n} not restored"


DECODE, PREFILL, EAGER = (m for m, _ in dropin.PATCH_TABLE[1:])
DECODE_KW = dict(device=CPU, max_bs=2, max_num_token=2, seq_len_fill_value=1, cache_loc_dtype=torch.int64,
                 share_pool=False)


def test_install_switches_runners_imported_before_and_after_and_uninstall_restores(runners):
    registry = sys.modules[REGISTRY]
    sglang_objects = {n: getattr(registry, n) for n in dropin.PATCH_TABLE[0][1]}
    decode = runners(DECODE)  # imported before install: binds sglang's objects
    assert decode.build_decode_registry is sglang_objects["build_decode_registry"]
    assert type(decode.build("build_decode_registry", **DECODE_KW)).__module__ == REGISTRY
    assert not dropin.installed()

    dropin.install()
    assert dropin.installed()
    for name in dropin.PATCH_TABLE[0][1]:
        assert getattr(registry, name) is getattr(dropin, name)
    for name in dict(dropin.PATCH_TABLE)[DECODE]:
        assert getattr(decode, name) is getattr(dropin, name), name
    assert type(decode.build("build_decode_registry", **DECODE_KW)) is dropin.CudaGraphBufferRegistry
    assert PREFILL not in sys.modules and EAGER not in sys.modules  # install imports no runner

    prefill, eager = runners(PREFILL), runners(EAGER)  # imported after install: bind the drop-in
    assert prefill.build_prefill_registry is dropin.build_prefill_registry
    assert prefill.CudaGraphBufferRegistry is dropin.CudaGraphBufferRegistry
    eager_reg = eager.build("build_eager_registry", device=CPU, max_bs=2, max_num_token=4,
                            cache_loc_dtype=torch.int64)
    SGL.input_buffers._forward_input_buffer_pool.clear()
    assert type(eager_reg) is dropin.CudaGraphBufferRegistry
    # the test file's in-function imports read the registry module: the drop-in too
    from sglang.srt.model_executor.cuda_graph_buffer_registry import GraphSlot, build_prefill_registry
    assert (GraphSlot, build_prefill_registry) == (dropin.GraphSlot, dropin.build_prefill_registry)

    dropin.install()  # idempotent: sglang's objects are still what uninstall restores
    dropin.uninstall()
    assert not dropin.installed()
    for module in (decode, prefill, eager, registry):
        for name, obj in sglang_objects.items():
            if hasattr(module, name):
                assert getattr(module, name) is obj, f"{module.__name__}.{name}"
    assert type(decode.build("build_decode_registry", **DECODE_KW)).__module__ == REGISTRY
    dropin.uninstall()  # idempotent
    assert registry.build_decode_registry is sglang_objects["build_decode_registry"]


def test_install_patches_runners_imported_between_two_installs(runners):
    dropin.install()
    decode = runners(DECODE)
    assert decode.build_decode_registry is dropin.build_decode_registry  # from the patched registry module
    decode.build_decode_registry = SGL.registry.build_decode_registry  # as if bound before the first install
    dropin.install()
    assert decode.build_decode_registry is dropin.build_decode_registry


# --- the plugin entry point ----------------------------------------------------------------

def declared_entry_point() -> importlib.metadata.EntryPoint:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    group = "sglang.srt.plugins"
    (name, value), = project["entry-points"][group].items()
    return importlib.metadata.EntryPoint(name=name, value=value, group=group)


@pytest.fixture
def sglang_plugins(monkeypatch, runners):
    """sglang's real plugin loader, discovering graphslot's declared entry point."""
    plugins = pytest.importorskip("sglang.srt.plugins")
    ep = declared_entry_point()
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ep] if group == ep.group else [])
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    return plugins


def test_entry_point_is_declared_for_sglangs_general_plugin_group():
    ep = declared_entry_point()
    assert (ep.name, ep.value) == ("graphslot", "graphslot.integrations.sglang.patching:load_plugin")
    assert ep.load() is install_mod.load_plugin


@pytest.mark.parametrize("value, expected", [("1", True), ("on", True), ("0", False), ("", False), (None, False)])
def test_sglang_plugin_loader_installs_only_with_graphslot_sglang_on(sglang_plugins, monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("GRAPHSLOT_SGLANG", raising=False)
    else:
        monkeypatch.setenv("GRAPHSLOT_SGLANG", value)
    sglang_plugins.load_plugins()
    assert dropin.installed() is expected


def test_sglang_plugin_whitelist_without_graphslot_skips_it(sglang_plugins, monkeypatch):
    monkeypatch.setenv("GRAPHSLOT_SGLANG", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    sglang_plugins.load_plugins()
    assert not dropin.installed()


def test_a_bad_graphslot_sglang_value_names_the_variable(monkeypatch, runners):
    monkeypatch.setenv("GRAPHSLOT_SGLANG", "maybe")
    with pytest.raises(ValueError, match="GRAPHSLOT_SGLANG='maybe' is not a boolean"):
        install_mod.load_plugin()
    assert not dropin.installed()
