"""YAML loading that remembers where every value came from.

PyYAML's ``safe_load`` throws away line numbers and silently keeps the last of two
duplicate keys. Specs need both: every error names its line, and a duplicated key is a
mistake to report, not to resolve. So we compose the node tree ourselves and build plain
Python data plus a :class:`Locations` index from key paths to line numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import yaml

from .errors import SpecIssue

Path = Tuple[Any, ...]


@dataclass
class Locations:
    """Line numbers (1-based) of the values of a loaded document, by key path.

    ``("slots", 3, "padding")`` is the line of the ``padding:`` entry of the fourth
    slot. A path that is not recorded falls back to its nearest recorded parent, so a
    message about a missing key points at the mapping that lacks it.
    """

    file: str
    lines: Dict[Path, int] = field(default_factory=dict)

    def line(self, path: Path) -> Optional[int]:
        path = tuple(path)
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path)


@dataclass
class LoadedYaml:
    data: Any
    locations: Locations
    issues: List[SpecIssue]


def load_yaml(text: str, file: str) -> LoadedYaml:
    """Parse ``text``; syntax errors and duplicate keys come back as issues."""
    locations = Locations(file)
    issues: List[SpecIssue] = []
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        reason = exc.problem or str(exc)
        if exc.context:
            reason = f"{exc.context}, {reason}"
        issues.append(SpecIssue(file, line, f"YAML syntax error: {reason}"))
        return LoadedYaml(None, locations, issues)
    finally:
        loader.dispose()
    if node is None:
        return LoadedYaml(None, locations, issues)
    data = _build(node, (), loader, locations, issues)
    return LoadedYaml(data, locations, issues)


def _build(node: yaml.Node, path: Path, loader, locations: Locations, issues) -> Any:
    locations.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        result: Dict[Any, Any] = {}
        first_seen: Dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_seen:
                issues.append(
                    SpecIssue(
                        locations.file,
                        line,
                        f"duplicate key '{key}' (first at line {first_seen[key]}); "
                        "YAML would silently keep the last one: remove one of them",
                    )
                )
                continue
            first_seen[key] = line
            locations.lines[path + (key,)] = line
            result[key] = _build(value_node, path + (key,), loader, locations, issues)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [
            _build(item, path + (i,), loader, locations, issues)
            for i, item in enumerate(node.value)
        ]
    return loader.construct_object(node, deep=True)
