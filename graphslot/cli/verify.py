"""``graphslot verify``: the padding of a model's spec proven safe, stale inputs found.

TARGET is ``package.module:function``; the function (called with no arguments) returns a
:class:`graphslot.tools.verify.VerifyTarget`, or a ``(runner, make_batch)`` or
``(runner, make_batch, release)`` tuple: a captured ``DecodeGraphRunner`` and a function
making a real batch of ``n`` requests for it. Without TARGET (or with ``--reference``)
the shipped reference model is verified.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from ..spec.dtypes import import_torch


def add_arguments(parser: argparse.ArgumentParser, positive_int: Any) -> None:
    parser.add_argument("target", nargs="?", metavar="TARGET",
                        help="package.module:function returning a VerifyTarget or (runner, make_batch[, release])")
    parser.add_argument("--reference", action="store_true", help="verify the shipped reference model (the default)")
    parser.add_argument("--spec", default="decode",
                        help="reference model only: the decode spec, a shipped name or a YAML path (default decode)")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                        help="reference model only: graph backend (auto: cuda on a GPU machine, else the cpu tape)")
    parser.add_argument("--max-bs", type=positive_int, default=8, help="reference model only: largest graph (default 8)")
    parser.add_argument("--samples", type=positive_int, default=2,
                        help="raw sizes replayed per captured size (default 2; the smallest is always one)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the raw-size sample and the reference batches")
    parser.add_argument("--no-audit", action="store_true", help="skip the stale-input audit")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def load_entry(reference: str) -> Any:
    """The VerifyTarget that ``module:function`` returns (errors: ValueError, one line)."""
    from ..tools.verify import VerifyTarget

    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ValueError(f"TARGET must be package.module:function, got {reference!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `graphslot verify mymodule:fn` from a project's root
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {reference}: {type(exc).__name__}: {exc}") from None
    made = fn()
    if isinstance(made, VerifyTarget):
        return made
    if isinstance(made, tuple) and len(made) in (2, 3) and hasattr(made[0], "add_observer"):
        return VerifyTarget(*made, label=reference)
    raise ValueError(f"{reference} returned {type(made).__name__}; expected a VerifyTarget or a "
                     "(DecodeGraphRunner, make_batch[, release]) tuple")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.target and args.reference:
        parser.error("give TARGET or --reference, not both")
    torch = import_torch()
    if args.backend == "cuda" and not torch.cuda.is_available():
        print(f"graphslot verify: error: --backend cuda needs a CUDA GPU; this torch ({torch.__version__}) sees none",
              file=sys.stderr)
        return 1
    what = args.target or f"the reference model (spec {args.spec}, max_bs {args.max_bs})"
    print(f"graphslot verify: {what}: capturing, auditing inputs, replaying poisoned tails", file=sys.stderr)
    from ..tools.verify import format_report, verify_runner

    try:
        if args.target:
            target = load_entry(args.target)
        else:
            from ..reference.verify_target import reference_target

            target = reference_target(args.backend, args.max_bs, args.spec, args.seed)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)  # bit-exact CPU kernels (reference/numerics.py); tiny models lose nothing
        try:
            report = verify_runner(target, samples=args.samples, seed=args.seed, audit=not args.no_audit)
        finally:
            torch.set_num_threads(saved)
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        print(f"graphslot verify: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.safe else 1
