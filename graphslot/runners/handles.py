"""Split-op handles: an integer naming a Python object to a custom op.

A custom op takes tensors and scalars, not Python objects, so a split op that needs one
(an attention backend, an attention module, prefill metadata) is given an integer handle
(:func:`op_handle`) and reads the object back when it runs (:func:`op_object`). Handles
hold their objects weakly: a model dropped after its runner is released is freed, and a
split op that still runs after that gets a LookupError saying so.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Dict, Set

_OP_OBJECTS: Dict[int, "weakref.ref[Any]"] = {}
_NEXT_HANDLE = itertools.count(1)


def op_handle(obj: Any) -> int:
    """An integer naming ``obj`` to a split op (a custom op takes no Python objects): one per
    object, kept on it as ``obj._graphslot_handle``, which :func:`op_object` reads back when
    the op runs. The handle holds ``obj`` weakly: a model dropped with its runner is freed
    (``obj`` must take weak references, as modules and plain objects do)."""
    handle = getattr(obj, "_graphslot_handle", None)
    if handle is None or op_object_or_none(handle) is not obj:
        handle = next(_NEXT_HANDLE)
        try:
            _OP_OBJECTS[handle] = weakref.ref(obj, functools.partial(_forget, handle))
        except TypeError:
            raise TypeError(f"op_handle() needs an object that takes weak references; a {type(obj).__name__} does "
                            "not (give its class __weakref__ in __slots__, or pass an object that holds it)") from None
        obj._graphslot_handle = handle
    return handle


def _forget(handle: int, _ref: Any) -> None:
    _OP_OBJECTS.pop(handle, None)
    _FREED.add(handle)


#: Handles whose objects were freed: op_object says so rather than "never given out".
_FREED: Set[int] = set()


def op_object_or_none(handle: int) -> Any:
    """The object :func:`op_handle` named ``handle``, or None (never named, or freed)."""
    ref = _OP_OBJECTS.get(handle)
    return None if ref is None else ref()


def op_object(handle: int) -> Any:
    """The object :func:`op_handle` named ``handle``; a LookupError once it was freed."""
    obj = op_object_or_none(handle)
    if obj is not None:
        return obj
    if handle in _FREED:
        raise LookupError(f"split-op handle {handle} names an object that was freed: a split op ran after the model "
                          "(or attention backend) it belongs to was dropped")
    raise LookupError(f"split-op handle {handle} was never given out by op_handle()")
