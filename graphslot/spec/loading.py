"""Reading spec files: which file a spec name means, YAML → structural validation → cross-key checks → RegistrySpec."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pydantic import ValidationError

from .checks import DEFAULT_MAX_BYTES, check_spec
from .errors import SpecError, SpecIssue, did_you_mean, one_of, shorten
from .files import TooLarge, display_path, read_bounded
from .model import AXES, MAX_PARAMS, MAX_PRESETS, MAX_SLOTS, PADDINGS, PARAM_KEYS, PARAM_TYPES, SLOT_KEYS
from .model import TOP_KEYS, ParamSpec, RegistrySpec, SlotSpec
from .names import is_identifier
from .project import find_pyproject, parse_pyproject
from .pyproject_text import ProjectConfigError, read_pyproject
from .yaml_loader import INT_LIMIT, MAX_YAML_DEPTH, MAX_YAML_NODES, Locations, load_yaml

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "slot_specs"
# Largest spec file read, in bytes (a spec is a few KiB; validation is linear in size).
MAX_SPEC_BYTES = 16 << 20
SPEC_SUFFIXES = (".yaml", ".yml")
# A spec's `name:` is read only to resolve a name; a file larger than this is not looked in.
MAX_NAME_LOOKUP_BYTES = 1 << 20
is_spec_name = is_identifier  # a bare name (``decode``), as opposed to a path (``specs/decode.yaml``)
_SCALARS = (str, bool, int, float, type(None))
_CHOICES = {
    "axis": AXES,
    "padding": PADDINGS,
    "type": PARAM_TYPES,
    "device": ("cpu",),
    "index": ("true", "false", "skip"),
}
_NOT_A_MAPPING = f"a spec is a mapping with keys {', '.join(TOP_KEYS)}"
# Validated specs kept per process (RegistrySpec is frozen, so sharing one is safe): a file by (path, mtime, size), a
# spec from code by its data. Registries built again and again (an engine rebuilding one) parse nothing twice.
SPEC_CACHE_LIMIT = 256
_SPECS: Dict[tuple, RegistrySpec] = {}


def _cached(key: tuple, make: Callable[[], RegistrySpec]) -> RegistrySpec:
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= SPEC_CACHE_LIMIT:
            _SPECS.clear()
        spec = _SPECS[key] = make()
    return spec


def shipped_spec_names() -> List[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def shipped_spec_path(name: str) -> Path:
    """The file of the shipped spec ``name`` (whatever a project calls its own specs)."""
    return SHIPPED_DIR / f"{name}.yaml"


def is_shipped(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is one of graphslot's shipped spec files."""
    try:
        return Path(path).resolve().parent == SHIPPED_DIR
    except (OSError, ValueError):
        return False


def project_specs(start: Union[str, Path, None] = None) -> List[Path]:
    """The specs the project around ``start`` (default: the working directory) lists, kept per pyproject.toml version;
    a SpecError when ``[tool.graphslot]`` cannot be read, since then no name can be told apart from a shipped one."""
    path = find_pyproject(Path.cwd() if start is None else start)
    if path is None:
        return []
    try:
        stat = path.stat()
    except OSError:  # reading it says why
        return list(_listed.__wrapped__(path))
    return list(_listed(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=64)
def _listed(path: Path, *version: int) -> Tuple[Path, ...]:
    """The specs the pyproject.toml at ``path`` lists, cached by its ``version`` (mtime and size)."""
    try:
        return tuple(parse_pyproject(path, read_pyproject(path)).specs)
    except ProjectConfigError as exc:
        why = "cannot tell which spec a name means while [tool.graphslot] is unreadable: fix it, or pass the"
        raise SpecError([*exc.issues, SpecIssue(exc.issues[0].file, None, why + " spec's path")]) from None


def declared_name(path: Path) -> Optional[str]:
    """The ``name:`` a spec file declares, when it can be read (else None: validation says what is wrong)."""
    try:
        text = read_bounded(path, MAX_NAME_LOOKUP_BYTES).decode("utf-8")
    except (OSError, TooLarge, UnicodeDecodeError):
        return None
    data = load_yaml(text.removeprefix("\ufeff"), display_path(path)).data
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def project_spec(name: str, specs: Sequence[Path]) -> Optional[Path]:
    """The spec among ``specs`` that ``name`` means (None when there is none); two of the same rank are
    ambiguous: a SpecError naming both."""
    existing = [p for p in dict.fromkeys(specs) if p.is_file()]
    by_file = [p for p in existing if p.stem == name and p.suffix in SPEC_SUFFIXES]
    matches = by_file or [p for p in existing if declared_name(p) == name]
    if len(matches) > 1:
        shown = ", ".join(display_path(p) for p in matches)
        why = f"the spec name '{name}' matches several of the project's specs ({shown}); pass the path of the one"
        raise SpecError([SpecIssue(name, None, why + " you mean")])
    return matches[0] if matches else None


def spec_path(name_or_path: Union[str, os.PathLike]) -> Path:
    """A spec file by path, or by name (in ``load_spec``, the CLI, an ``[[tool.graphslot.outputs]]`` entry): ``NAME`` is
    the spec under the ``[tool.graphslot] specs`` of the project around the working directory whose file is
    ``NAME.yaml`` (or ``.yml``), else whose ``name:`` is ``NAME``, before graphslot's shipped spec of that name."""
    text = os.fspath(name_or_path)
    project = project_specs() if is_spec_name(text) else []
    for path in (project_spec(text, project), is_spec_name(text) and shipped_spec_path(text), Path(text)):
        if path and path.is_file():
            return path
    if Path(text).exists():  # a directory, a device, a pipe: never read as a spec
        kind = "is a directory" if Path(text).is_dir() else "is not a regular file"
        raise SpecError.at(text, None, f"{kind}: pass the path of a .yaml spec file (or a spec's name)")
    names = sorted({p.stem for p in project})
    shipped = shipped_spec_names()
    known = (f"; the project's specs are: {one_of(names)}" if names else "") + "; shipped specs are: "
    raise SpecError.at(text, None, "no such spec file" + known + one_of(shipped) + did_you_mean(text, names + shipped))


def load_spec(
    name_or_path: Union[str, os.PathLike], *, import_hooks: bool = False, max_bytes: Optional[int] = None
) -> RegistrySpec:
    """Load a spec by name (the project's own, else a shipped one: :func:`spec_path`) or by path. ``import_hooks``:
    import ``module:function`` hooks and check their signatures (off: no user code runs). ``max_bytes``: the cap on
    the bytes the spec declares at the validation capacities (default :data:`.checks.DEFAULT_MAX_BYTES`)."""
    path = spec_path(name_or_path)
    source = display_path(path)

    def make() -> RegistrySpec:
        return parse_spec(read_spec_text(path, source), path=source, import_hooks=import_hooks, max_bytes=max_bytes)

    try:
        stat = path.stat()
        key = ("file", str(path.resolve()), stat.st_mtime_ns, stat.st_size, source, import_hooks, max_bytes)
    except OSError:
        return make()  # read_spec_text says why it cannot be read
    return _cached(key, make)


def spec_from_dict(
    data: Mapping[str, Any], label: str = "<code>", *, import_hooks: bool = False, max_bytes: Optional[int] = None
) -> RegistrySpec:
    """A spec built in code from the data a YAML spec holds (``RegistrySpec.to_dict()`` gives a shipped one's),
    validated as :func:`parse_spec` does; errors name ``label`` (the spec's ``path``) and the slot, with no line."""
    data = _plain_copy(data, label)
    # the data in its own order (a spec's param order shows in `graphslot show`)
    key = ("code", label, import_hooks, max_bytes, json.dumps(data, allow_nan=True))
    return _cached(key, lambda: _validated(data, Locations(label), "", import_hooks, max_bytes, []))


def _plain(item: Any) -> Any:
    """A numpy scalar's or an enum's (a subclass of str, int or float) plain value, else ``item``."""
    if type(item).__module__ == "numpy" and callable(getattr(item, "item", None)) and type(item.item()) in _SCALARS:
        return item.item()  # numpy is not imported for it
    if type(item) in _SCALARS or not isinstance(item, (str, int, float)):
        return item
    # a str enum's value, not its name
    return str.__str__(item) if isinstance(item, str) else int(item) if isinstance(item, int) else float(item)


def _plain_copy(data: Any, source: str) -> Dict[str, Any]:
    """``data`` as plain dicts and lists within the YAML reader's limits, else a SpecError naming where the value sits
    (``slots[2].shape[0]``). A sequence is read by iterating it, never by trusting its ``len``."""
    if not isinstance(data, Mapping):
        raise SpecError.at(source, None, f"{_NOT_A_MAPPING}, got {type(data).__name__}")
    nodes = 0

    def copy(value: Any, path: Tuple[Any, ...]) -> Any:
        nonlocal nodes
        # a list's items by index, in order
        mapping = isinstance(value, Mapping)
        out = {}
        for key, item in value.items() if mapping else enumerate(value):
            nodes += 1
            if mapping and not isinstance(key, str):
                raise SpecError.at(
                    source, None, f"{_data_path(path) or 'the spec'}: key {shorten(key)} is not a string"
                )
            key = _plain(key)
            item = _plain(item)
            kind = type(item)
            problem = None
            if nodes > MAX_YAML_NODES:
                problem = f"more than {MAX_YAML_NODES} values"
            elif len(path) >= MAX_YAML_DEPTH:
                problem = f"nested deeper than {MAX_YAML_DEPTH} levels"
            elif kind is int and abs(item) >= INT_LIMIT:
                problem = f"integer {shorten(item)} out of range (|value| < 2**63)"
            elif kind not in _SCALARS and not isinstance(item, (Mapping, list, tuple)):
                module = kind.__module__.split(".")[0]  # `bool`, `numpy.bool`, `torch.dtype`
                name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
                problem = (
                    f"{name} is not plain data: a spec from code holds only dicts, lists, str, int, float, bool and "
                    "None (a dtype by its name: 'int64')"
                )
            if problem is not None:
                raise SpecError.at(source, None, f"{_data_path(path + (key,))}: {problem}")
            out[key] = item if kind in _SCALARS else copy(item, path + (key,))
        return out if mapping else list(out.values())

    return copy(data, ())


def _data_path(path: Tuple[Any, ...]) -> str:
    """``slots[2].shape[0]``: where a value sits in a spec's data."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else ("." if out else "") + shorten(key, quote=False)
    return out


def read_spec_text(path: Path, source: str) -> str:
    """The text of a spec file: UTF-8, at most MAX_SPEC_BYTES; else SpecError with the line."""
    try:
        data = read_bounded(path, MAX_SPEC_BYTES)
    except OSError as exc:
        raise SpecError.at(source, None, f"cannot read: {exc.strerror or exc}") from None
    except TooLarge as exc:
        raise SpecError.at(source, None, f"{exc}; a spec is a few KiB") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        message = f"not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start} cannot be decoded"
        raise SpecError.at(source, data.count(b"\n", 0, exc.start) + 1, message) from None


def parse_spec(
    text: str, path: str = "<string>", *, import_hooks: bool = False, max_bytes: Optional[int] = None
) -> RegistrySpec:
    """Parse and validate spec text; raises SpecError listing every problem, each naming
    ``path`` (the file the text came from, or a label). See :func:`load_spec` for the rest."""
    if not isinstance(text, str):
        raise SpecError.at(path, None, f"spec text must be a str, got {type(text).__name__}")
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError.at(path, None, f"the text is longer than {MAX_SPEC_BYTES} characters; a spec is a few KiB")
    nul = text.find("\x00")
    if nul >= 0:  # libyaml would stop at it without a word
        message = "YAML syntax error: control characters are not allowed (character #x0000)"
        raise SpecError.at(path, text.count("\n", 0, nul) + 1, message)
    loaded = load_yaml(text, path)
    if loaded.fatal:
        raise SpecError(loaded.issues)
    if not isinstance(loaded.data, dict):
        raise SpecError(loaded.issues + [SpecIssue(path, 1, _NOT_A_MAPPING)])
    return _validated(loaded.data, loaded.locations, text, import_hooks, max_bytes, loaded.issues)


def _validated(
    data: Dict[Any, Any], locations: Locations, text: str, import_hooks: bool, max_bytes: Optional[int], issues: list
) -> RegistrySpec:
    """Structural (pydantic) then cross-key validation of a spec's data (from ``locations.file``): every problem,
    sorted by line, as one SpecError."""
    # Counts beyond the limits first: the checks evaluate every preset against params and slots.
    too_many = [
        SpecIssue(locations.file, locations.line((key,)), f"too many {key}: {len(data[key])} (at most {limit})")
        for key, limit in (("params", MAX_PARAMS), ("presets", MAX_PRESETS), ("slots", MAX_SLOTS))
        if isinstance(data.get(key), (dict, list)) and len(data[key]) > limit
    ]
    if too_many:
        raise SpecError(issues + too_many)
    spec = None
    try:
        spec = RegistrySpec.model_validate(data)
    except ValidationError as exc:
        issues.extend(_structural_issues(exc, data, locations))
    params = spec.params if spec else dict(_valid_parts(data, "params", ParamSpec))
    slots = list(enumerate(spec.slots)) if spec else _valid_parts(data, "slots", SlotSpec)
    presets = {k: v for k, v in _entries(data, "presets") if isinstance(v, dict)}
    described = [((), data)] + [((key, k), v) for key in ("params", "slots") for k, v in _entries(data, key)]
    descriptions = [(p + ("description",), v.get("description")) for p, v in described if isinstance(v, dict)]
    issues += check_spec(
        params,
        presets,
        slots,
        locations.file,
        locations,
        name=data.get("name"),
        descriptions=[(p, text) for p, text in descriptions if isinstance(text, str)],
        import_hooks=import_hooks,
        max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
        structurally_valid=spec is not None,
    )
    if issues:
        raise SpecError(sorted(issues, key=lambda i: i.line or 0))
    spec._source = locations.file
    spec._text = text
    spec._locations = locations
    return spec


def _entries(data: Dict[Any, Any], key: str) -> List[Tuple[Any, Any]]:
    """``(name, value)`` of the mapping or ``(index, value)`` of the slots list at ``key``; none when it is neither."""
    value = data.get(key)
    if key == "slots":
        return list(enumerate(value)) if isinstance(value, list) else []
    return list(value.items()) if isinstance(value, dict) else []


def _valid_parts(data: Dict[Any, Any], key: str, model: Any) -> List[Tuple[Any, Any]]:
    """The entries of the params mapping or slots list that validate on their own."""
    parts = []
    for name, value in _entries(data, key):
        with contextlib.suppress(ValidationError):
            parts.append((name, model.model_validate(value)))
    return parts


def _structural_issues(exc: ValidationError, data: Any, locations: Locations) -> List[SpecIssue]:
    # The model keeps lists as tuples (a spec never changes), and pydantic's tuple validator adds a `too_short` to a
    # sequence whose item failed (one it counts as missing): drop those.
    errors = exc.errors()
    failed_items = {error["loc"][:-i] for error in errors for i in range(1, len(error["loc"]))}
    seen = set()
    issues = []
    for error in errors:
        kind = error["type"]
        if kind == "too_short" and error["loc"] in failed_items:
            continue
        # the part of the loc in the document; the rest: union tags ('int') or a missing key
        path = ()
        node = data
        for part in error["loc"]:
            if not (isinstance(node, dict) and part in node or isinstance(node, list) and part in range(len(node))):
                break
            path = path + (part,)
            node = node[part]
        rest = tuple(error["loc"][len(path) :])
        if rest[-1:] == ("[key]",):
            message = (
                f"key {shorten(error['input'])} is not a string: YAML reads unquoted on/off/yes/no/true/false "
                "and numbers as such; quote it"
            )
        elif kind == "missing":
            message = f"missing required key '{rest[0] if rest else '?'}'"
        elif kind == "extra_forbidden":
            parent = path[:-1]
            nested = {"slots": SLOT_KEYS, "params": PARAM_KEYS}.get(parent[0], ()) if len(parent) == 2 else ()
            allowed = nested if parent else TOP_KEYS
            hint = did_you_mean(path[-1], allowed) or (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
            message = f"unknown key '{shorten(str(path[-1]), quote=False)}'{hint}"
        elif kind == "literal_error" and path and path[-1] in _CHOICES:
            choices = _CHOICES[path[-1]]
            given = error["input"]
            if given in ("true", "false") and given in choices:  # index: "true" is the string, not the boolean
                hint = f": it is a quoted string; write {given} unquoted for the boolean"
            else:
                hint = did_you_mean(given, choices)
            message = f"'{shorten(str(given), quote=False)}' is not a valid {path[-1]} (one of: {', '.join(choices)})"
            message += hint
        else:
            key = shorten(".".join(str(p) for p in path[2:] or path[-1:]), quote=False) or "spec"
            msg = error["msg"].replace("valid tuple", "valid list").replace("Tuple should", "List should")
            message = f"bad value for '{key}': {shorten(msg.lower(), 200, quote=False)} (got {shorten(error['input'])})"
        # A union field yields one error per member type: report the value once.
        dedup = (path, message) if kind in ("missing", "extra_forbidden") else (path, "value")
        if dedup not in seen:
            seen.add(dedup)
            in_slot = len(path) > 1 and path[0] == "slots" and isinstance(data["slots"], list)
            slot = data["slots"][path[1]] if in_slot else None
            name = slot.get("name") if isinstance(slot, dict) else None
            slot_name = shorten(name, quote=False) if isinstance(name, str) else None
            issues.append(SpecIssue(locations.file, locations.line(path), message, slot_name))
    return issues
