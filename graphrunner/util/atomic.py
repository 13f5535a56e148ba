"""Writing a file so that it is either complete or untouched, never half-written.

The write goes to a new file beside the destination, then a rename puts it in
place. What is already at the path decides how:

* a regular file (or nothing): the rename replaces it; an existing file keeps
  its permission bits (a 0600 file stays 0600);
* a symbolic link: the write goes through it, to its target (the link stays a
  link, as a shell redirection would leave it);
* a FIFO or a character device (``/dev/null``, a terminal): written directly,
  since a rename would replace the device or the pipe its reader holds;
* anything else (a directory, a block device, a socket): refused with an
  :class:`OSError` that names the path and what is there.

A temporary that a killed write left beside the file is removed by the next
write to it (:func:`~graphrunner.util.temp.remove_stale_temps`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from graphrunner.util.temp import remove_stale_temps, temp_path

__all__ = ["write_atomically"]


def _target(path: Path) -> tuple[Path, os.stat_result | None]:
    """The file a write to ``path`` lands in (symlinks followed) and its stat, if any."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        return target, os.stat(target)
    except FileNotFoundError:
        return target, None


def _write_in_place(target: Path, text: str) -> None:
    with open(target, "w", encoding="utf-8") as f:
        f.write(text)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that it is either untouched or complete,
    never half-written (see the module docstring for links, pipes and devices).

    Raises:
        OSError: the path holds a directory, a block device or a socket, or the
            write itself failed (nothing is left behind but what was there).
    """
    target, st = _target(Path(path))
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
            _write_in_place(target, text)
            return
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise OSError(f"{path} is {kind}; expected a regular file, a FIFO or a character device")
    remove_stale_temps(target)
    tmp = temp_path(target)
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
