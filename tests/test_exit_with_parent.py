"""engine/launch.py's exit_with_parent: a spawned rank whose launcher is
killed outright (SIGKILL: no cleanup runs) ends within a second or two
instead of waiting out its collective timeout as an orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The launcher: starts a child that watches it (or not) and sleeps, prints the
# child's pid, then sleeps itself until killed.
LAUNCHER = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from graphrunner_ref.engine.launch import exit_with_parent

    def child(watch, ready):
        if watch:
            exit_with_parent(poll_s=0.1)
        ready.set()
        time.sleep(30)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        p = ctx.Process(target=child, args=(sys.argv[1] == "1", ready))
        p.start()
        ready.wait(60)
        print(p.pid, flush=True)
        time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("watch", [True, False], ids=["watched", "unwatched"])
def test_a_child_ends_soon_after_its_launcher_is_killed(tmp_path: Path, watch: bool) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen(
        [sys.executable, str(script), "1" if watch else "0"], stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Unwatched, the orphan outlives the 5 s (the guard that the test can fail).
        assert _alive(child) != watch
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
