"""What a model's ``generation_config`` asks of ``generate``, and what a
:class:`~.engine.ContinuousBatcher` does with each setting: applied as generate applies
it, or refused at construction naming it (never dropped without a word).

Applied (tokens equal to generate's; tests/test_hf_generation.py):

* ``do_sample``, ``temperature``, ``top_k``, ``top_p`` (:mod:`.sampling`), ``min_new_tokens``
  and ``eos_token_id`` (the engine);
* ``min_length`` (prompt plus output; generate's ``MinLengthLogitsProcessor``): a request
  masks its stop tokens until ``min_length - len(prompt)`` new tokens, as with
  ``min_new_tokens`` (the larger of the two);
* ``suppress_tokens`` (-inf at every step) and ``begin_suppress_tokens`` (-inf at the
  first new token), generate's ``SuppressTokens*LogitsProcessor``;
* ``renormalize_logits``: a ``log_softmax`` at the end, which changes no token (and
  the engine's logprobs are the model's distribution either way).

Refused (:data:`REFUSED`): every other setting that changes the tokens generate picks,
greedy or sampled, when set to anything but its neutral value. Settings that change
nothing about the tokens (``max_length``: a request gives ``max_new_tokens``;
``use_cache``, ``output_*``, assisted decoding, which keeps greedy tokens) are ignored.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

from .checks import count, stop_ids

#: setting -> (its neutral values, what it does in generate). Refused when set otherwise.
REFUSED: Dict[str, Tuple[Tuple[Any, ...], str]] = {
    "repetition_penalty": ((None, 1.0), "scales down the scores of tokens already in the sequence"),
    "encoder_repetition_penalty": ((None, 1.0), "scales up the scores of the prompt's tokens"),
    "no_repeat_ngram_size": ((None, 0), "bans tokens that would repeat an n-gram"),
    "encoder_no_repeat_ngram_size": ((None, 0), "bans tokens that would repeat an n-gram of the prompt"),
    "bad_words_ids": ((None,), "bans token sequences"),
    "sequence_bias": ((None,), "adds a bias to token sequences"),
    "forced_bos_token_id": ((None,), "forces the first token after a one-token prompt"),
    "forced_eos_token_id": ((None,), "forces EOS at max_length"),
    "exponential_decay_length_penalty": ((None,), "raises the EOS score after a start index"),
    "remove_invalid_values": ((None, False), "replaces nan and inf scores"),
    "guidance_scale": ((None, 1, 1.0), "classifier-free guidance (a second, unconditional forward)"),
    "watermarking_config": ((None,), "biases the scores towards a watermark"),
    "typical_p": ((None, 1.0), "locally typical sampling"),
    "epsilon_cutoff": ((None, 0.0), "epsilon sampling"),
    "eta_cutoff": ((None, 0.0), "eta sampling"),
    "min_p": ((None,), "min-p sampling"),
    "top_h": ((None,), "top-h sampling"),
    "num_beams": ((None, 1), "beam search"),
    "num_beam_groups": ((None, 1), "group beam search"),
    "diversity_penalty": ((None, 0.0), "group beam search"),
    "penalty_alpha": ((None,), "contrastive search"),
    "dola_layers": ((None,), "DoLa decoding"),
    "num_return_sequences": ((None, 1), "several sequences per prompt"),
    "stop_strings": ((None,), "stops at strings (through a tokenizer)"),
    "max_time": ((None,), "stops after a time"),
    "token_healing": ((None, False), "rewrites the prompt's last tokens"),
}


class Suppression(NamedTuple):
    """What the applied settings of a model's ``generation_config`` block (see the module docstring)."""

    #: Ids at -inf at every step.
    always: Tuple[int, ...] = ()
    #: Ids at -inf at the first new token.
    first: Tuple[int, ...] = ()
    #: generate's ``min_length`` (prompt plus output; 0: none).
    min_length: int = 0

    def min_new(self, prompt_len: int, max_new_tokens: int) -> int:
        """The new tokens ``min_length`` masks the stop tokens for, at most ``max_new_tokens``."""
        return min(max(self.min_length - prompt_len, 0), max_new_tokens)

    def blocked(self, index: int) -> Tuple[int, ...]:
        """The ids blocked at output token ``index`` (beside a request's stop tokens)."""
        return self.always + self.first if index == 0 else self.always


def _neutral(value: Any, neutral: Tuple[Any, ...]) -> bool:
    return any(value is n or (type(value) in (int, float) and type(n) in (int, float) and value == n)
               for n in neutral)


def generation_settings(model: Any, vocab_size: int) -> Suppression:
    """Check ``model.generation_config``: a ValueError naming every refused setting it sets
    (and how to unset it); else what the applied ones block."""
    config = getattr(model, "generation_config", None)
    where = "model.generation_config"
    if config is None:
        return Suppression()
    refused = {name: getattr(config, name, None) for name, (neutral, _) in REFUSED.items()
               if not _neutral(getattr(config, name, None), neutral)}
    if refused:
        named = ", ".join(f"{name}={value!r} ({REFUSED[name][1]})" for name, value in refused.items())
        unset = "; ".join(f"{where}.{name} = {REFUSED[name][0][-1]!r}" for name in refused)
        raise ValueError(f"{where} sets {named}: generate's tokens depend on it, and ContinuousBatcher does not apply "
                         f"it. Unset it to serve the model without it ({unset})")
    suppress = getattr(config, "suppress_tokens", None)
    begin = getattr(config, "begin_suppress_tokens", None)
    min_length = getattr(config, "min_length", None)
    return Suppression(
        always=() if suppress is None else stop_ids(suppress, vocab_size, f"{where}.suppress_tokens"),
        first=() if begin is None else stop_ids(begin, vocab_size, f"{where}.begin_suppress_tokens"),
        min_length=0 if min_length is None else count(min_length, "min_length", where, minimum=0))
