"""YAML loading that remembers where every value came from, with bounded resources.

PyYAML's ``safe_load`` throws away line numbers and silently keeps the last of two
duplicate keys. Specs need both: every error names its line, and a duplicated key is a
mistake to report, not to resolve. So we compose the document ourselves, from the
parser's event stream, into plain Python data plus a :class:`Locations` index from key
paths to line numbers.

Spec files are untrusted input (they arrive in pull requests, CI reads them), and a spec
needs nothing but plain mappings, lists and scalars. So the composer is iterative (no
recursion, whatever the nesting) and refuses, with the line, what a spec never needs:

* aliases and anchors (``*a``, ``&a``): a few hundred bytes of nested aliases expand to
  gigabytes;
* nesting deeper than :data:`MAX_YAML_DEPTH`;
* tags (``!!python/name:…``, ``!!str``, ``!foo``);
* merge keys (``<<:``) and complex keys (``? [a, b]: 1``);
* integers outside the signed 64-bit range (``|value| < 2**63``);
* more than one document.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import yaml

from .errors import SpecIssue, shorten

Path = Tuple[Any, ...]

# Deepest nesting of mappings and lists a spec may use (a spec needs 4: top level,
# slots, a slot, its shape).
MAX_YAML_DEPTH = 32
# Most values (scalars, lists, mappings; keys included) a spec may hold: the largest
# spec the limits on slots, params and presets allow fits well within it.
MAX_YAML_NODES = 250_000
# Integers a spec may write: |value| < INT_LIMIT (a signed 64-bit value).
INT_LIMIT = 2**63

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available: linear and fast
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


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
    # The document could not be read as a whole (syntax, or something refused above):
    # ``data`` is None and nothing else is worth checking.
    fatal: bool = False


class _Refused(Exception):
    def __init__(self, mark, message: str):
        super().__init__(message)
        self.line = mark.line + 1 if mark is not None else None
        self.message = message


def line_of_position(text: str, position: int) -> int:
    return text.count("\n", 0, max(position, 0)) + 1


def load_yaml(text: str, file: str, *, max_depth: int = MAX_YAML_DEPTH,
              max_nodes: int = MAX_YAML_NODES) -> LoadedYaml:
    """Parse ``text``; syntax errors, refused constructs and duplicate keys come back as issues."""
    locations = Locations(file)
    issues: List[SpecIssue] = []
    loader = _Loader(text)
    # Building many small containers makes the cyclic GC rescan the growing heap again
    # and again (quadratic in the file); nothing built here is cyclic.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        data = _compose(loader, locations, issues, max_depth, max_nodes)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        if "maximum nesting depth" in (exc.problem or ""):
            # libyaml (PyYAML >= 6.0.4) has its own, higher, depth limit, met before ours.
            issues.append(SpecIssue(file, line, _too_deep(max_depth)))
            return LoadedYaml(None, locations, issues, fatal=True)
        reason = exc.problem or str(exc)
        if exc.context:
            reason = f"{exc.context}, {reason}"
        issues.append(SpecIssue(file, line, f"YAML syntax error: {reason}"))
        return LoadedYaml(None, locations, issues, fatal=True)
    except yaml.reader.ReaderError as exc:
        char = exc.character
        shown = f"{char!r}" if isinstance(char, str) else f"#x{char:04x}" if isinstance(char, int) else "?"
        issues.append(SpecIssue(file, line_of_position(text, exc.position),
                                f"YAML syntax error: {exc.reason} (character {shown})"))
        return LoadedYaml(None, locations, issues, fatal=True)
    except yaml.YAMLError as exc:
        issues.append(SpecIssue(file, None, f"YAML syntax error: {shorten(str(exc), 200, quote=False)}"))
        return LoadedYaml(None, locations, issues, fatal=True)
    except _Refused as exc:
        issues.append(SpecIssue(file, exc.line, exc.message))
        return LoadedYaml(None, locations, issues, fatal=True)
    finally:
        loader.dispose()
        if gc_was_enabled:
            gc.enable()
    return LoadedYaml(data, locations, issues)


class _Frame:
    __slots__ = ("container", "path", "record", "key", "has_key", "key_line", "first_seen", "skip")

    def __init__(self, container, path: Path, record: bool):
        self.container, self.path, self.record = container, path, record
        self.key, self.has_key, self.key_line, self.skip = None, False, 0, False
        self.first_seen: Dict[Any, int] = {}


def _scalar(loader, event) -> Any:
    tag = loader.resolve(yaml.ScalarNode, event.value, event.implicit)
    if tag == _STR_TAG:
        return event.value
    if tag == _MERGE_TAG:
        raise _Refused(event.start_mark, "YAML merge keys (<<) are not allowed in a spec: write the keys out")
    node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
    try:
        value = loader.construct_object(node)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:
        reason = getattr(exc, "problem", None) or str(exc)
        raise _Refused(event.start_mark, f"cannot read the value {shorten(event.value)}: {reason}") from None
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT < value < INT_LIMIT:
        raise _Refused(event.start_mark, f"integer {shorten(event.value)} is out of range: "
                                         "spec integers must lie strictly between -2**63 and 2**63")
    return value


def _too_deep(max_depth: int) -> str:
    return f"YAML nesting deeper than {max_depth} levels: a spec needs only a few"


def _compose(loader, locations: Locations, issues: List[SpecIssue], max_depth: int, max_nodes: int) -> Any:
    loader.get_event()  # StreamStart
    if loader.check_event(yaml.StreamEndEvent):
        loader.get_event()
        return None
    loader.get_event()  # DocumentStart
    stack: List[_Frame] = []
    result: Any = None
    done = False
    nodes = 0
    while not done:
        event = loader.get_event()
        nodes += 1
        if nodes > max_nodes:
            raise _Refused(event.start_mark, f"more than {max_nodes} YAML values: a spec holds a few hundred")
        parent = stack[-1] if stack else None
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            frame = stack.pop()
            value = frame.container
        else:
            if isinstance(event, yaml.AliasEvent):
                raise _Refused(event.start_mark, "YAML aliases (*name) are not allowed in a spec: "
                                                 "write the value out")
            if event.anchor is not None:
                raise _Refused(event.start_mark, "YAML anchors (&name) are not allowed in a spec: "
                                                 "write the value out where it is used")
            if event.tag is not None:
                raise _Refused(event.start_mark, f"YAML tags ({shorten(event.tag)}) are not allowed in a spec")
            if parent is not None and isinstance(parent.container, dict) and not parent.has_key:
                # A mapping key.
                if not isinstance(event, yaml.ScalarEvent):
                    raise _Refused(event.start_mark, "mapping keys must be plain scalars, "
                                                     "not a list or a mapping (? [a, b]: …)")
                key = _scalar(loader, event)
                line = event.start_mark.line + 1
                parent.has_key, parent.key, parent.skip = True, key, False
                if key in parent.first_seen:
                    if parent.record:
                        issues.append(SpecIssue(
                            locations.file, line,
                            f"duplicate key {_key_text(key)} (first at line {parent.first_seen[key]}); "
                            "YAML would silently keep the last one: remove one of them"))
                    parent.skip = True
                else:
                    parent.first_seen[key] = line
                    if parent.record:
                        locations.lines[parent.path + (key,)] = line
                continue
            if parent is None:
                path, record = (), True
            elif isinstance(parent.container, dict):
                path, record = parent.path + (parent.key,), parent.record and not parent.skip
            else:
                path, record = parent.path + (len(parent.container),), parent.record
            if record:
                locations.lines.setdefault(path, event.start_mark.line + 1)
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(stack) >= max_depth:
                    raise _Refused(event.start_mark, _too_deep(max_depth))
                stack.append(_Frame({} if isinstance(event, yaml.MappingStartEvent) else [], path, record))
                continue
            if not isinstance(event, yaml.ScalarEvent):
                raise _Refused(event.start_mark, f"unexpected YAML event {type(event).__name__}")
            value = _scalar(loader, event)
        # Deliver a finished value to its parent.
        parent = stack[-1] if stack else None
        if parent is None:
            result, done = value, True
        elif isinstance(parent.container, dict):
            if not parent.skip:
                parent.container[parent.key] = value
            parent.has_key, parent.key, parent.skip = False, None, False
        else:
            parent.container.append(value)
    loader.get_event()  # DocumentEnd
    if not loader.check_event(yaml.StreamEndEvent):
        event = loader.peek_event()
        raise _Refused(event.start_mark, "a spec is one YAML document; remove the second one ('---')")
    return result


def _key_text(key: Any) -> str:
    return f"'{shorten(str(key), quote=False)}'"
