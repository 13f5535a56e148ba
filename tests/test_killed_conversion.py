"""No temporary survives a signal: a conversion (``convert``, or ``generate``
converting a ``.gguf`` into the cache) stopped by SIGTERM mid-write removes
its temporary itself and exits 143; one SIGKILLed mid-write (no handler runs)
leaves it, and the next conversion into the same place removes it and writes
the same checkpoint as an uninterrupted run. Only temporaries whose writer is
provably gone are removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from graphrunner.util.atomic import write_atomically
from graphrunner.util.temp import remove_stale_temps, temp_path
from graphrunner_ref.io import load_model
from graphrunner_ref.io.gguf_cache import CACHE_ENV, checkpoint_dir, converted_dir
from graphrunner_ref.io.gguf_import import convert_gguf
from test_gguf_hostile import LAYERS, write

# The child writes half of model.safetensors into its temporary directory,
# says so on stdout, then blocks until the signal comes (never a timed guess).
CHILD = """
import sys
from pathlib import Path
import safetensors.torch
import graphrunner_ref.io.gguf_import as gguf_import
from graphrunner_ref.cli.main import main

def half_written(tensors, filename, metadata=None):
    data = safetensors.torch.save(tensors, metadata=metadata)
    with open(filename, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        print("writing", flush=True)
        sys.stdin.readline()  # blocks: the parent signals now

gguf_import.save_file = half_written
sys.exit(main(sys.argv[1:]))
"""


def _temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".tmp"))


def _same_checkpoint(got: Path, want: Path) -> None:
    assert json.loads((got / "config.json").read_text()) == json.loads(
        (want / "config.json").read_text()
    )
    a, b = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert load_model(got, max_requests=1, max_context_len=8).model.config.num_layers == LAYERS


# Each case starts two interpreters: each command under each signal.
_STOPS = [("convert", signal.SIGKILL), ("generate", signal.SIGTERM)]
_MORE = [("convert", signal.SIGTERM), ("generate", signal.SIGKILL)]


@pytest.mark.parametrize(
    ("command", "sig"),
    [*_STOPS, *_MORE],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v,
)
def test_a_conversion_stopped_mid_write_leaves_no_temporary_after_the_next_run(
    command: str, sig: signal.Signals, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write(tmp_path / "model.gguf")
    reference = convert_gguf(gguf, tmp_path / "reference")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # here and in the child
    if command == "convert":
        out = tmp_path / "out"
        argv = ["convert", "--gguf", str(gguf), "--out", str(out)]
    else:
        out = converted_dir(gguf)
        (tmp_path / "ids").write_text("[1, 2]\n")
        argv = ["generate", "--checkpoint", str(gguf), "--runner", "eager"]
        argv += ["--prompts", str(tmp_path / "ids")]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    marker = proc.stdout.readline()
    if marker != "writing\n":
        proc.kill()
        pytest.fail(f"the child did not start writing: {proc.communicate(timeout=60)[1][-2000:]}")
    (half,) = _temps(out.parent)
    assert (half / "model.safetensors").stat().st_size > 0
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, err[-2000:]
        assert err.splitlines()[-1] == f"graphrunner {command}: terminated"
        assert _temps(out.parent) == [] and not out.exists()
    else:
        assert proc.returncode == -signal.SIGKILL
        assert _temps(out.parent) == [half]  # no handler ran: the next run's to remove
    if command == "convert":
        convert_gguf(gguf, out)
    else:
        assert checkpoint_dir(gguf) == out
    assert _temps(out.parent) == []
    _same_checkpoint(out, reference)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    return child.pid


def test_only_temporaries_of_gone_writers_on_this_host_are_removed(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    mine = temp_path(dest)  # this process: alive
    tag, pid, rand = mine.name.removeprefix(".out.").removesuffix(".tmp").split("-")
    assert int(pid) == os.getpid()
    dead = _dead_pid()
    gone_dir = tmp_path / f".out.{tag}-{dead}-{rand}.tmp"
    gone_file = tmp_path / f".out.{tag}-{dead}-{'0' * 12}.tmp"
    keep = [
        mine,
        tmp_path / f".out.{'f' * 8 if tag != 'f' * 8 else 'e' * 8}-{dead}-{rand}.tmp",  # other host
        tmp_path / f".out.{rand}.tmp",  # a name that embeds no writer
        tmp_path / f".other.{tag}-{dead}-{rand}.tmp",  # beside another destination
        tmp_path / f".out.{tag}-0-{rand}.tmp",  # pid 0 names no writer
    ]
    gone_dir.mkdir()
    (gone_dir / "model.safetensors").write_bytes(b"half")
    for path in [gone_file, *keep]:
        path.write_text("x")
    assert sorted(remove_stale_temps(dest)) == sorted([gone_dir, gone_file])
    assert sorted(p for p in tmp_path.iterdir()) == sorted(keep)


def test_an_output_write_removes_what_a_killed_write_left(tmp_path: Path) -> None:
    out = tmp_path / "answers.txt"
    tag = temp_path(out).name.removeprefix(".answers.txt.").split("-")[0]
    left = tmp_path / f".answers.txt.{tag}-{_dead_pid()}-{'a' * 12}.tmp"
    left.write_text("half")
    write_atomically(out, "whole\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.txt"]
    assert out.read_text() == "whole\n"
