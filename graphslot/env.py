"""Every ``GRAPHSLOT_*`` environment variable, declared once, read through one parser per type.

A variable is declared here with its name, type, default and meaning, and read only
through :meth:`Variable.read`, so one spelling means one thing everywhere:

* ``bool``: ``1``, ``true``, ``yes``, ``on`` and ``0``, ``false``, ``no``, ``off`` (any
  case, spaces around ignored);
* ``bytes``: a positive integer number of bytes (``8589934592``; no units).

Empty (or only spaces) is unset: the default applies. Any other value is an
:class:`EnvError` (a ``ValueError``) naming the variable, the value and what it accepts,
raised where the variable is read (``build_registry``, a runner's construction, ...),
never a silent default. The README's table of variables is :func:`markdown_table`
(``tests/test_env.py`` checks it). Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple, Union

from .spec.errors import shorten

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A ``GRAPHSLOT_*`` variable holds a value its type does not accept."""


def parse_bool(name: str, value: str) -> Optional[bool]:
    """``value`` of the bool variable ``name``: True, False, or None when empty (unset)."""
    text = value.strip().lower()
    if not text:
        return None
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise EnvError(f"{name}={shorten(value)} is not a boolean: use {'/'.join(TRUE)} or {'/'.join(FALSE)}")


def parse_bytes(name: str, value: str) -> Optional[int]:
    """``value`` of the byte-count variable ``name``: a positive int, or None when empty (unset)."""
    text = value.strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise EnvError(f"{name}={shorten(text)} is not a byte count: set it to a positive integer number "
                       "of bytes (e.g. 8589934592 for 8 GiB), or unset it")
    return int(text)


#: type name -> (parser, the values it accepts, for the table)
PARSERS = {
    "bool": (parse_bool, f"{'/'.join(TRUE)}, {'/'.join(FALSE)}"),
    "bytes": (parse_bytes, "a positive integer (bytes)"),
}


@dataclass(frozen=True)
class Variable:
    """One environment variable: what it is called, what it holds and what it does."""

    name: str
    type: str  # a key of PARSERS
    default: str  # what applies when it is unset, in words
    meaning: str

    def __post_init__(self) -> None:
        if self.type not in PARSERS:
            raise ValueError(f"{self.name}: unknown type {self.type!r} (types: {', '.join(PARSERS)})")

    def read(self, environ: Optional[Mapping[str, str]] = None) -> Union[bool, int, None]:
        """The parsed value, None when unset or empty; EnvError when invalid."""
        value = (os.environ if environ is None else environ).get(self.name, "")
        return PARSERS[self.type][0](self.name, value)

    def enabled(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        """A bool variable's value, False when unset."""
        return bool(self.read(environ))


STRICT = Variable(
    "GRAPHSLOT_STRICT", "bool", "off",
    "strict mode for every registry built: dtype, device, aliasing and count checks on each "
    "`fill_from` / `extract` (read when a registry is built)")
DEBUG = Variable(
    "GRAPHSLOT_DEBUG", "bool", "off",
    "the replay guard of decode runners whose config leaves `guard=None`: before each replay, every slot "
    "buffer and static tensor must still have its capture-time address, shape and dtype")
EAGER_INPUT_NO_COPY = Variable(
    "GRAPHSLOT_EAGER_INPUT_NO_COPY", "bool", "off (copy)",
    "`EagerRunner`s built with `no_copy=None` run the model on the batch's own tensors instead of copying "
    "them into the slots")
MAX_BUFFER_BYTES = Variable(
    "GRAPHSLOT_MAX_BUFFER_BYTES", "bytes", "4294967296 (4 GiB)",
    "the cap on one registry's buffer bytes (a runner config's `max_bytes=` overrides it); checked before "
    "anything is allocated")
MAX_KV_BYTES = Variable(
    "GRAPHSLOT_MAX_KV_BYTES", "bytes", "the device's total memory",
    "the cap on a `PagedCache`'s KV pool bytes where `max_bytes=` is not given, and on `ContinuousBatcher`'s "
    "default KV budget; checked before anything is allocated")

SGLANG = Variable(
    "GRAPHSLOT_SGLANG", "bool", "off",
    "graphslot's sglang plugin, which sglang runs in each of its processes, switches sglang's runners to "
    "`graphslot.integrations.sglang` (`install()`; docs/sglang.md)")

VLLM = Variable(
    "GRAPHSLOT_VLLM", "bool", "off",
    "graphslot's vLLM plugin, which vLLM runs in each of its processes, switches vLLM 0.32's V1 model runner to "
    "`graphslot.integrations.vllm` (`install()`: `_prepare_inputs` fills `vllm.yaml`'s slots; docs/vllm.md)")

VARIABLES: Tuple[Variable, ...] = (STRICT, DEBUG, EAGER_INPUT_NO_COPY, MAX_BUFFER_BYTES, MAX_KV_BYTES, SGLANG, VLLM)
BY_NAME: Dict[str, Variable] = {v.name: v for v in VARIABLES}


def variable(name: str) -> Variable:
    """The declared variable ``name``; KeyError for one not declared here."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared graphslot environment variable "
                       f"(graphslot/env.py declares {', '.join(BY_NAME)})") from None


def markdown_table() -> str:
    """The README's table of the variables (one row each, in declaration order)."""
    lines = ["| variable | type | accepts | unset | meaning |", "|---|---|---|---|---|"]
    lines += [f"| `{v.name}` | {v.type} | {PARSERS[v.type][1]} | {v.default} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(lines) + "\n"


def set_defaults(values: Mapping[str, str]) -> None:
    """Set another program's environment variables (vLLM's, for the in-process engine graphslot's
    vLLM workload runs) where they are unset; graphslot's own are only read, through
    :meth:`Variable.read`. Every environment access of the package stays in this module."""
    for name, value in values.items():
        os.environ.setdefault(name, value)
