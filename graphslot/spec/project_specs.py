"""Which of a project's own specs a bare spec name (``decode``) means: given to ``load_spec``, ``build_registry``,
the CLI or an ``[[tool.graphslot.outputs]]`` entry, it means the spec listed under ``[tool.graphslot] specs`` of the
project around the working directory whose file is ``NAME.yaml`` (or ``.yml``), else whose ``name:`` is ``NAME``,
before graphslot's shipped spec of that name. Torch-free."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

from .errors import SpecError, SpecIssue
from .files import TooLarge, display_path, read_bounded
from .names import is_identifier
from .project import find_pyproject, parse_pyproject
from .pyproject_text import ProjectConfigError, read_pyproject
from .yaml_loader import load_yaml

SPEC_SUFFIXES = (".yaml", ".yml")
# A spec's `name:` is read only to resolve a name; a file larger than this is not looked in.
MAX_NAME_LOOKUP_BYTES = 1 << 20

is_spec_name = is_identifier  # a bare name (``decode``), as opposed to a path (``specs/decode.yaml``)


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
