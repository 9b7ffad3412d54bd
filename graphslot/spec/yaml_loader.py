"""YAML loading that remembers the line of every value and reports duplicate keys (PyYAML's ``safe_load`` does
neither), with bounded resources: spec files are untrusted, so the composer refuses, with the line and before it
recurses further, what a spec never needs (aliases, anchors, tags, merge and complex keys, deep nesting, too many
values, integers beyond 64 bits, a second document: graphslot/slot_specs/README.md, "Untrusted specs")."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import yaml

from .errors import SpecIssue, shorten

Path = Tuple[Any, ...]

# Deepest nesting of mappings and lists a spec may use (a spec needs 4: top level, slots, a slot, its shape).
MAX_YAML_DEPTH = 32
# Most values (keys included) a spec may hold: the largest spec the limits on slots, params and presets allow fits.
MAX_YAML_NODES = 250_000
# Integers a spec may write: |value| < INT_LIMIT (a signed 64-bit value).
INT_LIMIT = 2**63

_TOO_DEEP = f"YAML nesting deeper than {MAX_YAML_DEPTH} levels: a spec needs only a few"
_STR_TAG = "tag:yaml.org,2002:str"
_UNDEFINED = yaml.constructor.SafeConstructor.construct_undefined
# libyaml's parser when available (linear and fast), else PyYAML's own; either way PyYAML's composer (CSafeLoader
# has its own in C), checked at every node.
_LOADER = (yaml.composer.Composer, yaml.CSafeLoader) if yaml.__with_libyaml__ else (yaml.SafeLoader,)


@dataclass
class Locations:
    """Lines (1-based) of a document's values by key path (``("slots", 3, "padding")``); a path not recorded falls
    back to its nearest recorded parent, so a message about a missing key points at the mapping that lacks it."""

    file: str
    lines: Dict[Path, int] = field(default_factory=dict)

    def line(self, path: Path) -> Optional[int]:
        path = tuple(path)
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path)


class LoadedYaml(NamedTuple):
    data: Any
    locations: Locations
    issues: List[SpecIssue]
    fatal: bool = False  # the document could not be read as a whole: ``data`` is None, nothing else to check


class _Refused(Exception):
    def __init__(self, event: yaml.Event, message: str):
        super().__init__(message)
        self.line = event.start_mark.line + 1
        self.message = message


class _Scalar(NamedTuple):  # small: a spec may hold many
    data: Any
    line: int


class _Composer(*_LOADER):
    def __init__(self, text: str):
        _LOADER[-1].__init__(self, text)
        yaml.composer.Composer.__init__(self)
        self.depth = 0
        self.nodes = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        self.nodes += 1
        if self.nodes > MAX_YAML_NODES:
            raise _Refused(event, f"more than {MAX_YAML_NODES} YAML values: a spec holds a few hundred")
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(event, "YAML aliases (*name) are not allowed in a spec: write the value out")
        if event.anchor is not None:
            raise _Refused(
                event, "YAML anchors (&name) are not allowed in a spec: write the value out where it is used"
            )
        if event.tag is not None:
            raise _Refused(event, f"YAML tags ({shorten(event.tag)}) are not allowed in a spec")
        if isinstance(event, yaml.ScalarEvent):
            return self.compose_scalar_node()
        if isinstance(parent, yaml.MappingNode) and index is None:  # a mapping key
            raise _Refused(event, "mapping keys must be plain scalars, not a list or a mapping (? [a, b]: …)")
        if self.depth >= MAX_YAML_DEPTH:
            raise _Refused(event, _TOO_DEEP)
        self.depth += 1
        node = super().compose_node(parent, index)
        self.depth -= 1
        node.line = node.start_mark.line + 1
        node.start_mark = None  # marks are large
        node.end_mark = None
        return node

    def compose_scalar_node(self, anchor=None) -> _Scalar:
        event = self.get_event()
        tag = self.resolve(yaml.ScalarNode, event.value, event.implicit)
        if tag == "tag:yaml.org,2002:merge":
            raise _Refused(event, "YAML merge keys (<<) are not allowed in a spec: write the keys out")
        node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark)
        try:
            data = event.value if tag == _STR_TAG else self.yaml_constructors.get(tag, _UNDEFINED)(self, node)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            reason = getattr(exc, "problem", None) or str(exc)
            raise _Refused(event, f"cannot read the value {shorten(event.value)}: {reason}") from None
        if isinstance(data, int) and not isinstance(data, bool) and not -INT_LIMIT < data < INT_LIMIT:
            why = "spec integers must lie strictly between -2**63 and 2**63"
            raise _Refused(event, f"integer {shorten(event.value)} is out of range: {why}")
        return _Scalar(data, event.start_mark.line + 1)

    def compose_spec(self) -> Optional[yaml.Node]:
        self.get_event()  # StreamStart
        node = None if self.check_event(yaml.StreamEndEvent) else self.compose_document()
        if not self.check_event(yaml.StreamEndEvent):
            raise _Refused(self.peek_event(), "a spec is one YAML document; remove the second one ('---')")
        return node


def _data(node: yaml.Node, path: Path, locations: Locations, issues: List[SpecIssue]) -> Any:
    """The value of ``node`` at ``path``, its lines recorded in ``locations``; a duplicated key keeps its first
    value (recursion: the depth is bounded)."""
    locations.lines.setdefault(path, node.line)
    if isinstance(node, _Scalar):
        return node.data
    if isinstance(node, yaml.SequenceNode):
        return [_data(item, path + (i,), locations, issues) for i, item in enumerate(node.value)]
    result: Dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = key_node.data
        line = key_node.line
        if key in result:
            first = locations.lines[path + (key,)]
            message = f"duplicate key '{shorten(str(key), quote=False)}' (first at line {first}); YAML would silently"
            issues.append(SpecIssue(locations.file, line, message + " keep the last one: remove one of them"))
            continue
        locations.lines[path + (key,)] = line
        result[key] = _data(value_node, path + (key,), locations, issues)
    return result


def load_yaml(text: str, file: str) -> LoadedYaml:
    """Parse ``text``; syntax errors, refused constructs and duplicate keys come back as issues."""
    locations = Locations(file)
    issues = []
    # Building many small containers makes the cyclic GC rescan the growing heap again and again (quadratic in the
    # file); nothing built here is cyclic.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        node = _Composer(text).compose_spec()
        return LoadedYaml(None if node is None else _data(node, (), locations, issues), locations, issues)
    except _Refused as exc:
        line = exc.line
        message = exc.message
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        message = f"YAML syntax error: {exc.context + ', ' if exc.context else ''}{exc.problem or exc}"
        if "maximum nesting depth" in (exc.problem or ""):
            message = _TOO_DEEP  # libyaml (PyYAML >= 6.0.4) has its own, higher, depth limit
    except yaml.reader.ReaderError as exc:
        char = exc.character
        shown = f"{char!r}" if isinstance(char, str) else f"#x{char:04x}" if isinstance(char, int) else "?"
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        message = f"YAML syntax error: {exc.reason} (character {shown})"
    except yaml.YAMLError as exc:
        line = None
        message = f"YAML syntax error: {shorten(str(exc), 200, quote=False)}"
    finally:
        if gc_was_enabled:
            gc.enable()
    return LoadedYaml(None, locations, [SpecIssue(file, line, message)], fatal=True)
