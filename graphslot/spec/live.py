"""``live: true`` params (slot_specs/README.md): providers ``(ctx) -> value`` given at build, called
on a hook's first read of ``ctx.params[name]`` in a fill. A provider's failure is a :class:`LiveParamError`,
a SlotError: never a KeyError that ``ctx.params.get`` would read as "absent". Torch-free."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional

from .errors import SlotError, shorten


class LiveParamError(SlotError):
    """A live param's provider failed: it raised (the original is ``__cause__``),
    returned a value of another type, or read its own param."""


def naming_slot(hook: Callable, slot: str) -> Callable:
    """``hook``, whose live-param failures name ``slot`` (the provider's own exception stays the cause)."""

    def named(*args):
        try:
            return hook(*args)
        except LiveParamError as exc:
            raise SlotError(f"slot '{slot}': {exc}") from exc.__cause__

    return named


class Live:
    """A ``live: true`` param's provider ``fn(ctx) -> value``: ``build_registry(params={"attn_tp_rank":
    lambda ctx: group.rank()})`` wraps a callable given for a live param in one."""

    __slots__ = ("fn", "check")

    def __init__(self, fn: Callable[[Any], Any], check: Optional[Callable[[Any], Any]] = None):
        #: ``check(value) -> value``, ValueError for another type than the param's (``resolve_params`` sets it).
        self.fn = fn
        self.check = check

    def __repr__(self) -> str:
        return f"Live({getattr(self.fn, '__qualname__', type(self.fn).__name__)})"


# a live param not read yet this fill; being read
_UNREAD = object()
_READING = object()


class LiveParams(Mapping):
    """``ctx.params`` of a registry with live params: the resolved params, each live
    one evaluated by its provider on first read during this fill."""

    __slots__ = ("_values", "_providers", "_evaluated", "ctx")

    def __init__(self, values: Mapping[str, Any], providers: Mapping[str, "Live"]):
        self._values = values
        self._providers = providers
        self._evaluated = {}
        self.ctx = None

    def __getitem__(self, name: str) -> Any:
        provider = self._providers.get(name)
        if provider is None:
            return self._values[name]
        value = self._evaluated.get(name, _UNREAD)
        if value is _READING:
            raise LiveParamError(
                f"live param '{name}': its provider reads ctx.params['{name}'] itself (a provider "
                "computes the value; it cannot read it)"
            )
        if value is not _UNREAD:
            return value
        self._evaluated[name] = _READING
        try:
            value = provider.fn(self.ctx)
        except LiveParamError:
            raise
        except Exception as exc:
            raise LiveParamError(
                f"live param '{name}': its provider raised {type(exc).__name__}: {shorten(str(exc), quote=False)}"
            ) from exc
        finally:
            self._evaluated.pop(name)
        try:
            value = self._evaluated[name] = value if provider.check is None else provider.check(value)
        except ValueError as exc:
            raise LiveParamError(f"live {exc}") from None
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


ContextFactory = Callable[..., Any]


def _providers(params: Mapping[str, Any]) -> Mapping[str, Live]:
    return {name: value for name, value in params.items() if isinstance(value, Live)}


def context_factory(make: ContextFactory, params: Mapping[str, Any]) -> ContextFactory:
    """How a registry makes each fill's context with ``make`` (:class:`FillContext` or an engine's own type):
    ``ctx.params`` a :class:`LiveParams` when some param is :class:`Live`, else ``make`` itself."""
    providers = _providers(params)
    if not providers:
        return make

    def make_live(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, params, side_inputs=None):
        live = LiveParams(params, providers)
        ctx = live.ctx = make(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, live, side_inputs)
        return ctx

    return make_live


def live_view(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """``params`` for a context made outside a fill (``pre_capture``'s): a
    :class:`LiveParams` whose ``ctx`` the caller sets, or ``params`` itself."""
    providers = _providers(params)
    return LiveParams(params, providers) if providers else params
