"""A step that fails because of one request: that request is dropped, the others go on.

A failed step changes nothing (:mod:`.engine`). Before it raises, the engine asks
whether one request is to blame: it computes the step again for each of its requests
alone (admitted or running; nothing is committed, the rows and slots go back). The
requests that fail alone while the others run alone are to blame: each is dropped with
``finish_reason`` ``"error"`` and the exception it raised as ``Request.error`` (its
stream, and ``generate`` of it, raise :class:`~.requests.RequestFailed`), and the step
is computed again without them (``StepOutput.failed`` names them). Otherwise (a step
of one request, every request failing alone, or none: a failure of the engine, the
model or ``sample``, or a passing one) the step raises as before, and a retried
``step()`` gives the tokens of an uninterrupted run. A ``BaseException`` that is not an
``Exception`` (``KeyboardInterrupt``) is never looked into.

The search costs one forward per request of the failed step, on failure only.
"""

from __future__ import annotations

from typing import Dict, List

from .requests import FINISH_ERROR, Pending, Request


class Recovery:
    """For :class:`~.engine.ContinuousBatcher`: uses its ``running``, ``_lock``,
    ``_compute(p, only=)``, ``_release(p)`` and ``_drop(req, reason)``."""

    def _recover(self, failed: Pending, error: Exception) -> Pending:
        """The step computed again without the requests to blame for ``error`` (dropped
        now); ``error`` raised when no request alone is to blame. ``failed``'s rows and
        slots are already back."""
        involved: List[Request] = list(self.running) + [req for req, _, _ in failed.admitted]
        if len(involved) < 2:
            raise error
        blamed: Dict[Request, Exception] = {}
        for req in involved:
            probe = Pending()
            try:
                self._compute(probe, only=req)
            except Exception as exc:  # noqa: BLE001 - any failure of the request alone blames it
                blamed[req] = exc
            finally:
                self._release(probe)
        if not blamed or len(blamed) == len(involved):
            raise error
        with self._lock:
            for req, exc in blamed.items():
                req.error = exc
                self._drop(req, FINISH_ERROR)
        pending = Pending()
        pending.out.failed = [req.rid for req in blamed]
        try:
            self._compute(pending)
        except BaseException:
            self._release(pending)
            raise
        return pending
