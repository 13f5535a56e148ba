"""How a command stops: Ctrl-C exits 130 and SIGTERM 143, each with one line
and no traceback; a reader that closes the pipe ends the command quietly."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

DEMO = [sys.executable, "-m", "graphrunner", "demo", "--runner", "eager", "--steps", "20000"]


def _ctrl_c_as_at_a_terminal() -> None:
    """In the child before it starts: a runner started as a background job
    ignores SIGINT and its children inherit that; a terminal's command does not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    "sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_mid_run_ends_with_one_line(sig: signal.Signals, code: int, word: str) -> None:
    proc = subprocess.Popen(
        DEMO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the run has started
    assert first.startswith("device:"), first
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    assert err.rstrip().splitlines()[-1] == f"graphrunner demo: {word}"


def test_a_closed_pipe_ends_quietly() -> None:
    reader = "import sys; sys.stdin.readline()"  # one line, then close the pipe
    # Into a pipe the lines after the first wait in stdout's buffer until the
    # run ends, so the write that meets the closed pipe is the last flush
    # whatever the run's length: a short run (20,000 steps took 155 s in a
    # loaded suite) tests the same exit.
    short = [*DEMO[:-1], "200"]
    demo = subprocess.Popen(short, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen([sys.executable, "-c", reader], stdin=demo.stdout)
    assert demo.stdout is not None
    demo.stdout.close()  # only the reader holds the pipe now
    head.wait(timeout=120)
    _, err = demo.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err[-2000:]
    assert demo.returncode == 141
