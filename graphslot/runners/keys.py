"""What one graph serves (:class:`GraphKey`) and what one step is (:class:`BatchDescriptor`).

A :class:`GraphKey` names one captured graph of one capture mode:

* ``full`` (decode): ``size`` is the batch size, ``bucket`` the context bucket (None
  without context buckets);
* ``piecewise``: ``size`` is the token count, ``bucket`` the request slots (None: a
  piecewise graph never sees the request count, so it serves any);
* ``variant``: what the graphs differ in beyond shape, as the adapter declares it
  (``variants``, ``variant(fb)``): ``""`` is the base, ``"lora"`` one with a LoRA, say.

A :class:`BatchDescriptor` is a step as the dispatcher
(:class:`~graphslot.runners.dispatcher.Dispatcher`) sees it, before it is padded. The
two are plain named tuples: hashable, cheap, and printed as what they are.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class GraphKey(NamedTuple):
    """One graph: its size, its bucket (or None) and its variant."""

    #: Full (decode): the batch size; piecewise: the token count.
    size: int
    #: Full (decode): the context bucket; piecewise: the request slots; None: any.
    bucket: Optional[int] = None
    #: Declared by the adapter; ``""`` is the base variant.
    variant: str = ""


class BatchDescriptor(NamedTuple):
    """One step before padding: what the dispatcher picks a graph by."""

    #: Tokens in the step (a decode step: one per request, ``k`` for target-verify).
    num_tokens: int
    #: Requests in the step.
    num_reqs: int
    #: Every request has the same query length the full graphs were captured for (a
    #: decode step): only such a step can replay a full graph.
    uniform: bool
    #: The longest context (what a context bucket must hold); None: not known, so no
    #: bucketed key holds it.
    context: Optional[int] = None
    #: The variant the step needs.
    variant: str = ""
