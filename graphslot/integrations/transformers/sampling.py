"""Per-request sampling on the device: greedy, temperature, top-k, top-p, a seed per request.

:class:`Sampler` turns a step's logits ``[rows, vocab]`` into one token per row with
tensor operations over the whole batch; every row's parameters come from the host as
small tensors (host-to-device copies), nothing is read back per row. The engine reads
the step's tokens (and logprobs) once, with :func:`to_host`.

What a row gets, in generate's order (``_get_logits_processor`` of transformers 5.x):

1. the model's logits as float32; the tokens blocked this step (a request's stop
   tokens before its ``min_new_tokens``) set to ``-inf``: generate's
   ``MinNewTokensLengthLogitsProcessor``, for greedy and sampled rows alike;
2. a greedy row (``do_sample`` False, or ``temperature`` 0) takes the argmax: exactly
   ``torch.argmax`` of those scores, the first of equal maxima, as generate;
3. a sampled row: the scores divided by ``temperature`` (at least :data:`MIN_TEMPERATURE`,
   float32's smallest normal number, else refused; generate's float32 scores overflow
   there too; each row is first shifted so that its largest score is 0, so even that
   temperature overflows no score to +inf: it draws the argmax); top-k keeps every score >= the
   k-th largest (ties kept, as ``TopKLogitsWarper``; ``top_k`` 0: off); top-p sorts the
   row ascending, removes the tokens whose cumulative probability is <= ``1 - top_p``
   and always keeps the most likely (``TopPLogitsWarper``; ``top_p`` 1: off); then one
   draw from the softmax of what is left.

The draw is Gumbel-max: ``argmax(scores + g)`` with ``g = -log(-log(u))`` is distributed
as ``multinomial(softmax(scores))``. The uniforms ``u`` are a counter-based hash of
(the request's seed, the index of the token being drawn, the vocabulary id): the same
request with the same seed draws the same tokens whatever else is in the batch, at
whatever row and padded size, and a step that is rolled back and retried draws again
what it drew (there is no generator state to advance). ``u`` has 24 random bits (float32
resolution). The hash is 32-bit integer arithmetic that wraps, on the CPU and CUDA
alike, so a seed gives the same noise on both.

Logprobs are of the model's distribution: ``log_softmax`` of the float32 logits, before
the ``min_new_tokens`` mask, temperature, top-k and top-p (vLLM's default; generate's
``output_scores`` are the processed scores instead). A greedy row's token is the argmax
of the same logits, so its logprob is the largest of the row.

Costs: an all-greedy step is one ``argmax``. Sampled rows add a few elementwise passes
over ``[sampled rows, vocab]`` (the noise) and a ``topk`` for top-k; only rows with
``top_p < 1`` are sorted, over the whole vocabulary, as generate's ``TopPLogitsWarper``
does (on a CPU that sort is the costly part: about 2 ms per row of 32000).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .checks import as_int, flag, number, stop_ids
from .geometry import text_config

#: generate's own defaults for what a model's ``generation_config`` leaves unset
#: (``GenerationConfig._get_default_generation_params`` in transformers 5.x; checked by
#: tests/test_hf_sampling.py): sampling with no ``top_k`` given is top-50, as generate's.
GENERATE_DEFAULTS: Dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
#: Seeds are taken modulo 2**64.
SEED_BITS = 64
_MASK64 = (1 << 64) - 1
#: The smallest temperature above 0 (float32's smallest normal number, 2**-126): a request
#: is refused below it, where the logits divided by the temperature overflow float32.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (resolved: no None left)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


def generation_defaults(model: Any) -> Dict[str, Any]:
    """``GENERATE_DEFAULTS`` overridden by what ``model.generation_config`` sets (checked)."""
    config = getattr(model, "generation_config", None)
    out = dict(GENERATE_DEFAULTS)
    for name in out:
        value = getattr(config, name, None)
        if value is not None:
            out[name] = value
    where = "model.generation_config"
    return {"do_sample": flag(out["do_sample"], "do_sample", where),
            "temperature": _temperature(out["temperature"], where),
            "top_k": _top_k(out["top_k"], where), "top_p": _top_p(out["top_p"], where)}


def model_eos(model: Any, vocab_size: int) -> Tuple[int, ...]:
    """The EOS ids generate would use: ``generation_config.eos_token_id``, else the (text)
    config's (an id or a list; ``()`` when neither has one). Ids outside the vocabulary
    are dropped (-1, "none" to HF's continuous batching; a tiny test config's default):
    no step can draw them, so generate never stops on them either."""
    value = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if value is None:
        value = getattr(text_config(model.config), "eos_token_id", None)
    if value is None:
        return ()
    ids = [value] if as_int(value) is not None else value
    if isinstance(ids, (list, tuple)):
        ids = [v for v in ids if as_int(v) is None or 0 <= as_int(v) < vocab_size]  # what is no int stays, refused
    return stop_ids(ids, vocab_size, "the model's eos_token_id (generation_config, else config)")


def _temperature(value: Any, where: str) -> float:
    t = number(value, "temperature", where, 0.0, float("inf"), rule="0: greedy")
    if 0.0 < t < MIN_TEMPERATURE:
        raise ValueError(f"{where}: temperature must be 0 (greedy) or at least {MIN_TEMPERATURE!r} (MIN_TEMPERATURE: "
                         "float32's smallest normal number; below it the logits divided by it overflow), "
                         f"got {value!r}")
    return t


def _top_k(value: Any, where: str) -> int:
    k = as_int(value)
    if k is None or k < 0:
        raise (TypeError if k is None else ValueError)(f"{where}: top_k must be an int >= 0 (0: off), got {value!r}")
    return k


def _top_p(value: Any, where: str) -> float:
    return number(value, "top_p", where, 0.0, 1.0, low_open=True, rule="1: off")


def sampling_params(where: str, defaults: Dict[str, Any], seed: int, *, seeded: bool = False, do_sample: Any = None,
                    temperature: Any = None, top_k: Any = None, top_p: Any = None) -> SamplingParams:
    """A request's parameters: each given one checked (the error names it), the others
    from ``defaults`` (:func:`generation_defaults`). ``do_sample=None`` samples when any of
    temperature, top_k, top_p is given or the seed is (``seeded``), else follows the
    model's ``do_sample``."""
    do_sample = flag(do_sample, "do_sample", where, allow_none=True)
    given = seeded or any(v is not None for v in (temperature, top_k, top_p))
    return SamplingParams(
        do_sample=(given or defaults["do_sample"]) if do_sample is None else do_sample,
        temperature=defaults["temperature"] if temperature is None else _temperature(temperature, where),
        top_k=defaults["top_k"] if top_k is None else _top_k(top_k, where),
        top_p=defaults["top_p"] if top_p is None else _top_p(top_p, where),
        seed=seed)


def check_seed(value: Any, where: str) -> int:
    """A seed: an int >= 0, taken modulo 2**64."""
    s = as_int(value)
    if s is None or s < 0:
        raise (TypeError if s is None else ValueError)(f"{where}: seed must be an int >= 0, got {value!r}")
    return s & _MASK64


def request_seed(engine_seed: int, rid: int) -> int:
    """The seed of a request that gave none: the engine's seed and the request id, mixed."""
    return (engine_seed ^ ((rid + 1) * 0x9E3779B97F4A7C15)) & _MASK64


# -- the noise: a counter-based hash ----------------------------------------------------
def row_key(seed: int, index: int) -> int:
    """A 32-bit key (as a signed int32) for token ``index`` of a request seeded ``seed``
    (splitmix64 finaliser over both, on the host: Python ints, no device work)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z = (z ^ (z >> 31)) & 0xFFFFFFFF
    return z - (1 << 32) if z >= 1 << 31 else z


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (a bijection of int32; multiplications wrap) of an int32 tensor."""
    x = x ^ ((x >> 16) & 0xFFFF)  # >> is arithmetic on int32: the mask makes it logical
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - (1 << 32))
    return x ^ ((x >> 16) & 0xFFFF)


def mix32_reference(x: int) -> int:
    """:func:`mix32` on one unsigned 32-bit Python int (the specification the tensor form meets)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


# -- a step's rows ------------------------------------------------------------------------
class Row(NamedTuple):
    """What the sampler needs of one row of a step."""

    params: SamplingParams
    #: The index of the token being drawn in the request's output (the noise's counter).
    index: int
    #: Token ids set to -inf before anything else (stop tokens before min_new_tokens).
    blocked: Tuple[int, ...] = ()
    #: -1: no logprobs; 0: the chosen token's; n: and the n most likely tokens'.
    logprobs: int = -1


class Choice(NamedTuple):
    """One step's picks, on the device."""

    tokens: torch.Tensor  # [rows] int64
    logprobs: Optional[torch.Tensor] = None  # [rows] float32, when a row asked
    top_ids: Optional[torch.Tensor] = None  # [rows, n] int64, when a row asked for n > 0
    top_logprobs: Optional[torch.Tensor] = None  # [rows, n] float32


def block(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """``logits`` as float32, with each row's blocked tokens at -inf (a copy when any is)."""
    scores = logits.float()
    pairs = [(i, t) for i, row in enumerate(rows) for t in row.blocked]
    if pairs:
        where = torch.tensor(pairs, dtype=torch.int64, device=logits.device).t()
        scores = scores.index_put((where[0], where[1]), torch.tensor(float("-inf"), device=logits.device))
    return scores


class Sampler:
    """The batched sampler (see the module docstring). Stateless but for a cache of the
    hashed vocabulary ids per (vocab size, device)."""

    def __init__(self) -> None:
        self._vocab: Dict[Tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[Row]) -> Choice:
        if logits.shape[0] != len(rows):
            raise ValueError(f"Sampler: {logits.shape[0]} rows of logits for {len(rows)} rows of parameters")
        scores = block(logits, rows)
        tokens = scores.argmax(-1)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            dev = logits.device
            index = torch.tensor(sampled, dtype=torch.int64, device=dev)
            picked = self._draw(scores.index_select(0, index), [rows[i] for i in sampled])
            tokens = tokens.index_copy(0, index, picked)
        return with_logprobs(logits, rows, tokens)

    def _draw(self, scores: torch.Tensor, rows: List[Row]) -> torch.Tensor:
        """One token per row of ``scores`` (every row samples)."""
        dev = scores.device
        vocab = scores.shape[-1]
        params = [row.params for row in rows]
        # Shifted so that each row's largest score is 0: divided by a tiny temperature the
        # others overflow to -inf (probability 0), never the largest to +inf. The draw,
        # top-k and top-p are unchanged by a shift.
        top = scores.amax(-1, keepdim=True)
        scores = (scores - top.masked_fill(~top.isfinite(), 0.0)) / torch.tensor(
            [p.temperature for p in params], device=dev).unsqueeze(1)
        ks = [min(p.top_k, vocab) for p in params]
        if any(ks):
            kmax = max(ks)
            values = scores.topk(kmax, dim=-1).values
            kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev).unsqueeze(1))
            kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev).unsqueeze(1), float("-inf"))
            scores = scores.masked_fill(scores < kth, float("-inf"))
        nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if nucleus:
            index = torch.tensor(nucleus, dtype=torch.int64, device=dev)
            sub = scores.index_select(0, index)
            ascending, order = sub.sort(dim=-1)
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
            limit = torch.tensor([1.0 - params[i].top_p for i in nucleus], device=dev).unsqueeze(1)
            remove = cumulative <= limit
            remove[:, -1] = False  # the most likely token always stays
            sub = sub.masked_fill(remove.scatter(1, order, remove), float("-inf"))
            scores = scores.index_copy(0, index, sub)
        return (scores + self.gumbel([row_key(p.seed, row.index) for p, row in zip(params, rows)], vocab, dev)
                ).argmax(-1)

    def gumbel(self, keys: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
        """Gumbel noise ``[len(keys), vocab]`` (float32), row ``i`` a function of ``keys[i]`` and the column."""
        ids = self._vocab.get((vocab, device))
        if ids is None:
            ids = self._vocab[(vocab, device)] = mix32(torch.arange(vocab, dtype=torch.int32, device=device))
        x = mix32(ids ^ torch.tensor(keys, dtype=torch.int32, device=device).unsqueeze(1))
        u = ((x >> 8) & 0xFFFFFF).float().add_(0.5).mul_(1.0 / (1 << 24))  # in (0, 1)
        return u.log_().neg_().log_().neg_()


def greedy(logits: torch.Tensor) -> List[int]:
    """A ``sample`` function: the argmax of every row (what the built-in sampler does for
    greedy requests, without its device-side batching)."""
    return logits.argmax(-1).tolist()


def with_logprobs(logits: torch.Tensor, rows: Sequence[Row], tokens: torch.Tensor) -> Choice:
    """``tokens`` with the logprobs the rows asked for (of the model's distribution)."""
    wanted = max(row.logprobs for row in rows)
    if wanted < 0:
        return Choice(tokens)
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if wanted == 0:
        return Choice(tokens, chosen)
    top = logprobs.topk(min(wanted, logprobs.shape[-1]), dim=-1)
    return Choice(tokens, chosen, top.indices, top.values)


def to_host(tensors: Sequence[torch.Tensor]) -> List[List[Any]]:
    """Each tensor's values as a flat host list, in one device-to-host read: int64 tokens
    and float logprobs travel together as float64 (exact: ids are far below 2**53)."""
    if not tensors:
        return []
    if len(tensors) == 1:
        return [tensors[0].reshape(-1).tolist()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out = []
    start = 0
    for t in tensors:
        part = flat[start:start + t.numel()]
        out.append([int(v) for v in part] if not t.dtype.is_floating_point else part)
        start += t.numel()
    return out
