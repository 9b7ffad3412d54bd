"""The mixed offline workload ``graphslot verify`` (and tests/test_vllm_plugin.py) runs inside vLLM 0.32: a tiny
random Llama, 14 requests of 3 to 150 prompt tokens with 1 to 20 new greedy tokens each, 64 tokens and 8 requests a
step (chunked prefills, a batch that changes as requests end).

:func:`tiny_engine` builds the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so patches of the runner reach
it); :func:`generate` runs the workload, optionally with a wrapper around the installed ``_prepare_inputs``. vLLM and
transformers are imported when called, not when this module is.
"""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch

from ...env import set_defaults
from .patching import MODEL_RUNNER

VOCAB = 512
LENGTHS = [3, 5, 8, 17, 31, 40, 63, 64, 65, 97, 130, 150, 9, 120]  # 64 tokens a step: the long ones are chunked
MAX_NEW = [1, 2, 3, 5, 8, 13, 4, 7, 1, 6, 9, 11, 20, 2]  # 8 requests a step at most: the batch changes as they end

#: ``wrap(inner, runner, scheduler_output, num_scheduled_tokens)``: called in place of ``_prepare_inputs``.
Wrap = Callable[..., Any]


def in_process_engine_env() -> None:
    """The environment the workload needs, unless set: the engine in this process (patches reach it), a 1 GiB KV
    cache (else the CPU worker sizes it from free memory), and vLLM's log on stderr (stdout is the report's; it
    applies when vLLM is first imported)."""
    set_defaults(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        }
    )


def tiny_engine(model_dir: Path) -> Any:
    """A ``vllm.LLM`` on a tiny random float32 Llama saved into ``model_dir`` (seeded: the same weights each time)."""
    in_process_engine_env()
    vllm = importlib.import_module("vllm")
    transformers = importlib.import_module("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(model_dir, safe_serialization=True)
    return vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                    max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=True,
                    enable_prefix_caching=False, block_size=32, seed=0, load_format="safetensors")


def generate(llm: Any, wrap: Optional[Wrap] = None) -> List[List[int]]:
    """Greedy tokens of the workload, each request's own; ``wrap(inner, runner, scheduler_output, counts)`` is
    called in place of the installed ``_prepare_inputs`` (``inner``) for the run."""
    vllm = importlib.import_module("vllm")
    model_runner = importlib.import_module(MODEL_RUNNER).GPUModelRunner
    rng = random.Random(0)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(n)])
               for n in LENGTHS]
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in MAX_NEW]
    inner = model_runner._prepare_inputs
    if wrap is not None:
        model_runner._prepare_inputs = lambda runner, *args: wrap(inner, runner, *args)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        model_runner._prepare_inputs = inner
    return [list(o.outputs[0].token_ids) for o in outputs]
