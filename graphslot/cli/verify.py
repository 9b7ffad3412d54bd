"""``graphslot verify``: the padding of a model's spec proven safe, stale inputs found.

TARGET is ``package.module:function``; the function (called with no arguments) returns a
:class:`graphslot.tools.verify.VerifyTarget`, or a ``(runner, make_batch)`` or
``(runner, make_batch, release)`` tuple: a captured ``DecodeGraphRunner`` and a function
making a real batch of ``n`` requests for it; or an object whose ``verify(samples=, seed=,
audit=)`` returns the report itself (``graphslot.integrations.vllm.verify:target``).
Without TARGET (or with ``--reference``) the shipped reference model is verified;
``--spec``, ``--max-bs`` and ``--backend`` are its options (with a TARGET they are a
usage error). A target that cannot be imported,
raises, or whose ``make_batch(n)`` makes a batch of another size is one error line
naming it, exit 2 (1 is kept for what verify finds: an unsafe spec or stale input).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from ..spec.dtypes import import_torch
from . import limits
from .common import Command, fail, seed_int

HELP = """Prove a model safe under its spec's padding; find stale inputs.

For each captured size and a sample of raw sizes padding to it, replays a real batch
with the padded tail of every slot whose policy leaves it untouched (keep_pad,
foreach_copy, fill_once) poisoned, one slot at a time, with two patterns (the real
rows repeated; NaN / flipped bools / other seen ids): the raw rows must stay
bit-identical to a clean replay. Also captures each size on the CPU tape and lists
tensors a graph reads that are neither slots nor declared static (stale inputs).

TARGET is package.module:function returning a VerifyTarget or (runner, make_batch[,
release]), or graphslot.integrations.vllm.verify:target (the vLLM plugin's spec inside
vLLM, docs/verify.md); without it the shipped reference model is verified (--spec,
--max-bs and --backend are its options, a usage error with TARGET). Prints a table
(slot, policy, verdict) or --json; exit 1 when anything is unsafe, 2 when TARGET cannot
be used (it cannot be imported, raises, or make_batch(n) makes a batch of another size).
"""

# Options of the reference model: a TARGET brings its own runner (spec, sizes, backend).
REFERENCE_ONLY = {"spec": ("--spec", "decode"), "max_bs": ("--max-bs", 8), "backend": ("--backend", "auto")}
TARGET_FORM = "TARGET must be package.module:function"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", metavar="TARGET",
                        help="package.module:function returning a VerifyTarget or (runner, make_batch[, release])")
    parser.add_argument("--reference", action="store_true", help="verify the shipped reference model (the default)")
    parser.add_argument("--spec",
                        help="reference model only: the decode spec, a shipped name or a YAML path (default decode)")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"),
                        help="reference model only: graph backend (auto, the default: cuda on a GPU machine, else "
                             "the cpu tape)")
    parser.add_argument("--max-bs", type=limits.MAX_BS.argument(),
                        help=f"reference model only: largest graph (default 8, at most {limits.MAX_BS.most})")
    parser.add_argument("--samples", type=limits.MAX_SAMPLES.argument(), default=2,
                        help=f"raw sizes replayed per captured size (default 2, at most {limits.MAX_SAMPLES.most}; "
                             "the smallest is always one)")
    parser.add_argument("--seed", type=seed_int, default=0,
                        help="seed of the raw-size sample and the reference batches (0 to 2**64-1)")
    parser.add_argument("--no-audit", action="store_true", help="skip the stale-input audit")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Usage errors (exit 2): TARGET with --reference, a TARGET not of the form
    module:function, options of the reference model given with a TARGET. Fills in the
    reference model's defaults."""
    if args.target and args.reference:
        parser.error("give TARGET or --reference, not both")
    if args.target:
        module_name, _, attr = args.target.partition(":")
        if not module_name or not attr:
            parser.error(f"{TARGET_FORM}, got {args.target!r}")
        given = [flag for name, (flag, _) in REFERENCE_ONLY.items() if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)} apply only to the reference model, not to TARGET {args.target!r}, "
                         "whose runner has its own spec, sizes and backend")
    for name, (_, default) in REFERENCE_ONLY.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def load_entry(reference: str) -> Any:
    """The VerifyTarget that ``module:function`` returns; TargetError (one line, without
    the target's name) when it cannot be imported, raises or returns something else."""
    from ..tools.verify import TargetError, VerifyTarget, describe_exception

    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise TargetError(TARGET_FORM)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `graphslot verify mymodule:fn` from a project's root
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the target's code: report it, with where
        raise TargetError(f"cannot import it ({describe_exception(exc)})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "has no attribute" if fn is None else "has a non-callable"
        raise TargetError(f"module {module_name!r} {what} {attr!r}")
    try:
        made = fn()
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise TargetError(f"calling it raised ({describe_exception(exc)})") from None
    if isinstance(made, VerifyTarget) or callable(getattr(made, "verify", None)):
        return made  # a VerifyTarget, or a target that verifies itself (graphslot.integrations.vllm.verify:target)
    if isinstance(made, tuple) and len(made) in (2, 3) and hasattr(made[0], "add_observer"):
        return VerifyTarget(*made, label=reference)
    raise TargetError(f"returned {type(made).__name__}; expected a VerifyTarget or a "
                      "(DecodeGraphRunner, make_batch[, release]) tuple")


def header(what: str) -> None:
    print(f"graphslot verify: {what}: capturing, auditing inputs, replaying poisoned tails", file=sys.stderr)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Exit 0: safe; 1: unsafe, or the verification failed; 2: a usage error, or TARGET
    cannot be used (it cannot be imported, raises, or make_batch(n) gives another size)."""
    check_arguments(args, parser)
    torch = import_torch()
    if args.backend == "cuda" and not torch.cuda.is_available():
        return fail("verify", f"--backend cuda needs a CUDA GPU; this torch ({torch.__version__}) sees none")
    from ..reference.verify_target import NotADecodeSpec, decode_spec, reference_target
    from ..tools.verify import TargetError, VerifyTarget, format_report, verify_runner

    try:
        if args.target:
            header(args.target)
            target = load_entry(args.target)
        else:
            spec = decode_spec(args.spec)  # before the header: not a decode spec is a usage error
            header(f"the reference model (spec {args.spec}, max_bs {args.max_bs})")
            target = reference_target(args.backend, args.max_bs, spec, args.seed)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)  # bit-exact CPU kernels (reference/numerics.py); tiny models lose nothing
        try:
            options = {"samples": args.samples, "seed": args.seed, "audit": not args.no_audit}
            if isinstance(target, VerifyTarget):
                report = verify_runner(target, **options)
            else:  # a target that verifies itself (graphslot.integrations.vllm.verify:target)
                report = target.verify(**options)
        finally:
            torch.set_num_threads(saved)
    except NotADecodeSpec as exc:
        parser.error(f"argument --spec: {exc}")
    except TargetError as exc:
        name = f"target {args.target!r}" if args.target else "the reference model"
        return fail("verify", f"{name}: {exc}", status=2)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        return fail("verify", f"{type(exc).__name__}: {exc}".splitlines()[0])
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.safe else 1


COMMAND = Command("verify", HELP, add_arguments, run)
