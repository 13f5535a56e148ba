"""How a command ends: one line on stderr and an exit status for every way it
can stop. A usage error (or an optional package missing, naming the extra
that brings it) exits 2, a padding violation 1, Ctrl-C 130 and SIGTERM
143 (both unwind, so every ``finally`` runs: a run frees the slots it handed
out and leaves no temporary file), a closed stdout pipe 141 without a word,
as Unix tools do."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from graphrunner import PaddingViolation
from graphrunner.util import MissingExtraError
from graphrunner_ref.cli.common import UsageError

__all__ = ["Terminated", "run_command", "stopped_by_signals"]


class Terminated(BaseException):
    """SIGTERM arrived; raised like KeyboardInterrupt, so cleanup runs."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Within: SIGTERM raises :class:`Terminated` (on the main thread only,
    where Python delivers signals); the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush into the
    closed pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def run_command(name: str, call: Callable[[], int]) -> int:
    """``call()``'s exit status, or the status of how it stopped (see the
    module docstring), its one line prefixed with ``name``."""
    try:
        with stopped_by_signals():
            return call()
    except (UsageError, MissingExtraError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except PaddingViolation as e:
        print(f"{name}: padding violation: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 143
    except BrokenPipeError:
        quiet_stdout()
        return 141
