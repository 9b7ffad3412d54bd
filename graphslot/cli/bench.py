"""``graphslot bench``: fill_from + extract, generated vs interpreted vs hand-written.

The command; the benchmark itself (torch) is :mod:`.fill_bench`, imported when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..spec.dtypes import import_torch
from ..spec.files import display_path
from ..spec.loading import shipped_spec_path
from . import limits
from .common import Command

HELP = """Time fill_from + extract: generated vs interpreted vs hand-written.

The shipped decode spec (graphslot's own file, whatever the working directory's project
calls decode: the hand-written baseline and the op targets are its), max_bs 256,
raw/padded 3/4, 30/32, 200/256, all measured in one run; also counts the mutating ATen
ops of one padded fill (on a GPU, kernel launches). Progress goes to stderr (a bar on a terminal, else a line per size);
--json keeps stdout pure JSON. Exit 1 when an op-count target is missed (they are
deterministic), naming it and by how much; a missed timing target (the speedup over
the interpreter, which a loaded machine moves) is named with its margin, exit 0.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--iters", type=limits.MAX_ITERS.argument(), default=2000,
                        help=f"calls per sample (default 2000, at most {limits.MAX_ITERS.most})")
    parser.add_argument("--repeats", type=limits.MAX_REPEATS.argument(), default=7,
                        help=f"samples; the median is kept (default 7, at most {limits.MAX_REPEATS.most}; "
                             f"--iters × --repeats at most {limits.MAX_CALLS.most})")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    calls = args.iters * args.repeats
    limits.MAX_CALLS.check(parser, "--repeats", calls,
                           got=f"--iters {args.iters} × --repeats {args.repeats} = {calls} calls")
    spec = display_path(shipped_spec_path("decode"))
    print(f"graphslot bench: fill_from + extract of the shipped decode spec ({spec}), generated vs interpreted vs "
          f"hand-written, {args.repeats} repeats x {args.iters} iters per batch size", file=sys.stderr)
    import_torch()
    from .fill_bench import describe_miss, format_report, run_bench

    result = run_bench(args.iters, args.repeats, progress=True)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    for miss in result["missed"]:
        print(f"graphslot bench: {'missed' if miss['gates'] else 'note'}: {describe_miss(miss)}", file=sys.stderr)
    return 1 if result["gating_missed"] else 0


COMMAND = Command("bench", HELP, add_arguments, run)
