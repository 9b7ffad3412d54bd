"""fill_from + extract: generated vs interpreted vs hand-written (same as `graphslot bench`).

    python benchmarks/bench_fill.py [--json]
"""

import sys

from graphslot.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
