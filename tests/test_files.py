"""graphslot/spec/files.py: the one way graphslot writes and reads files and shows paths."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from graphslot.spec.files import TooLarge, create_file, display_path, file_mode, read_bounded, write_atomic


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_write_atomic_replaces_text_or_bytes_with_the_umask_mode(tmp_path):
    path = tmp_path / "out.py"
    write_atomic(path, "a\r\nb\n")
    assert path.read_bytes() == b"a\r\nb\n"  # line endings as given
    write_atomic(path, b"\xff")
    assert path.read_bytes() == b"\xff" and mode_of(path) == file_mode()
    write_atomic(path, "é", mode=0o600)
    assert path.read_bytes() == "é".encode() and mode_of(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.py"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "out.py"
    path.write_text("old")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.py"]


def test_create_file_never_replaces(tmp_path):
    path = tmp_path / "spec.yaml"
    create_file(path, "one")
    with pytest.raises(FileExistsError):
        create_file(path, "two")
    assert path.read_text() == "one" and mode_of(path) == file_mode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_read_bounded(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_bounded(path, 10) == b"x" * 10
    with pytest.raises(TooLarge, match=r"^the file is larger than 9 bytes$"):
        read_bounded(path, 9)
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "missing", 9)


def test_display_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "specs" / "a.yaml") == os.path.join("specs", "a.yaml")
    assert display_path(tmp_path / "a.yaml", tmp_path / "specs") == str(tmp_path / "a.yaml")  # not below: as is
    assert display_path(tmp_path / "specs" / "a.yaml", tmp_path / "specs") == "a.yaml"
