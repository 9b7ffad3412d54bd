"""Files graphslot generated, anywhere in the project, that no output produces any more.

Renaming ``output_dir`` (or moving a project's generated package) leaves the old
directory's modules behind, still importable and silently stale. ``graphslot generate``
therefore looks through the project for the packages it generated -- directories whose
``__init__.py`` carries its package banner -- other than the current ``output_dir``
(whose orphans :mod:`.aot` finds), and reports (``--check``) or removes what they hold
that carries its full module banner. A file without the banner is never touched; the
package's ``__init__.py`` goes only with the last file in it. The walk stays inside the
project: it follows no symbolic link and skips hidden directories, virtual
environments, build outputs (``build``, ``dist``), ``__pycache__``, ``node_modules``,
``site-packages`` and other projects (a directory with its own pyproject.toml), and it
stops after :data:`MAX_DIRS` directories (saying so). Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Tuple

__all__ = ["MAX_DIRS", "stale_files"]

#: Most directories looked through (a monorepo's worth; each costs one listing).
MAX_DIRS = 20000
# Build outputs (setuptools copies the package, generated modules included, to build/lib)
# and environments hold copies, not the project's own modules.
_SKIPPED = frozenset({"__pycache__", "node_modules", "site-packages", "build", "dist"})
_INIT = "__init__.py"


def _looked_in(directory: Path) -> bool:
    return not (directory.name.startswith(".") or directory.name in _SKIPPED or directory.is_symlink()
                or (directory / "pyvenv.cfg").exists() or (directory / "pyproject.toml").is_file())


def stale_files(root: Path, output_dir: Path, generated: Callable[[Path, bool], bool]) -> Tuple[List[Path], bool]:
    """The files graphslot generated under ``root`` outside ``output_dir`` (``generated(path,
    package_init)`` tells its files by their banner), in the order to remove them; and
    whether the walk stopped at :data:`MAX_DIRS` before seeing the whole project."""
    stale: List[Path] = []
    visited = 0
    for dirpath, dirnames, filenames in os.walk(root):
        visited += 1
        if visited > MAX_DIRS:
            return stale, True
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if _looked_in(here / d))
        if here == output_dir or _INIT not in filenames or not generated(here / _INIT, True):
            continue
        modules = sorted(here / f for f in filenames if f.endswith(".py") and f != _INIT)
        ours = [p for p in modules if not p.is_symlink() and p.is_file() and generated(p, False)]
        stale += ours
        if len(ours) == len(modules):  # nothing else left in the package: its __init__.py goes too
            stale.append(here / _INIT)
    return stale, False
