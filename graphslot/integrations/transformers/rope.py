"""Rotary embeddings whose frequencies depend on the sequence's length, chosen per row.

transformers' ``ROPE_INIT_FUNCTIONS`` compute most rope types' frequencies once, when
the model is built (``linear``, ``yarn``, ``llama3``, ``proportional``, the default):
those depend on positions only, so every row of a batch gets what it gets alone. Two
types change with the length, in ``dynamic_rope_update`` around the rotary forward:

* ``longrope`` (Phi-3 and Phi-3.5 long-context checkpoints, any Llama-like config): the
  long factors when the forward's longest sequence passes
  ``original_max_position_embeddings``, the short ones otherwise. transformers picks
  one set for the whole batch (``torch.max(position_ids) + 1``), so a short request
  beside a long one got the long factors and other tokens. Here the choice is per row
  (:func:`per_row_rope`): a row takes the long factors when its own last position is at
  least ``original_max_position_embeddings``, which is what ``generate`` gives the
  request alone (a batch of one: its own length). Both sets are computed and the row
  picks with ``torch.where``, so nothing is read on the host and the choice is captured
  with the graph.
* ``dynamic`` (NTK scaling): the frequencies follow the longest sequence seen, kept as
  module state between forwards and updated after a host read of the length
  (``if seq_len > max_seq_len_cached``): a graph cannot capture that, and the rows of a
  batch would share it. Refused at construction (:func:`rope_problem`), naming it.

Phi-3 (and PhiMoE) also re-run the whole sequence in ``generate`` at the step where it
passes ``original_max_position_embeddings`` (``prepare_inputs_for_generation`` drops the
cache there), so every cached key is recomputed with the long factors; the paged cache
keeps the keys it computed, so such a request is refused when it is added
(:func:`crossing_problem`).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

#: The code object of every ``dynamic_rope_update`` wrapper (a closure of one function).
_UPDATE_CODE = dynamic_rope_update(lambda self, x, position_ids: None).__code__
#: Families whose ``generate`` recomputes the whole sequence when a longrope request
#: passes ``original_max_position_embeddings`` (their ``prepare_inputs_for_generation``).
RECOMPUTES_AT_THE_SWITCH = ("phi3", "phimoe")


class _Switch(NamedTuple):
    """One longrope (module, layer type) of a model: its short and long frequencies."""

    module: torch.nn.Module
    layer_type: Optional[str]
    short: torch.Tensor
    long: torch.Tensor
    #: A row whose last position is at least this takes the long frequencies.
    original: int


_PLANS: "weakref.WeakKeyDictionary[Any, Tuple[_Switch, ...]]" = weakref.WeakKeyDictionary()


def _updated(module: torch.nn.Module) -> bool:
    """Whether the module's forward runs ``dynamic_rope_update`` (the length-dependent update)."""
    fn = type(module).forward
    while fn is not None:
        if getattr(fn, "__code__", None) is _UPDATE_CODE:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _rope_types(module: torch.nn.Module) -> Dict[Optional[str], str]:
    """layer type (None: one for all) -> rope type, of a rotary module that updates with the length."""
    kinds = getattr(module, "rope_type", None)
    if not isinstance(kinds, (str, dict)) or not _updated(module):
        return {}
    return {None: kinds} if isinstance(kinds, str) else dict(kinds)


def rope_types(model: Any) -> List[str]:
    """The length-dependent rope types ``model`` runs (``longrope``, ``dynamic``...), sorted."""
    found = {kind for module in model.modules() for kind in _rope_types(module).values()}
    return sorted(kind for kind in found if kind == "longrope" or "dynamic" in kind)


def rope_problem(model: Any) -> Optional[str]:
    """Why the model's rope cannot be served (a ``dynamic`` type), or None."""
    dynamic = [kind for kind in rope_types(model) if "dynamic" in kind]
    if not dynamic:
        return None
    return (f"rope_type {dynamic[0]!r} (config.rope_parameters) is not supported: its frequencies follow the longest "
            "sequence of each forward and transformers keeps them as module state between forwards, updated after "
            "reading that length on the host (dynamic_rope_update), so a captured graph cannot follow them and the "
            "rows of a batch would share them. Serve the checkpoint with a rope type that does not depend on the "
            "length ('default', 'linear', 'yarn', 'llama3'), or 'longrope' (chosen per request)")


def longrope_original(model: Any) -> Optional[int]:
    """``original_max_position_embeddings`` of the model's longrope (None: no longrope)."""
    switches = plan(model)
    return min(s.original for s in switches) if switches else None


def crossing_problem(model: Any, prompt_len: int, max_new_tokens: int) -> Optional[str]:
    """Why a request of this size cannot be served as ``generate`` serves it (a longrope
    Phi-3 request that passes ``original_max_position_embeddings``: see the module
    docstring), or None. Its decodes feed positions ``prompt_len .. prompt_len +
    max_new_tokens - 2``; generate recomputes at position ``original``."""
    original = longrope_original(model)
    if original is None or getattr(model.config, "model_type", None) not in RECOMPUTES_AT_THE_SWITCH:
        return None
    if not prompt_len <= original <= prompt_len + max_new_tokens - 2:
        return None
    return (f"a request of {prompt_len} prompt tokens and {max_new_tokens} new tokens passes the longrope switch at "
            f"original_max_position_embeddings={original}: there {type(model).__name__}.generate recomputes the "
            "whole sequence with the long factors (prepare_inputs_for_generation drops the cache), which the paged "
            f"cache does not do. Keep prompt + max_new_tokens - 1 <= {original}, or send a prompt of more than "
            f"{original} tokens (long factors from the start)")


def plan(model: Any) -> Tuple[_Switch, ...]:
    """The model's longrope switches (made once per model: the long frequencies are
    computed as transformers computes them, ``seq_len=original + 1``)."""
    found = _PLANS.get(model)
    if found is None:
        found = _PLANS[model] = tuple(_switches(model))
    return found


def _switches(model: Any) -> Iterator[_Switch]:
    for module in model.modules():
        for layer_type, kind in _rope_types(module).items():
            if kind != "longrope":
                continue
            params = module.config.rope_parameters
            params = params if layer_type is None else params[layer_type]
            original = int(params["original_max_position_embeddings"])
            prefix = "" if layer_type is None else f"{layer_type}_"
            short = getattr(module, f"{prefix}original_inv_freq")
            long, _ = ROPE_INIT_FUNCTIONS[kind](module.config, short.device, seq_len=original + 1,
                                                layer_type=layer_type)
            yield _Switch(module, layer_type, short, long.to(short.device), original)


class _Frequencies:
    """The rotary module as its forward reads it, with ``inv_freq`` (of a layer type) replaced."""

    def __init__(self, module: torch.nn.Module, name: str, inv_freq: torch.Tensor):
        self._module = module
        setattr(self, name, inv_freq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _per_row_forward(module: torch.nn.Module, switches: Dict[Optional[str], _Switch]):
    """The module's forward with each row's frequencies chosen by its own last position."""
    inner = inspect.unwrap(type(module).forward, stop=lambda fn: getattr(fn, "__code__", None) is _UPDATE_CODE)
    inner = getattr(inner, "__wrapped__", inner)  # below the update: the forward that reads inv_freq

    def forward(x: torch.Tensor, position_ids: torch.Tensor, layer_type: Optional[str] = None, **kwargs: Any):
        switch = switches.get(layer_type)
        if layer_type is not None:
            kwargs["layer_type"] = layer_type
        if switch is None:  # a layer type of another rope: transformers' own forward
            return type(module).forward(module, x, position_ids, **kwargs)
        name = "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"
        cos, sin = inner(_Frequencies(module, name, switch.short), x, position_ids, **kwargs)
        cos_long, sin_long = inner(_Frequencies(module, name, switch.long), x, position_ids, **kwargs)
        if cos.shape[0] != position_ids.shape[0]:
            raise RuntimeError(f"{type(module).__name__}: per-row longrope needs cos/sin with the batch first, got "
                               f"{tuple(cos.shape)} for position_ids {tuple(position_ids.shape)}")
        long = (position_ids.reshape(position_ids.shape[0], -1).amax(-1) >= switch.original)
        long = long.view(-1, *([1] * (cos.dim() - 1)))
        return torch.where(long, cos_long, cos), torch.where(long, sin_long, sin)

    return forward


@contextlib.contextmanager
def per_row_rope(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s longrope modules choose short or long frequencies per
    row (bound on those module instances only; nothing for a model without longrope)."""
    switches = plan(model)
    if not switches:
        yield
        return
    by_module: Dict[int, Tuple[torch.nn.Module, Dict[Optional[str], _Switch]]] = {}
    for switch in switches:
        by_module.setdefault(id(switch.module), (switch.module, {}))[1][switch.layer_type] = switch
    patched = []
    try:
        for module, of_module in by_module.values():
            module.forward = _per_row_forward(module, of_module)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
