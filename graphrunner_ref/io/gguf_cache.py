"""Where converted GGUF checkpoints (and the demo's downloads) are kept.

The cache root is ``$GRAPHRUNNER_CACHE`` when set, else
``$XDG_CACHE_HOME/graphrunner``, else ``~/.cache/graphrunner``. A ``.gguf``
given as ``--checkpoint`` is converted once into
``<root>/checkpoints/gguf-<first 32 hex digits of its SHA-256>``, named by
content alone: the same bytes under another file name reuse it, changed
bytes get a new directory (the file is hashed whole, in 1 MiB chunks, with
a progress bar on stderr past 256 MiB). Processes converting the same file coordinate
through a lock file beside it: one converts, the others wait and reuse.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from graphrunner_ref.io.gguf_import import GGUFImportError, convert_gguf, open_gguf

__all__ = ["CACHE_ENV", "cache_root", "checkpoint_dir", "converted_dir"]

#: The environment variable that overrides the cache root.
CACHE_ENV = "GRAPHRUNNER_CACHE"
#: Files at least this large show a progress bar while they are hashed.
_PROGRESS_BYTES = 256 << 20
_CHUNK = 1 << 20


def cache_root() -> Path:
    """The cache root (see the module docstring); not created here."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "graphrunner"


def converted_dir(gguf: Path) -> Path:
    """The cache directory GGUF file ``gguf`` converts into (by content)."""
    digest = hashlib.sha256()
    size = gguf.stat().st_size
    with (
        open(gguf, "rb") as f,
        tqdm(
            total=size,
            desc=f"hashing {gguf.name}",
            unit="B",
            unit_scale=True,
            disable=size < _PROGRESS_BYTES,
            leave=False,
        ) as bar,
    ):
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    return cache_root() / "checkpoints" / f"gguf-{digest.hexdigest()[:32]}"


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold the lock of cache entry ``out`` (a lock file beside it; released
    by the OS if the holder dies). The holder removes the file as it leaves
    (also on an error, Ctrl-C or SIGTERM), unless another process has made a
    new one at that path meanwhile: a waiter then locks a file no longer
    named, and re-checks the entry under it, as every holder does."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_name(f".{out.name}.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            _remove_if_ours(path, lock.fileno())
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_if_ours(path: Path, fd: int) -> None:
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            path.unlink()
    except FileNotFoundError:
        pass


def checkpoint_dir(path: Path) -> Path:
    """``path`` itself when it is not a ``.gguf`` file; else its converted
    directory in the cache, converting it first when it is not there (the
    location is printed to stderr). Raises
    :class:`~graphrunner_ref.io.gguf_import.GGUFImportError`, naming ``path``, when
    it cannot convert."""
    if path.suffix.lower() != ".gguf" or path.is_dir():
        return path
    open_gguf(path)  # a missing or unreadable file fails here, before any hashing
    out = converted_dir(path)
    if not (out / "config.json").is_file():  # converted before: no lock needed to read it
        with _locked(out):
            # Checked again under the lock: another process may have converted it.
            if not (out / "config.json").is_file():
                try:
                    convert_gguf(path, out)  # reported after: a failure prints its one line only
                except GGUFImportError as e:
                    raise GGUFImportError(f"{path}: {e}") from None
                print(
                    f"converted {path} into {out} (once; ${CACHE_ENV} or $XDG_CACHE_HOME "
                    "moves the cache)",
                    file=sys.stderr,
                )
                return out
    print(f"using {out} (converted from {path})", file=sys.stderr)
    return out
