"""Temporary names beside an output, and the removal of those a killed writer left.

A write that must be whole or absent goes to a temporary file (or directory) beside its
destination, renamed into place at the end, removed on any exception or on SIGTERM. SIGKILL
runs no handler: the temporary stays. So its name says who made it,
``.<dest name>.<host tag>-<pid>-<random>.tmp``, and the next write to the same destination
removes every such name whose writer is provably gone: made on this host (the tag: a hash of
the host name, since a pid means nothing on another machine sharing the folder) by a process
that no longer exists. A name that proves nothing (another host, another naming, a live or
unknowable pid) is left alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

__all__ = ["remove_stale_temps", "temp_path"]


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temp_path(dest: Path) -> Path:
    """A new temporary name beside ``dest`` that embeds this host and process."""
    return dest.with_name(f".{dest.name}.{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (False when it does, or cannot be told)."""
    if not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only the existence is checked
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it exists, owned by another user
        return False
    return False


def remove_stale_temps(dest: Path) -> list[Path]:
    """Remove the temporaries :func:`temp_path` made beside ``dest`` in
    processes of this host that no longer exist; returns what was removed.
    A folder that cannot be listed is left as it is."""
    name = re.escape(dest.name)
    pattern = re.compile(rf"\.{name}\.{_host_tag()}-(\d{{1,10}})-[0-9a-f]{{12}}\.tmp")
    try:
        entries = list(dest.parent.iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or not _gone(int(match[1])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed
