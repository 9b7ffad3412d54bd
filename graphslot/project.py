"""A project's graphslot settings: the ``[tool.graphslot]`` table of its pyproject.toml.

::

    [tool.graphslot]
    specs = ["specs/decode.yaml", "specs/prefill.yaml"]   # relative to pyproject.toml

Commands read their own keys from ``ProjectConfig.raw``; only ``specs`` is interpreted
here, because every command that takes specs defaults to the same list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib  # type: ignore[no-redef]

PYPROJECT = "pyproject.toml"


class ProjectConfigError(ValueError):
    """pyproject.toml cannot be read, or its ``[tool.graphslot]`` table is malformed."""


@dataclass(frozen=True)
class ProjectConfig:
    root: Path  # the directory of pyproject.toml (the start directory when there is none)
    specs: List[Path] = field(default_factory=list)  # absolute
    raw: Dict[str, Any] = field(default_factory=dict)  # the whole [tool.graphslot] table
    path: Optional[Path] = None  # the pyproject.toml read, if any


def find_pyproject(start_dir: Union[str, Path]) -> Optional[Path]:
    """The nearest pyproject.toml in ``start_dir`` or a parent, so a command run from a
    subdirectory of the project sees the same settings."""
    start = Path(start_dir).resolve()
    for directory in (start, *start.parents):
        candidate = directory / PYPROJECT
        if candidate.is_file():
            return candidate
    return None


def load_project_config(start_dir: Union[str, Path] = ".") -> ProjectConfig:
    """The settings of the project around ``start_dir``; empty without a pyproject or table."""
    path = find_pyproject(start_dir)
    if path is None:
        return ProjectConfig(root=Path(start_dir).resolve())
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ProjectConfigError(f"{path}: cannot read: {exc}") from None
    tool = data.get("tool", {})
    table = tool.get("graphslot", {}) if isinstance(tool, dict) else {}
    if not isinstance(table, dict):
        raise ProjectConfigError(f"{path}: [tool.graphslot] must be a table")
    specs = table.get("specs", [])
    if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
        raise ProjectConfigError(f"{path}: [tool.graphslot] specs must be a list of paths (strings), got {specs!r}")
    root = path.parent
    return ProjectConfig(root=root, specs=[(root / s).resolve() for s in specs], raw=dict(table), path=path)
