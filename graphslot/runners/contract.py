"""The adapter contract, checked when a runner is built, and what an adapter declares static.

:func:`check_adapter` runs first in every runner's constructor: every hook the adapter
must implement and does not is named in one :class:`AdapterContractError` (with the
adapter class), and the device the registry and graphs live on is the adapter's
``device`` or, without one, the device of its model's weights -- never a silent default.

A graph may read the adapter's static tensors without their being stale inputs:
``static_tensors()`` (pools, metadata buffers) and, by default, the parameters and
buffers of the adapter's models (``static_modules()``; by default
:func:`module_attributes`, its ``nn.Module`` attributes, ``self.model`` included).
:func:`named_statics` lists both, each tensor once.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn


class AdapterContractError(TypeError):
    """The adapter lacks hooks a runner needs, or a device; every one is named."""


def _implemented(adapter: Any, base: type, name: str) -> bool:
    """Whether ``adapter`` provides ``name`` itself: set on the instance, or defined on
    its class other than as ``base``'s placeholder (an attribute, a property, a method)."""
    if name in getattr(adapter, "__dict__", {}):
        return True
    found = inspect.getattr_static(type(adapter), name, None)
    return found is not None and found is not base.__dict__.get(name)


def missing_hooks(adapter: Any, base: type, required: Sequence[str]) -> List[str]:
    """The names among ``required`` that ``adapter`` leaves to ``base``'s placeholders."""
    return [name for name in required if not _implemented(adapter, base, name)]


def module_attributes(adapter: Any) -> List[Tuple[str, nn.Module]]:
    """``(attribute, module)`` for the adapter's ``nn.Module`` attributes (``self.model``
    set in ``__init__``, a class attribute or a ``model`` property alike), in attribute
    order, each module once."""
    found: List[Tuple[str, nn.Module]] = []
    names = list(getattr(adapter, "__dict__", {}))
    if "model" not in names:
        names.append("model")
    for name in names:
        try:
            value = getattr(adapter, name, None)
        except Exception:  # noqa: BLE001 - a property that cannot answer yet has no module
            continue
        if isinstance(value, nn.Module) and all(value is not m for _, m in found):
            found.append((name, value))
    return found


class AdapterStatics:
    """What both adapter bases declare static by default (a graph may read it)."""

    def static_modules(self) -> Iterable[Tuple[str, nn.Module]]:
        """``(name, module)`` pairs whose parameters and buffers a graph may read as
        static (the weights). Default: the adapter's ``nn.Module`` attributes
        (``self.model = model`` is enough; :func:`module_attributes`); override to name
        others, or none."""
        return module_attributes(self)

    def static_tensors(self) -> Iterable[torch.Tensor]:
        """Tensors besides the models' weights that a graph may read and that are
        legitimately static: KV and request pools, attention metadata buffers. Anything
        else a graph reads that is not a slot buffer is a stale input (see
        ``external_inputs``)."""
        return ()

    def named_static_tensors(self) -> Iterable[Tuple[str, torch.Tensor]]:
        """``static_tensors()`` with names, for the replay guard's messages
        (:mod:`graphslot.runners.guard`); override it to name them."""
        for i, tensor in enumerate(self.static_tensors()):
            yield f"#{i} of {type(self).__name__}.static_tensors()", tensor


def named_statics(adapter: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every tensor the adapter declares static, named, each once: its
    ``named_static_tensors()``, then the parameters and buffers of its
    ``static_modules()`` (``model.layers.0.weight``)."""
    seen: set = set()
    for name, tensor in adapter.named_static_tensors():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor
    for attr, module in adapter.static_modules():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield f"{attr}.{name}", tensor


def statics(adapter: Any) -> List[torch.Tensor]:
    """:func:`named_statics` without the names."""
    return [tensor for _, tensor in named_statics(adapter)]


def model_device(adapter: Any) -> Tuple[Optional[torch.device], str]:
    """The one device of the adapter's models' weights, or None, and why not."""
    devices = {}
    for attr, module in adapter.static_modules():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            devices.setdefault(tensor.device, f"{attr}.{name}")
    if len(devices) == 1:
        return next(iter(devices)), ""
    if not devices:
        return None, "no model with weights to take it from (no nn.Module attribute with parameters or buffers)"
    where = ", ".join(f"{name} on {device}" for device, name in devices.items())
    return None, f"its model's weights are on several devices ({where}), so the runner cannot pick one"


def check_adapter(adapter: Any, base: type, required: Sequence[str]) -> torch.device:
    """The device the runner puts its buffers and graphs on; raises
    :class:`AdapterContractError` naming every hook ``adapter`` (a ``base``) lacks, and
    the device when it has none and its model cannot give one."""
    cls = type(adapter).__name__
    problems = []
    missing = missing_hooks(adapter, base, required)
    if missing:
        problems.append(f"does not implement {len(missing)} required hook{'s' if len(missing) > 1 else ''}: "
                        f"{', '.join(missing)}")
    device = getattr(adapter, "device", None)
    if device is None:
        why = "no static_modules() to take it from"
        if callable(getattr(adapter, "static_modules", None)):
            device, why = model_device(adapter)
        if device is None:
            problems.append(f"has no `device` and {why}: set `device = torch.device(...)` on the adapter")
    if problems:
        raise AdapterContractError(f"{cls} (a {base.__name__}) " + "; and it ".join(problems)
                                   + f"; see {base.__name__}'s docstring, or docs/engine.md")
    try:
        return torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise AdapterContractError(f"{cls}.device is {device!r}, not a device: {exc}") from None


def hook_count(adapter: Any, hook: str, fb: Any, means: str) -> int:
    """What ``adapter.<hook>(fb)`` returns, as an int a DP exchange sends (0 to 2**63-1); else a TypeError or
    ValueError naming the hook. Checked before the exchange it fails every rank; inside it, it failed that rank
    alone (its peers hung) and a float went truncated."""
    value = getattr(adapter, hook)(fb)
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or not 0 <= n < 2**63:
        what = f"{type(adapter).__name__}.{hook} returned {value!r}"[:200]
        raise (TypeError if n is None else ValueError)(f"{what}; it must be an int >= 0 ({means}, what the ranks "
                                                       "exchange)")
    return n
