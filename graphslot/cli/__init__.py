"""graphslot's commands: the ``graphslot`` command line (:mod:`.app`) and what only
commands use (the demos, the benchmark). Nothing in the library imports from here."""

from .app import main

__all__ = ["main"]
