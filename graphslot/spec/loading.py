"""Reading spec files: YAML → structural validation → cross-key checks → RegistrySpec."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from pydantic import ValidationError

from .checks import DEFAULT_MAX_BYTES, check_spec
from .errors import SpecError, SpecIssue, did_you_mean, one_of, shorten
from .files import TooLarge, display_path, read_bounded
from .project_specs import is_spec_name, project_spec, project_spec_names, project_specs
from .model import (
    AXES,
    MAX_PARAMS,
    MAX_PRESETS,
    MAX_SLOTS,
    PADDINGS,
    PARAM_KEYS,
    PARAM_TYPES,
    SLOT_KEYS,
    TOP_KEYS,
    ParamSpec,
    RegistrySpec,
    SlotSpec,
)
from .yaml_loader import INT_LIMIT, MAX_YAML_DEPTH, MAX_YAML_NODES, Locations, line_of_position, load_yaml

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "slot_specs"
# Largest spec file read, in bytes (a spec is a few KiB; validation is linear in size).
MAX_SPEC_BYTES = 16 << 20
_CHOICES = {"axis": AXES, "padding": PADDINGS, "type": PARAM_TYPES, "device": ("cpu",)}
# Validated specs kept per process (RegistrySpec is frozen, so sharing one is safe): a file
# by (path, mtime, size), a spec from code by its data. Registries built again and again
# (an engine rebuilding one when a batch outgrows it) parse nothing twice.
SPEC_CACHE_LIMIT = 256
_FILE_SPECS: Dict[tuple, RegistrySpec] = {}
_CODE_SPECS: Dict[tuple, RegistrySpec] = {}


def _remember(cache: Dict[tuple, RegistrySpec], key: tuple, spec: RegistrySpec) -> RegistrySpec:
    if len(cache) >= SPEC_CACHE_LIMIT:
        cache.clear()
    cache[key] = spec
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


def spec_path(name_or_path: Union[str, os.PathLike]) -> Path:
    """A spec name -- the project's own spec of that name first (:mod:`.project_specs`),
    else a shipped spec (``decode``) -- or a path to a YAML file."""
    text = os.fspath(name_or_path)
    project = project_specs() if is_spec_name(text) else []
    found = project_spec(text, project) if project else None
    if found is not None:
        return found
    if is_spec_name(text) and shipped_spec_path(text).is_file():  # what shipped_spec_names() lists
        return shipped_spec_path(text)
    path = Path(text)
    if not path.is_file():
        names = project_spec_names(project)
        known = (f"; the project's specs are: {one_of(names)}" if names else "") + "; shipped specs are: "
        raise SpecError(
            [
                SpecIssue(
                    text,
                    None,
                    "no such spec file"
                    + known
                    + one_of(shipped_spec_names())
                    + did_you_mean(text, names + shipped_spec_names()),
                )
            ]
        )
    return path


def load_spec(
    name_or_path: Union[str, os.PathLike], *, import_hooks: bool = False, max_bytes: Optional[int] = None
) -> RegistrySpec:
    """Load a spec by name -- the project's own spec of that name, else a shipped one
    (:func:`spec_path`) -- or a spec file by path.

    ``import_hooks``: import ``module:function`` hooks and check their signatures (off:
    only the reference's form is checked, and no user code runs). ``max_bytes``: the cap
    on the bytes the spec declares at the validation capacities (default
    :data:`graphslot.spec.checks.DEFAULT_MAX_BYTES`).
    """
    path = spec_path(name_or_path)
    source = display_path(path)
    try:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, source, import_hooks, max_bytes)
    except OSError:
        key = None  # read_spec_text says why it cannot be read
    cached = _FILE_SPECS.get(key) if key is not None else None
    if cached is not None:
        return cached
    spec = parse_spec(read_spec_text(path, source), path=source, import_hooks=import_hooks, max_bytes=max_bytes)
    return spec if key is None else _remember(_FILE_SPECS, key, spec)


def spec_from_dict(
    data: Mapping[str, Any], label: str = "<code>", *, import_hooks: bool = False, max_bytes: Optional[int] = None
) -> RegistrySpec:
    """A spec built in code: the same mapping a YAML spec file holds (dicts, lists, str,
    int, float, bool and None), through exactly the validation of :func:`parse_spec`.
    Errors name ``label`` (such as ``"<code: my_engine>"``; the spec's ``path``) and the slot; they
    carry no line. Validated specs are kept by their data, so building the same one
    again costs a lookup. ``RegistrySpec.to_dict()`` gives a shipped spec as such data,
    to derive one from it."""
    source = label
    data = _plain_copy(data, source)
    # the data in its own order (a spec's param order shows in `graphslot show`)
    key = (source, import_hooks, max_bytes, json.dumps(data, allow_nan=True))
    cached = _CODE_SPECS.get(key)
    if cached is not None:
        return cached
    spec = _validated(data, Locations(source), source, "", import_hooks, max_bytes, [])
    return _remember(_CODE_SPECS, key, spec)


_SCALARS = (str, bool, int, float, type(None))


def _type_name(kind: type) -> str:
    """``bool``, ``numpy.bool``, ``torch.dtype``: a type as an error names it."""
    module = getattr(kind, "__module__", "builtins")
    return kind.__qualname__ if module == "builtins" else f"{module.split('.')[0]}.{kind.__qualname__}"


def _numpy_scalar(item: Any) -> Any:
    """A numpy scalar's Python value (``np.bool_`` -> bool, ``np.int64`` -> int,
    ``np.float32`` -> float), else ``item``. numpy is not imported for it."""
    if type(item).__module__ == "numpy" and callable(getattr(item, "item", None)):
        value = item.item()
        if type(value) in _SCALARS:
            return value
    return item


def _plain_copy(data: Any, source: str) -> Dict[str, Any]:
    """``data`` as plain dicts and lists, within the YAML reader's limits; anything else
    is a SpecError naming where it sits (``slots[2].shape[0]``). Subclasses of str, int
    and float (enums) and numpy scalars become their plain values; a sequence is read
    by iterating it (never by trusting its ``len``)."""
    if not isinstance(data, Mapping):
        raise SpecError(
            [SpecIssue(source, None, f"a spec is a mapping with keys {', '.join(TOP_KEYS)}, got {type(data).__name__}")]
        )
    root: Dict[str, Any] = {}
    stack: List[Tuple[Any, Any, Tuple[Any, ...]]] = [(data, root, ())]
    nodes = 0
    while stack:
        value, into, path = stack.pop()
        mapping = isinstance(value, Mapping)
        for key, item in value.items() if mapping else enumerate(value):
            nodes += 1
            if mapping and type(key) is not str:
                if not isinstance(key, str):
                    raise SpecError(
                        [
                            SpecIssue(
                                source, None, f"{_data_path(path) or 'the spec'}: key {shorten(key)} is not a string"
                            )
                        ]
                    )
                key = str.__str__(key)  # a str enum's value, not its name
            item = _numpy_scalar(item)
            problem = None
            kind = type(item)
            if nodes > MAX_YAML_NODES:
                problem = f"more than {MAX_YAML_NODES} values"
            elif len(path) >= MAX_YAML_DEPTH:
                problem = f"nested deeper than {MAX_YAML_DEPTH} levels"
            elif kind is int and abs(item) >= INT_LIMIT:
                problem = f"integer {shorten(item)} out of range (|value| < 2**63)"
            elif (
                kind not in _SCALARS
                and kind is not dict
                and kind is not list
                and not isinstance(item, (str, int, float, Mapping, list, tuple))
            ):
                problem = (
                    f"{_type_name(kind)} is not plain data: a spec from code holds only dicts, lists, "
                    "str, int, float, bool and None (a dtype by its name: 'int64')"
                )
            if problem is not None:
                raise SpecError([SpecIssue(source, None, f"{_data_path(path + (key,))}: {problem}")])
            if not mapping:
                into.append(None)  # the list grows as its items are read
            if kind in _SCALARS:
                into[key] = item
            elif kind is dict or isinstance(item, Mapping):
                into[key] = {}
                stack.append((item, into[key], path + (key,)))
            elif kind is list or isinstance(item, (list, tuple)):
                into[key] = []
                stack.append((item, into[key], path + (key,)))
            else:  # a subclass of a scalar type (an IntEnum, a str enum): its plain value
                into[key] = (
                    str.__str__(item)
                    if isinstance(item, str)  # a str enum's value, not its name
                    else int(item)
                    if isinstance(item, int)
                    else float(item)
                )
                if isinstance(into[key], int) and not isinstance(into[key], bool) and abs(into[key]) >= INT_LIMIT:
                    raise SpecError(
                        [
                            SpecIssue(
                                source,
                                None,
                                f"{_data_path(path + (key,))}: integer "
                                f"{shorten(into[key])} out of range (|value| < 2**63)",
                            )
                        ]
                    )
    return root


def _data_path(path: Tuple[Any, ...]) -> str:
    """``slots[2].shape[0]``: where a value sits in a spec's data."""
    out = ""
    for key in path:
        out += (
            f"[{key}]"
            if isinstance(key, int)
            else (f".{shorten(key, quote=False)}" if out else shorten(key, quote=False))
        )
    return out


def read_spec_text(path: Path, source: str) -> str:
    """The text of a spec file: UTF-8, at most MAX_SPEC_BYTES; else SpecError with the line."""
    try:
        data = read_bounded(path, MAX_SPEC_BYTES)
    except OSError as exc:
        raise SpecError([SpecIssue(source, None, f"cannot read: {exc.strerror or exc}")]) from None
    except TooLarge as exc:
        raise SpecError([SpecIssue(source, None, f"{exc}; a spec is a few KiB")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError(
            [
                SpecIssue(
                    source, line, f"not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start} cannot be decoded"
                )
            ]
        ) from None
    return text.removeprefix("\ufeff")


def parse_spec(
    text: str, path: str = "<string>", *, import_hooks: bool = False, max_bytes: Optional[int] = None
) -> RegistrySpec:
    """Parse and validate spec text; raises SpecError listing every problem, each naming
    ``path`` (the file the text came from, or a label: the spec's ``path``).

    See :func:`load_spec` for ``import_hooks`` and ``max_bytes``.
    """
    source = path
    if not isinstance(text, str):
        raise SpecError([SpecIssue(source, None, f"spec text must be a str, got {type(text).__name__}")])
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(
            [SpecIssue(source, None, f"the text is longer than {MAX_SPEC_BYTES} characters; a spec is a few KiB")]
        )
    nul = text.find("\x00")
    if nul >= 0:  # libyaml would stop at it without a word
        raise SpecError(
            [
                SpecIssue(
                    source,
                    line_of_position(text, nul),
                    "YAML syntax error: control characters are not allowed (character #x0000)",
                )
            ]
        )
    loaded = load_yaml(text, source)
    issues = list(loaded.issues)
    data = loaded.data
    if loaded.fatal:
        raise SpecError(issues)
    if not isinstance(data, dict):
        raise SpecError(issues + [SpecIssue(source, 1, "a spec is a mapping with keys " + ", ".join(TOP_KEYS))])
    return _validated(data, loaded.locations, source, text, import_hooks, max_bytes, issues)


def _validated(
    data: Dict[Any, Any],
    locations: Locations,
    source: str,
    text: str,
    import_hooks: bool,
    max_bytes: Optional[int],
    issues: List[SpecIssue],
) -> RegistrySpec:
    """Structural (pydantic) then cross-key validation of a spec's data: every problem,
    sorted by line, as one SpecError."""
    too_many = _too_many(data, locations)
    if too_many:
        raise SpecError(issues + too_many)
    spec = None
    try:
        spec = RegistrySpec.model_validate(data)
    except ValidationError as exc:
        issues.extend(_structural_issues(exc, data, locations))

    params = spec.params if spec else _valid_parts(data.get("params"), ParamSpec, dict)
    slots = list(enumerate(spec.slots)) if spec else _valid_parts(data.get("slots"), SlotSpec, list)
    presets = data.get("presets") if isinstance(data.get("presets"), dict) else {}
    presets = {k: v for k, v in presets.items() if isinstance(v, dict)}
    issues.extend(
        check_spec(
            params,
            presets,
            slots,
            source,
            locations,
            name=data.get("name"),
            descriptions=_descriptions(data),
            import_hooks=import_hooks,
            max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
            structurally_valid=spec is not None,
        )
    )
    if issues:
        raise SpecError(sorted(issues, key=lambda i: i.line or 0))
    spec._source, spec._text, spec._locations = source, text, locations
    return spec


def _too_many(data: Dict[Any, Any], locations: Locations) -> List[SpecIssue]:
    """Counts beyond the limits: checks evaluate every preset against params and slots."""
    issues = []
    for key, limit in (("params", MAX_PARAMS), ("presets", MAX_PRESETS), ("slots", MAX_SLOTS)):
        value = data.get(key)
        if isinstance(value, (dict, list)) and len(value) > limit:
            issues.append(
                SpecIssue(locations.file, locations.line((key,)), f"too many {key}: {len(value)} (at most {limit})")
            )
    return issues


def _descriptions(data: Dict[Any, Any]) -> List[Tuple[Tuple[Any, ...], Any]]:
    """(path, text) of every description, for the control-character check."""
    found = [(("description",), data.get("description"))]
    params = data.get("params")
    for name, param in params.items() if isinstance(params, dict) else ():
        if isinstance(param, dict):
            found.append((("params", name, "description"), param.get("description")))
    slots = data.get("slots")
    for index, slot in enumerate(slots if isinstance(slots, list) else ()):
        if isinstance(slot, dict):
            found.append((("slots", index, "description"), slot.get("description")))
    return [(path, text) for path, text in found if isinstance(text, str)]


def _valid_parts(raw: Any, model, container):
    """The entries of a params mapping or slots list that validate on their own."""
    if container is dict:
        items = raw.items() if isinstance(raw, dict) else ()
        out: Dict[str, Any] = {}
        for key, value in items:
            try:
                out[key] = model.model_validate(value)
            except ValidationError:
                pass
        return out
    parts: List[Tuple[int, Any]] = []
    for index, value in enumerate(raw if isinstance(raw, list) else ()):
        try:
            parts.append((index, model.model_validate(value)))
        except ValidationError:
            pass
    return parts


def _document_path(loc: Tuple[Any, ...], data: Any) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """Split a pydantic ``loc`` into the part that exists in the document and the rest
    (union-member tags such as ``'int'``, or the name of a missing key)."""
    node, path = data, []
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return tuple(path), tuple(loc[i:])
        path.append(part)
    return tuple(path), ()


def _allowed_keys(path: Tuple[Any, ...]) -> Tuple[str, ...]:
    if len(path) == 2 and path[0] == "slots":
        return SLOT_KEYS
    if len(path) == 2 and path[0] == "params":
        return PARAM_KEYS
    return TOP_KEYS if not path else ()


def _list_errors(errors: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """pydantic's errors as of the lists a spec holds: the model keeps them as tuples
    (a spec never changes), and its tuple validator adds a ``too_short`` to a sequence
    whose item failed (one it counts as missing)."""
    failed_items = {error["loc"][:-i] for error in errors for i in range(1, len(error["loc"]))}
    return [
        dict(error, msg=error["msg"].replace("valid tuple", "valid list").replace("Tuple should", "List should"))
        for error in errors
        if not (error["type"] == "too_short" and error["loc"] in failed_items)
    ]


def _structural_issues(exc: ValidationError, data: Any, locations: Locations) -> List[SpecIssue]:
    seen, issues = set(), []
    for error in _list_errors(exc.errors()):
        path, rest = _document_path(error["loc"], data)
        kind = error["type"]
        if rest[-1:] == ("[key]",):
            message = (
                f"key {shorten(error['input'])} is not a string: YAML reads unquoted on/off/yes/no/true/false "
                "and numbers as such; quote it"
            )
        elif kind == "missing":
            key = rest[0] if rest else "?"
            message = f"missing required key '{key}'"
        elif kind == "extra_forbidden":
            key, parent = path[-1], path[:-1]
            allowed = _allowed_keys(parent)
            hint = did_you_mean(key, allowed) or (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
            message = f"unknown key '{shorten(str(key), quote=False)}'{hint}"
        elif kind == "literal_error" and path and path[-1] in _CHOICES:
            key, choices = path[-1], _CHOICES[path[-1]]
            message = (
                f"'{shorten(str(error['input']), quote=False)}' is not a valid {key} "
                f"(one of: {', '.join(choices)})" + did_you_mean(error["input"], choices)
            )
        else:
            key = shorten(".".join(str(p) for p in path[2:] or path[-1:]), quote=False) or "spec"
            message = (
                f"bad value for '{key}': {shorten(error['msg'].lower(), 200, quote=False)} "
                f"(got {shorten(error['input'])})"
            )
        # A union field yields one error per member type: report the value once.
        dedup = (path, message) if kind in ("missing", "extra_forbidden") else (path, "value")
        if dedup in seen:
            continue
        seen.add(dedup)
        issues.append(SpecIssue(locations.file, locations.line(path), message, _slot_name(path, data)))
    return issues


def _slot_name(path: Tuple[Any, ...], data: Any):
    if len(path) >= 2 and path[0] == "slots" and isinstance(data.get("slots"), list):
        slot = data["slots"][path[1]]
        if isinstance(slot, dict) and isinstance(slot.get("name"), str):
            return shorten(slot["name"], quote=False)
    return None
