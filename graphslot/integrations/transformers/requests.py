"""A :class:`~.engine.ContinuousBatcher`'s requests, and what a step computes and hands out.

* :class:`Request`: one request's prompt, settings and output so far;
* :class:`TokenEvent`: one new token of one request (what streaming hands out);
* :class:`StepOutput`: what :meth:`~.engine.ContinuousBatcher.step` returns;
* :class:`Lane`, :class:`Pending`, :class:`Picks`: a step computed but not yet committed
  (the engine's all-or-nothing step: see :mod:`.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .sampling import Choice, SamplingParams

#: ``Request.finish_reason``: a stop token (EOS or ``stop_token_ids``) ended it.
FINISH_STOP = "stop"
#: ``Request.finish_reason``: it reached ``max_new_tokens``.
FINISH_LENGTH = "length"
#: ``Request.finish_reason``: :meth:`~.engine.ContinuousBatcher.abort` ended it.
FINISH_ABORT = "abort"
#: ``Request.finish_reason``: a step failed because of it (``Request.error``), and it was dropped.
FINISH_ERROR = "error"


class RequestFailed(RuntimeError):
    """What a stream of a request, or ``generate`` of it, raises when a step failed because
    of it (the request's ``error`` is the cause)."""

    def __init__(self, rid: int, error: BaseException):
        super().__init__(f"request {rid} failed and was dropped: a step failed because of it alone "
                         f"({type(error).__name__}: {error})")
        self.rid = rid


class TokenEvent(NamedTuple):
    """One new token of one request: what streaming hands out."""

    rid: int
    token: int
    #: Its index in the request's output.
    index: int
    #: log p(token) under the model (when the request asked for logprobs).
    logprob: Optional[float] = None
    #: The ``top_logprobs`` most likely ``(token, logprob)`` pairs, most likely first (when asked).
    top_logprobs: Optional[List[Tuple[int, float]]] = None
    #: Set on the request's last token: ``"stop"`` or ``"length"``.
    finish_reason: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# -- requests and steps ---------------------------------------------------------------
@dataclass(eq=False)
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    output: List[int] = field(default_factory=list)
    row: int = 0  # request-pool row once admitted (0: not admitted)
    slots: List[int] = field(default_factory=list)  # KV slot per cached position
    finished: bool = False
    #: FINISH_STOP, FINISH_LENGTH, FINISH_ABORT or FINISH_ERROR once finished.
    finish_reason: Optional[str] = None
    #: What a step raised because of this request alone (finish_reason FINISH_ERROR).
    error: Optional[BaseException] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: Token ids that end the request (its EOS ids and stop_token_ids), sorted.
    stop_token_ids: Tuple[int, ...] = ()
    #: The stop tokens are masked (-inf) until the output has this many tokens.
    min_new_tokens: int = 0
    #: The logprob of each output token (None: not asked).
    logprobs: Optional[List[float]] = None
    #: Per output token, the ``top_n`` most likely ``(token, logprob)`` (None: not asked).
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    top_n: int = 0
    #: log p(prompt[i] | prompt[:i]) for each prompt token, None for the first (filled at
    #: prefill when asked; None: not asked).
    prompt_logprobs: Optional[List[Optional[float]]] = None
    wants_prompt_logprobs: bool = False
    #: Called with each :class:`TokenEvent` of this request, after the step committed.
    on_token: Optional[Callable[[TokenEvent], Any]] = None

    @property
    def cached(self) -> int:
        """Tokens in the KV cache; the last output token is not yet among them."""
        return len(self.slots)

    def event(self, index: int) -> TokenEvent:
        """The :class:`TokenEvent` of output token ``index`` (as its step handed it out)."""
        last = index == len(self.output) - 1 and self.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        return TokenEvent(self.rid, self.output[index], index, None if self.logprobs is None else self.logprobs[index],
                          None if self.top_logprobs is None else self.top_logprobs[index],
                          self.finish_reason if last else None)

    @property
    def need(self) -> int:
        """KV slots the request holds at most: the prompt and every new token but the last."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclass
class StepOutput:
    """What one step did; logits rows are copies (``[vocab]`` each)."""

    prefill_logits: Dict[int, torch.Tensor] = field(default_factory=dict)
    #: rid -> (token fed, logits it produced)
    decode: Dict[int, tuple] = field(default_factory=dict)
    #: Rows the decode ran (a request whose first token ended it was decoded once in vain).
    decode_batch_size: int = 0
    decode_graph: bool = False
    #: Wall time of the decode: building the batch, the runner, sampling, the read.
    decode_seconds: float = 0.0
    #: The new tokens, in the order they joined the outputs (prefill's first).
    events: List[TokenEvent] = field(default_factory=list)
    finished: List[int] = field(default_factory=list)
    #: Requests whose :meth:`~.engine.ContinuousBatcher.abort` came while the step ran (and that
    #: did not finish in it): they got the step's tokens and left at its end.
    aborted: List[int] = field(default_factory=list)
    #: Requests a failed attempt at this step raised for alone: dropped (FINISH_ERROR,
    #: ``Request.error``) and the step computed again without them.
    failed: List[int] = field(default_factory=list)


class Lane(NamedTuple):
    """One request's row of a step's decode."""

    req: Request
    row: int
    position: int  # where the fed token goes: the request's cached tokens
    fed: Optional[int]  # None: the token its prefill drew this step (still on the device)
    emitted: int  # output tokens before this decode's


@dataclass
class Pending:
    """A computed step not yet committed: what it took from the pool, what it will change."""

    out: StepOutput = field(default_factory=StepOutput)
    rows: List[int] = field(default_factory=list)  # taken from the pool, for rollback
    slots: List[int] = field(default_factory=list)
    admitted: List[Tuple[Request, int, List[int]]] = field(default_factory=list)  # (request, row, prompt slots)
    lanes: List[Lane] = field(default_factory=list)
    decode_slots: List[int] = field(default_factory=list)  # one per lane
    prompt_logprobs: List[Tuple[Request, List[Optional[float]]]] = field(default_factory=list)
    tokens: List[Tuple[Request, TokenEvent]] = field(default_factory=list)  # in the order they are appended
    ending: List[Tuple[Request, str]] = field(default_factory=list)

    def record(self, req: Request, index: int, token: int, logprob: Optional[float],
               top: Optional[List[Tuple[int, float]]], ended: set) -> None:
        """Record token ``index`` of ``req`` (to commit), and whether it ends the request."""
        reason = (FINISH_STOP if token in req.stop_token_ids
                  else FINISH_LENGTH if index + 1 >= req.max_new_tokens else None)
        self.tokens.append((req, TokenEvent(req.rid, token, index, None if req.logprobs is None else logprob,
                                            None if req.top_logprobs is None else top[:req.top_n], reason)))
        if reason is not None:
            self.ending.append((req, reason))
            ended.add(req.rid)


class Picks(NamedTuple):
    """Where a phase's :class:`Choice` (prefill's or decode's) lies in the step's one read."""

    first: int  # index of its tokens among the read tensors
    logprobs: bool
    top: int  # n of its top logprobs (0: none)

    @classmethod
    def add(cls, choice: Choice, reads: List[torch.Tensor]) -> Picks:
        picks = cls(len(reads), choice.logprobs is not None, 0 if choice.top_ids is None else choice.top_ids.shape[1])
        reads.extend(t for t in choice if t is not None)
        return picks

    def get(self, host: List[List[Any]]) -> Tuple[List[int], Optional[List[float]], Optional[List[List[Tuple]]]]:
        tokens = host[self.first]
        logprobs = host[self.first + 1] if self.logprobs else None
        top = None
        if self.top:
            ids = host[self.first + 2]
            values = host[self.first + 3]
            n = self.top
            top = [list(zip(ids[i * n:(i + 1) * n], values[i * n:(i + 1) * n])) for i in range(len(tokens))]
        return tokens, logprobs, top


def reentered(notifying: bool) -> str:
    """Why ``step()`` is refused now: a step runs, or its ``on_token`` callbacks do."""
    if notifying:
        return ("ContinuousBatcher.step() called while a step's on_token callbacks run (from a callback, or another "
                "thread): call it after step() returns")
    return "ContinuousBatcher.step() is already running: call it from one thread at a time, and not from sample"


def notify(tokens: List[Tuple[Request, TokenEvent]]) -> None:
    """The step's ``on_token`` callbacks, in token order; the first error is raised at the end."""
    error = None
    for req, event in tokens:
        if req.on_token is not None:
            try:
                req.on_token(event)
            except Exception as exc:  # noqa: BLE001 - the other requests' callbacks still run
                if error is None:
                    exc.add_note(f"graphslot: raised by the on_token callback of request {req.rid}; the step was "
                                 "committed (its tokens are in the requests' outputs)")
                    error = exc
    if error is not None:
        raise error
