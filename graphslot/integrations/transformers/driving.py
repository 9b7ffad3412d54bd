"""The drivers over :meth:`~.engine.ContinuousBatcher.add_request` and ``step``: an
iterator of a set of requests' tokens as they come, and a run to the end."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence

from .requests import Request, TokenEvent


class Driving:
    """:meth:`stream` and :meth:`generate`, for a class with ``add_request``, ``abort`` and ``step``."""

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **params: Any) -> Iterator[TokenEvent]:
        """Queue ``prompts`` (each with :meth:`add_request`'s keywords ``params``, checked now:
        when one is refused, those queued before it are aborted) and return an iterator that steps the
        engine and yields their :class:`TokenEvent` s as they come, until all of them
        finished. Other requests in the engine advance too. Closing the iterator early
        aborts the unfinished ones."""
        reqs = self._add_all(prompts, max_new_tokens, params)

        def events() -> Iterator[TokenEvent]:
            mine = {req.rid for req in reqs}
            try:
                while not all(req.finished for req in reqs):
                    for event in self.step().events:
                        if event.rid in mine:
                            yield event
            finally:
                for req in reqs:
                    if not req.finished:
                        self.abort(req.rid)

        return events()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **params: Any) -> List[Request]:
        """Like :meth:`stream`, run to the end: the finished requests, in the order of ``prompts``."""
        reqs = self._add_all(prompts, max_new_tokens, params)
        while not all(req.finished for req in reqs):
            self.step()
        return reqs

    def _add_all(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, params: Dict[str, Any]) -> List[Request]:
        reqs: List[Request] = []
        try:
            for prompt in prompts:
                reqs.append(self.add_request(prompt, max_new_tokens, **params))
        except BaseException:
            for req in reqs:
                self.abort(req.rid)
            raise
        return reqs
