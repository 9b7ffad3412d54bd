"""Files graphslot reads, writes and shows, done one way: bounded reads, atomic writes (a temporary file renamed
or hard-linked into place: readers see the old file or the whole new one, and nothing is left behind, ^C included)
with the umask's mode, create-only writes, an advisory lock, and paths as the user would type them. Torch-free."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Union

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]


class TooLarge(ValueError):
    """A file holds more bytes than the reader takes."""


class LockTimeout(Exception):
    """Another process held the lock for longer than the wait allowed."""


def read_bounded(path: Union[str, os.PathLike], limit: int) -> bytes:
    """The bytes of ``path``, read up to ``limit``: TooLarge when it holds more (untrusted input is never read
    whole); OSError as ``open`` raises it."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"the file is larger than {limit} bytes")
    return data


def file_mode() -> int:
    """The mode a new file gets under the process umask (0644 under umask 022)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def _temporary(path: Path, data: Union[str, bytes], mode: int) -> Iterator[str]:
    """A temporary file next to ``path`` holding ``data`` (text as UTF-8, line endings as they are) with ``mode``,
    for the body to rename or link into place; removed on the way out whatever happens."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        yield tmp
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_atomic(path: Path, data: Union[str, bytes], mode: Optional[int] = None) -> None:
    """Replace (or create) ``path`` by ``data`` in one rename; ``mode``: the new file's (default: the umask's)."""
    with _temporary(path, data, file_mode() if mode is None else mode) as tmp:
        os.replace(tmp, path)


def create_file(path: Path, data: Union[str, bytes]) -> None:
    """Create ``path`` holding ``data`` in one step, never replacing an existing file (FileExistsError): readers
    see no file or the whole one. Mode: the umask's."""
    with _temporary(path, data, file_mode()) as tmp:
        try:
            os.link(tmp, path)  # atomic, and fails when path exists
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links
            if os.path.lexists(path):
                raise FileExistsError(f"{path} exists") from None
            os.replace(tmp, path)


@contextlib.contextmanager
def locked_file(path: Path, wait_s: float) -> Iterator[None]:
    """Hold an exclusive advisory lock (``flock``) on the file ``path`` names; LockTimeout after ``wait_s`` seconds.
    Replacing a file makes a new one, so once the lock is taken ``path`` must still name the locked file, else the
    lock is taken again on the new one. Without ``fcntl`` (Windows) nothing is locked."""
    deadline = time.monotonic() + wait_s
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        fd = os.open(path, flags)
        try:
            while fcntl is not None:
                with contextlib.suppress(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                if time.monotonic() > deadline:
                    raise LockTimeout()
                time.sleep(0.005)
            held = os.fstat(fd)
            now = os.stat(path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                yield
                return
        finally:
            os.close(fd)  # releases the lock
        if time.monotonic() > deadline:
            raise LockTimeout()


def display_path(path: Union[str, os.PathLike], start: Optional[Union[str, os.PathLike]] = None) -> str:
    """``path`` relative to ``start`` (default: the working directory) when it lies below it, as the user would
    type it; else as it is (absolute)."""
    try:
        relative = os.path.relpath(path, start)
    except ValueError:  # another drive
        return str(path)
    return str(path) if relative.startswith("..") else relative
