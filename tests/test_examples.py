"""The files under ``examples/`` run as written, as the README and the docs
pages tell a reader to run them: ``python examples/NAME.py`` from the
repository root, exit status 0, and the line they print says what was checked.

``examples/own_batch.py`` replays a batch class of its own (not
``DecodeBatch``) and compares each replay with the eager forward run on a copy
of the pools; the tests below also run it with a forward whose padded row
writes outside the sink slot 0, and check that it then fails.
``examples/own_model.py`` is also run in-process by ``tests/test_readme.py``
(with the eager runner; as written it compiles with the CPU runner)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
OWN_BATCH = EXAMPLES / "own_batch.py"
OWN_MODEL = EXAMPLES / "own_model.py"
#: The padded row's KV write in own_batch.py, which the stray variants replace.
SINK_WRITE = "kv.set_kv(0, b.out_cache_loc, q, -q)"


def _run(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package
    return subprocess.run(
        [sys.executable, str(script.relative_to(ROOT)), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == ["own_batch.py", "own_model.py"]


def test_own_batch_is_short_and_brings_its_own_batch() -> None:
    text = OWN_BATCH.read_text()
    assert len(text.splitlines()) <= 60
    assert "DecodeBatch(" not in text and "DecodeBatch." not in text
    assert "class MyBatch" in text and "create_runner(" in text
    assert text.count(SINK_WRITE) == 1


def test_own_batch_runs_as_written() -> None:
    done = _run(OWN_BATCH)
    assert done.returncode == 0, done.stderr[-3000:]
    kind = "cuda" if torch.cuda.is_available() else "eager"
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith(f"{kind}: RunnerStats(replays=4,"), line
    assert "live_rows=12" in line and "padded_rows=4" in line  # 3 rows -> the graph of 4, x4
    assert line.endswith("state rows equal: True"), line
    worst = float(re.search(r"max \|graph - eager\| (\S+);", line).group(1))
    assert worst < 1e-5


def test_own_batch_on_the_cpu_runner() -> None:
    done = _run(OWN_BATCH, "cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("cpu: RunnerStats(replays=4,")


@pytest.mark.parametrize(
    ("slot", "caught_by"),
    [
        # a live request's slot: its logits and its KV differ from eager
        ("b.out_cache_loc.max()", "logits"),
        # the next free slot, read by nobody this step (and written at
        # capture too): the logits agree, only the state shows it
        ("b.out_cache_loc.max() + 1", "state"),
    ],
)
def test_own_batch_fails_on_a_padded_row_writing_outside_the_sink(
    tmp_path: Path, slot: str, caught_by: str
) -> None:
    """The example's comparison can fail: a forward whose padded rows write
    KV slot ``slot`` instead of the sink 0 exits 1, whether the stray write
    reaches a live row's output or only the pools."""
    stray = f"kv.set_kv(0, torch.where(b.req_pool_indices == 0, {slot}, b.out_cache_loc), q, -q)"
    script = tmp_path / "own_batch_stray.py"
    script.write_text(OWN_BATCH.read_text().replace(SINK_WRITE, stray))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), "eager"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.endswith("state rows equal: False"), line
    worst = float(re.search(r"max \|graph - eager\| (\S+);", line).group(1))
    assert (worst >= 1e-5) == (caught_by == "logits"), line


def test_own_model_runs_as_written() -> None:
    done = _run(OWN_MODEL)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert "replays=4" in line and "live_rows=12" in line and "padded_rows=4" in line, line
    assert float(line.rsplit(" ", 1)[1]) < 1e-5, line
