"""Which of a project's own specs a spec name means. Torch-free.

A bare spec name (``decode``: an identifier, no directory, no suffix) given to
``load_spec``, ``build_registry``, ``graphslot show`` or ``validate``, or to an
``[[tool.graphslot.outputs]]`` entry, means the project's own spec before graphslot's
shipped one: the project is the one around the working directory (the pyproject.toml
found from it), and its specs are those listed under ``[tool.graphslot] specs``. Among
them, a spec whose file is ``NAME.yaml`` (or ``.yml``) wins, else one whose ``name:`` is
``NAME``. So a spec started with ``graphslot new-spec --from decode specs/decode.yaml``
(which keeps ``name: decode``) is what ``decode`` means inside the project, and every
message names that file; outside the project ``decode`` is the shipped spec again.
:func:`graphslot.spec.loading.spec_path` asks here first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from .errors import SpecError, SpecIssue
from .files import TooLarge, display_path, read_bounded
from .names import is_identifier
from .project import ProjectConfigError, find_pyproject, parse_pyproject, read_pyproject
from .yaml_loader import load_yaml

__all__ = ["SPEC_SUFFIXES", "declared_name", "is_spec_name", "project_spec", "project_spec_names",
           "project_specs"]

SPEC_SUFFIXES = (".yaml", ".yml")
# A spec's `name:` is read only to resolve a name; a file larger than this is not looked in.
MAX_NAME_LOOKUP_BYTES = 1 << 20
# The specs each pyproject.toml lists, by (path, mtime, size).
_LISTED: Dict[tuple, List[Path]] = {}


def is_spec_name(text: str) -> bool:
    """A bare name (``decode``), as opposed to a path (``specs/decode.yaml``)."""
    return is_identifier(text)


def project_specs(start: Union[str, Path, None] = None) -> List[Path]:
    """The specs listed by the project around ``start`` (default: the working directory);
    a SpecError naming pyproject.toml when its ``[tool.graphslot]`` cannot be read, since
    then no name can be told apart from a shipped one. Kept per pyproject.toml version
    (path, mtime, size): names are resolved on every ``load_spec("decode")``."""
    path = find_pyproject(Path.cwd() if start is None else start)
    if path is None:
        return []
    try:
        stat = path.stat()
        key: Optional[tuple] = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        key = None  # reading it says why
    if key in _LISTED:
        return list(_LISTED[key])
    try:
        specs = parse_pyproject(path, read_pyproject(path)).specs
    except ProjectConfigError as exc:
        raise SpecError(exc.issues + [SpecIssue(exc.issues[0].file, None, "cannot tell which spec a name means "
                                                "while [tool.graphslot] is unreadable: fix it, or pass the spec's "
                                                "path")]) from None
    if key is not None:
        if len(_LISTED) >= 64:
            _LISTED.clear()
        _LISTED[key] = list(specs)
    return specs


def declared_name(path: Path) -> Optional[str]:
    """The ``name:`` a spec file declares, when it can be read (None otherwise: validation
    reports what is wrong with the file)."""
    try:
        text = read_bounded(path, MAX_NAME_LOOKUP_BYTES).decode("utf-8")
    except (OSError, TooLarge, UnicodeDecodeError):
        return None
    data = load_yaml(text.removeprefix("\ufeff"), display_path(path)).data
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def project_spec(name: str, specs: Sequence[Path]) -> Optional[Path]:
    """The spec among ``specs`` that ``name`` means: the one whose file is NAME.yaml or
    NAME.yml, else the one whose ``name:`` is NAME; None when there is none. Two of the
    same rank are ambiguous: a SpecError naming both."""
    existing = [p for p in dict.fromkeys(specs) if p.is_file()]
    matches = ([p for p in existing if p.stem == name and p.suffix in SPEC_SUFFIXES]
               or [p for p in existing if declared_name(p) == name])
    if len(matches) > 1:
        shown = ", ".join(display_path(p) for p in matches)
        raise SpecError([SpecIssue(name, None, f"the spec name '{name}' matches several of the project's specs "
                                               f"({shown}); pass the path of the one you mean")])
    return matches[0] if matches else None


def project_spec_names(specs: Sequence[Path]) -> List[str]:
    """The names that mean a project spec (file stems), for messages."""
    return sorted({p.stem for p in specs})
