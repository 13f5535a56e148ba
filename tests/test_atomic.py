"""Output files: complete or untouched, through links, onto pipes and devices,
keeping an existing file's mode; what cannot be written is refused by name."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from graphrunner.util.atomic import write_atomically


def test_a_new_file_is_written_and_nothing_else_is_left(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    write_atomically(out, "hello\n")
    assert out.read_text() == "hello\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_an_existing_file_keeps_its_mode(tmp_path: Path) -> None:
    out = tmp_path / "secret.txt"
    out.write_text("old")
    os.chmod(out, 0o600)
    write_atomically(out, "new")
    assert out.read_text() == "new"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_a_symlink_is_written_through_to_its_target(tmp_path: Path) -> None:
    target = tmp_path / "real.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    write_atomically(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "later.txt")
    write_atomically(link, "x")
    assert link.is_symlink() and (tmp_path / "later.txt").read_text() == "x"


def test_a_character_device_is_written_not_replaced(tmp_path: Path) -> None:
    # A private null device, never the system's: a broken write would replace it.
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        null.write_text("")
    except OSError as e:
        pytest.skip(f"cannot make a character device here: {e}")
    before = null.stat()
    write_atomically(null, "discarded")
    after = null.stat()
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_a_fifo_reader_gets_the_text(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_atomically(fifo, "through the pipe")
    reader.join(timeout=10)
    assert got == ["through the pipe"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_directory_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=rf"{tmp_path} is a directory; expected a regular file"):
        write_atomically(tmp_path, "x")
    assert list(tmp_path.iterdir()) == []


def test_a_socket_is_refused_and_left_in_place(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(OSError, match="is not a regular file"):
            write_atomically(path, "x")
        assert stat.S_ISSOCK(path.stat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["s.sock"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(out, "\udcff")  # a lone surrogate cannot be encoded
    assert out.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
