"""``python -m graphslot``: the command line (:mod:`graphslot.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
