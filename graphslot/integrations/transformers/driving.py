"""The drivers over :meth:`~.engine.ContinuousBatcher.add_request` and ``step``: an
iterator of a set of requests' tokens as they come, and a run to the end."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence

from .requests import FINISH_ERROR, Request, RequestFailed, TokenEvent


def raise_failed(reqs: Sequence[Request]) -> None:
    """Raise :class:`RequestFailed` for the first of ``reqs`` a step failed because of."""
    for req in reqs:
        if req.finish_reason == FINISH_ERROR:
            raise RequestFailed(req.rid, req.error) from req.error


class Driving:
    """:meth:`stream` and :meth:`generate`, for a class with ``add_request``, ``abort`` and
    ``step``, and ``_lock``: the lock its steps commit under."""

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **params: Any) -> Iterator[TokenEvent]:
        """Queue ``prompts`` (each with :meth:`add_request`'s keywords ``params``, checked now:
        when one is refused, those queued before it are aborted) and return an iterator of
        their :class:`TokenEvent` s, each request's in order, until all of them finished.
        It hands out every token of its requests, whoever stepped the engine (this
        iterator, another one, or ``step()``); when it has none to hand out it steps the
        engine itself (other requests advance too). Closing the iterator (``close()``,
        or dropping it), even before its first token, aborts the unfinished ones. When a
        step failed because of one of them (:mod:`.recovery`), it raises
        :class:`~.requests.RequestFailed` after that request's tokens (and aborts the others)."""
        reqs = self._add_all(prompts, max_new_tokens, params)

        def events() -> Iterator[Any]:
            sent = [0] * len(reqs)  # tokens handed out, per request
            try:
                yield None  # the priming step below: close() now runs the finally
                while True:
                    with self._lock:  # a step commits under it: the outputs are whole
                        new = [req.event(i) for req, n in zip(reqs, sent) for i in range(n, len(req.output))]
                        sent = [len(req.output) for req in reqs]
                        done = all(req.finished for req in reqs)
                    yield from new
                    raise_failed(reqs)
                    if done:
                        return
                    if not new:
                        self.step()
            finally:
                for req in reqs:
                    if not req.finished:
                        self.abort(req.rid)

        stream = events()
        next(stream)  # started, so that closing it before its first token aborts too
        return stream

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **params: Any) -> List[Request]:
        """Like :meth:`stream`, run to the end: the finished requests, in the order of
        ``prompts`` (:class:`~.requests.RequestFailed` when a step failed because of one,
        once all of them finished)."""
        reqs = self._add_all(prompts, max_new_tokens, params)
        while not all(req.finished for req in reqs):
            self.step()
        raise_failed(reqs)
        return reqs

    def _add_all(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, params: Dict[str, Any]) -> List[Request]:
        reqs: List[Request] = []
        try:
            for i, prompt in enumerate(prompts):
                try:
                    reqs.append(self.add_request(prompt, max_new_tokens, **params))
                except (TypeError, ValueError) as exc:
                    if type(exc) not in (TypeError, ValueError):
                        raise
                    raise type(exc)(f"prompts[{i}]: {exc}") from exc  # which of the prompts was refused
        except BaseException:
            for req in reqs:
                self.abort(req.rid)
            raise
        return reqs
