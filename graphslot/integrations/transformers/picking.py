"""How a :class:`~.engine.ContinuousBatcher` picks tokens: each request's sampling
parameters, what each row blocks, and the built-in sampler or the ``sample`` escape hatch."""

from __future__ import annotations

from typing import Any, List

import torch

from .checks import token_ids
from .requests import Request
from .sampling import Choice, Row, SamplingParams, block, check_seed, sampling_params, with_logprobs

#: The sampling keywords of :meth:`~.engine.ContinuousBatcher.add_request` a custom ``sample`` replaces.
SAMPLING_KEYWORDS = ("do_sample", "temperature", "top_k", "top_p", "seed")


class Picking:
    """For a class with ``sample``, ``sampler``, ``defaults``, ``generation`` (a
    :class:`.generation.Suppression`) and ``vocab_size``."""

    def _sampling(self, where: str, **given: Any) -> SamplingParams:
        if self.sample is not None:
            named = [name for name in SAMPLING_KEYWORDS if given[name] is not None]
            if named:
                raise ValueError(f"{where}: {named[0]} is set, but this engine picks tokens with its sample= function, "
                                 "which replaces per-request sampling: drop it, or build the engine without sample=")
        seed = given.pop("seed")
        return sampling_params(where, self.defaults, 0 if seed is None else check_seed(seed, where),
                               seeded=seed is not None, **given)

    def _row(self, req: Request, index: int) -> Row:
        """Row ``index`` of ``req``: its stop tokens blocked before its ``min_new_tokens``, and
        what the model's generation_config suppresses."""
        stops = req.stop_token_ids if index < req.min_new_tokens else ()
        return Row(req.sampling, index, stops + self.generation.blocked(index),
                   -1 if req.logprobs is None else req.top_n)

    def _choose(self, logits: torch.Tensor, rows: List[Row]) -> Choice:
        """The built-in sampler, or ``sample`` (checked) when set."""
        if self.sample is None:
            return self.sampler(logits, rows)
        tokens = token_ids(self.sample(block(logits, rows)), self.vocab_size, "sample(logits)")
        if len(tokens) != logits.shape[0]:
            raise ValueError(f"sample must return one token id per row of logits: got {len(tokens)} for "
                             f"{logits.shape[0]}")
        return with_logprobs(logits, rows, torch.tensor(tokens, dtype=torch.int64, device=logits.device))
