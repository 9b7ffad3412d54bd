"""gpu_proof part 1: ``graphslot demo``'s decode workload under a capture mode the command
line does not offer.

    python3 benchmarks/proof_demo.py --result PATH --what MODE[,MODE...] [--smoke]

``graphslot demo`` (decode) captures ``"full"`` graphs and ``graphslot demo --workload
prefill`` runs the breakable and piecewise prefill runners; gpu_proof runs both commands
as they are. This runs the decode demo itself (``graphslot.cli.demo_decode.run_demo``,
the same continuous-batching trace, every step checked against eager) with its
runner's ``capture`` set, so decode is proven under every capture mode too. Prefill
under ``"full"`` is tests/test_capture_modes.py's (``pytest -m cuda``).
"""

from __future__ import annotations

import functools
import sys

from proof_common import Recorder, describe, piece_args, target_device

KEYS = ("mismatching_steps", "decode_steps", "batch_sizes", "captured_sizes", "capture_seconds", "eager_step_ms",
        "graph_step_ms", "check")


def main(argv=None) -> int:
    args = piece_args(__doc__.splitlines()[0], argv)
    import graphslot.cli.demo_decode as demo_decode
    from graphslot.runners.decode import DecodeRunnerConfig

    device = target_device(args.smoke)
    rec = Recorder(args.result, **describe(device))
    failed = False
    for mode in args.what.split(","):  # one process per mode on a GPU; all in one for --smoke
        demo_decode.DecodeRunnerConfig = functools.partial(DecodeRunnerConfig, capture=mode)
        result = rec.attempt(mode, lambda: demo_decode.run_demo(
            steps=40 if args.smoke else 300, backend="cpu" if args.smoke else "cuda", progress=False))
        if result is None:
            failed = True
            continue
        rec[mode] = {key: result.get(key) for key in KEYS}
        failed = failed or result["mismatching_steps"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
