"""The layers of graphslot import each other in one direction, through public names.

Every module under ``graphslot/`` is parsed (never imported) and each of its imports,
function-level ones included, is checked against the table below. A layer is a
subpackage of ``graphslot`` (``graphslot.runners.*`` is ``runners``) or one of the
top-level modules (``api``, ``env``, ``kvpool``, ``log``, ``_version``; ``graphslot/__init__.py`` is
``root``). The table reads as the specification:

=============  =============================================================  ==========================================
layer          may import (besides itself)                                    why
=============  =============================================================  ==========================================
_version       nothing                                                        the version string
env            spec.errors                                                    the GRAPHSLOT_* variables: torch-free
log            nothing                                                        the graphslot logger, progress bars:
                                                                              torch-free
spec           _version, env                                                  the format: torch-free
planning       spec                                                           capture-size planning: torch-free
registry       spec                                                           buffers, pool, interpreter (torch)
codegen        spec, registry, _version                                       the generator and generated-code runtime
generated      codegen                                                        generated modules read codegen.runtime
api            spec, registry, codegen, env                                   ``build_registry``
root           _version, spec, api, registry                                  ``import graphslot`` (lazy names)
graphs         spec.errors                                                    backends know nothing of slots or runners
kvpool         nothing                                                        the paged KV pool (torch)
runners        spec, registry, api, graphs, planning, env, log                codegen only through api; no kvpool
tools          runners, graphs, registry, spec, log                           diagnostics over the public runner API
integrations   runners, graphs, tools, spec, registry, kvpool, env, api, log  never the reference (demo) package; api:
                                                                              the sglang drop-in
reference      runners, graphs, kvpool, spec, registry, api, planning, tools  an example engine: any library layer
cli            anything                                                       the top
__main__       cli                                                            ``python -m graphslot``
=============  =============================================================  ==========================================

and, whatever the layer:

* a module imports no underscore name (``_name``, not ``__dunder__``) from another
  package: ``from graphslot.codegen.generator import _render`` in ``graphslot.cli`` is a
  private reach;
* no ``x._name`` where ``x`` is bound by an import from another layer (a module, a
  class, a function), or is a parameter annotated with such a class
  (``def f(runner: DecodeGraphRunner): runner._capture_view``); what the AST cannot
  type (an attribute of an attribute, an unannotated parameter) is out of reach here;
* planning, env and log import no torch, not even inside a function.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from test_torch_free import BLOCK_TORCH, REPORT, report_of, run_python

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphslot"

ANYTHING = "*"
#: layer -> the layers (or modules, "spec.errors") it may import besides itself.
ALLOWED: Dict[str, Tuple[str, ...]] = {
    "_version": (),
    "env": ("spec.errors",),
    "log": (),
    "spec": ("_version", "env"),
    "planning": ("spec",),
    "registry": ("spec",),
    "codegen": ("spec", "registry", "_version"),
    "generated": ("codegen",),
    "api": ("spec", "registry", "codegen", "env"),
    "root": ("_version", "spec", "api", "registry"),
    "graphs": ("spec.errors",),
    "kvpool": (),
    "runners": ("spec", "registry", "api", "graphs", "planning", "env", "log"),
    "tools": ("runners", "graphs", "registry", "spec", "log"),
    "integrations": ("runners", "graphs", "tools", "spec", "registry", "kvpool", "env", "api", "log"),
    "reference": ("runners", "graphs", "kvpool", "spec", "registry", "api", "planning", "tools"),
    "cli": (ANYTHING,),
    "__main__": ("cli",),
}
#: Layers that never import torch, not even inside a function.
TORCH_FREE = ("planning", "env", "log")
#: Underscore modules every layer may import: they are shared, not private.
SHARED_PRIVATE_MODULES = ("graphslot._version",)

#: Private reaches that are known and owned elsewhere: (module, what it reaches) -> who
#: removes it. Each must still exist (a fixed one is struck from this table), so the
#: table only shrinks.
KNOWN_PRIVATE_REACHES: Dict[Tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def layer_of(module: str) -> str:
    parts = module.split(".")
    return "root" if len(parts) == 1 else parts[1]


def allows(layer: str, target: str) -> bool:
    """May ``layer`` import the module ``target`` (``graphslot.x.y``)?"""
    target_layer = layer_of(target)
    if target_layer == layer:
        return True
    rest = target.split(".", 1)[1] if "." in target else ""
    for allowed in ALLOWED[layer]:
        if allowed == ANYTHING or allowed == target_layer or rest == allowed or rest.startswith(allowed + "."):
            return True
    return False


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # the module imported from (absolute)
    names: Tuple[Tuple[str, str], ...]  # (name imported, name bound), empty for `import x`
    text: str  # as written


def resolve(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, tree: ast.Module) -> Iterator[Import]:
    module = module_name(path)
    package = package_of(path, module)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(node, package)
            names = tuple((a.name, a.asname or a.name) for a in node.names)
            yield Import(module, node.lineno, target, names, ast.unparse(node))
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield Import(module, node.lineno, a.name, (), ast.unparse(node))


def graphslot_modules() -> List[Tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


MODULES = graphslot_modules()


def where(imp: Import) -> str:
    return f"{imp.module} (line {imp.line}): `{imp.text}`"


def is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").exists()


def imported_modules(imp: Import) -> List[str]:
    """The graphslot modules an import reaches: ``from graphslot.spec import model``
    reaches graphslot.spec.model; ``from graphslot.spec.errors import SlotError`` reaches
    graphslot.spec.errors."""
    modules = [f"{imp.target}.{name}" for name, _ in imp.names if is_module(f"{imp.target}.{name}")]
    return [m for m in modules or [imp.target] if m == "graphslot" or m.startswith("graphslot.")]


def direction_violations() -> List[str]:
    found = []
    for path, tree in MODULES:
        for imp in imports_of(path, tree):
            layer = layer_of(imp.module)
            for target in imported_modules(imp):
                if not allows(layer, target):
                    found.append(f"{where(imp)} imports layer '{layer_of(target)}' ({target}); rule: {layer} may "
                                 f"import {', '.join(ALLOWED[layer]) or 'nothing of graphslot'}")
    return found


def private_reaches() -> List[Tuple[str, str, str]]:
    """(module, what it reaches, message) for each reach into another package's privates."""
    found = []
    for path, tree in MODULES:
        module = module_name(path)
        package = package_of(path, module)
        layer = layer_of(module)
        foreign: Dict[str, str] = {}  # name bound here -> what it is in another layer
        for imp in imports_of(path, tree):
            if not imp.target.startswith("graphslot") or imp.target in SHARED_PRIVATE_MODULES:
                continue
            target_package = imp.target if (ROOT / imp.target.replace(".", "/")).is_dir() \
                else imp.target.rpartition(".")[0]
            if not imp.names and any(is_private(p) for p in imp.target.split(".")) and target_package != package:
                found.append((module, imp.target, f"{where(imp)} imports the private module {imp.target}"))
            for name, bound in imp.names:
                full = f"{imp.target}.{name}"
                if is_private(name) and target_package != package and full not in SHARED_PRIVATE_MODULES:
                    found.append((module, full, f"{where(imp)} imports the private name {name} from another package "
                                                f"({imp.target}); rule: a layer uses another's public API only"))
                if layer_of(imp.target) != layer:
                    foreign[bound] = full
        found += attribute_reaches(module, tree, foreign)
    return found


def annotated_name(annotation: Optional[ast.expr]) -> Optional[str]:
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip()
    return None


def attribute_reaches(module: str, tree: ast.Module, foreign: Dict[str, str]) -> List[Tuple[str, str, str]]:
    found = []

    def visit(node: ast.AST, bound: Dict[str, str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            typed = dict(bound)
            args = node.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs:
                typed.pop(arg.arg, None)  # a parameter shadows a module-level name
                cls = annotated_name(getattr(arg, "annotation", None))
                if cls in foreign:
                    typed[arg.arg] = f"an instance of {foreign[cls]}"
            for child in ast.iter_child_nodes(node):
                visit(child, typed)
            return
        if (isinstance(node, ast.Attribute) and is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in bound):
            what = bound[node.value.id]
            found.append((module, f"{what.removeprefix('an instance of ')}.{node.attr}",
                          f"{module} (line {node.lineno}): `{ast.unparse(node)}` reads the private attribute "
                          f"{node.attr} of {what}, from another layer; rule: a layer uses another's public API only"))
        for child in ast.iter_child_nodes(node):
            visit(child, bound)

    visit(tree, foreign)
    return found


# ------------------------------------------------------------------------------ tests


def test_the_table_names_every_layer_there_is():
    layers = {layer_of(module_name(path)) for path, _ in MODULES}
    assert layers == set(ALLOWED), f"layers without a rule: {sorted(layers - set(ALLOWED))}; " \
                                   f"rules without a layer: {sorted(set(ALLOWED) - layers)}"


def test_the_table_above_is_the_table_enforced():
    rows = __doc__.split("why\n", 1)[1].split("\n\nand,", 1)[0].splitlines()[1:-1]
    documented = {}
    for row in rows:
        layer, allowed = row[:15].strip(), row[15:78].strip()
        if not layer:  # the rest of the row above's "why"
            assert not allowed, row
            continue
        documented[layer] = {"nothing": (), "anything": (ANYTHING,)}.get(allowed, tuple(allowed.split(", ")))
    assert documented == ALLOWED


def test_every_import_points_the_allowed_way():
    assert direction_violations() == []


def test_no_layer_reaches_into_another_ones_private_names():
    reaches = private_reaches()
    unknown = [message for module, what, message in reaches if (module, what) not in KNOWN_PRIVATE_REACHES]
    assert unknown == []
    still_there = {(module, what) for module, what, _ in reaches}
    fixed = [key for key in KNOWN_PRIVATE_REACHES if key not in still_there]
    assert fixed == [], f"fixed: strike {fixed} from KNOWN_PRIVATE_REACHES"


@pytest.mark.parametrize("layer", TORCH_FREE)
def test_torch_free_layers_name_no_torch_anywhere(layer):
    found = [where(imp) for path, tree in MODULES if layer_of(module_name(path)) == layer
             for imp in imports_of(path, tree) if imp.target == "torch" or imp.target.startswith("torch.")]
    assert found == []


def test_the_planning_package_imports_without_torch():
    code = BLOCK_TORCH + "import graphslot.planning as p\nRESULT = {'names': sorted(p.__all__)}\n" + REPORT
    report = report_of(run_python(code))
    assert report["attempts"] == [] and report["loaded"] == []
    assert "plan_capture_sizes" in report["names"] and "BatchSizeHistogram" in report["names"]


# --------------------------------------------------- the checks catch what they claim to


def check_source(module: str, source: str) -> Tuple[List[str], List[str]]:
    """(direction violations, private reaches) of one made-up module."""
    global MODULES
    path = ROOT / (module.replace(".", "/") + ".py")
    saved, MODULES = MODULES, [(path, ast.parse(source))]
    try:
        return direction_violations(), [message for _, _, message in private_reaches()]
    finally:
        MODULES = saved


def test_a_wrong_way_import_is_named_with_its_rule():
    directions, _ = check_source("graphslot.runners.x", "def f():\n    from ..tools.audit import capture_on_tape\n")
    assert directions == ["graphslot.runners.x (line 2): `from ..tools.audit import capture_on_tape` imports layer "
                          "'tools' (graphslot.tools.audit); rule: runners may import spec, registry, api, graphs, "
                          "planning, env, log"]
    directions, _ = check_source("graphslot.graphs.x", "from graphslot.spec.errors import SlotError\n"
                                                       "from graphslot.spec import model\n")
    assert directions == ["graphslot.graphs.x (line 2): `from graphslot.spec import model` imports layer 'spec' "
                          "(graphslot.spec.model); rule: graphs may import spec.errors"]
    directions, _ = check_source("graphslot.integrations.x", "from ..reference.memory import SWAKVCache\n")
    assert directions and "imports layer 'reference'" in directions[0]


def test_private_reaches_are_named():
    _, reaches = check_source("graphslot.tools.x", (
        "from ..runners.decode import DecodeGraphRunner\n"
        "from ..runners import decode\n"
        "from ..graphs.tape.ops import _helper\n"
        "def audit(runner: DecodeGraphRunner, other):\n"
        "    runner._capture_view(1); other._graph_body(); decode._x; runner.__class__\n"
        "def later(runner):\n"
        "    runner._fine  # unannotated: out of reach\n"))
    assert reaches == [
        "graphslot.tools.x (line 3): `from ..graphs.tape.ops import _helper` imports the private name _helper from "
        "another package (graphslot.graphs.tape.ops); rule: a layer uses another's public API only",
        "graphslot.tools.x (line 5): `runner._capture_view` reads the private attribute _capture_view of an instance "
        "of graphslot.runners.decode.DecodeGraphRunner, from another layer; rule: a layer uses another's public API "
        "only",
        "graphslot.tools.x (line 5): `decode._x` reads the private attribute _x of graphslot.runners.decode, from "
        "another layer; rule: a layer uses another's public API only",
    ]


def test_within_a_package_private_names_are_fair():
    directions, reaches = check_source("graphslot.graphs.tape.x", "from .record import _Capture\n"
                                                                  "from .. import _version_unused\n")
    assert directions == [] and len(reaches) == 1 and "_version_unused from another package" in reaches[0]
