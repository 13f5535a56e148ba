"""bench/bench_serve_restart.py on the embedded model: three starts of
``graphrunner serve`` on 127.0.0.1, the same answer from each, and a restart
that loads the saved program faster than one that compiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_real_cpu, bench_serve_restart


def test_a_restart_loads_the_saved_step_and_answers_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_real_cpu, "RESULTS_DIR", tmp_path)
    serve = ["--threads", "1", "--max-bs", "2", "--quiet"]
    code = bench_serve_restart.main(["--max-tokens", "4", "--name", "t", "--", *serve])
    assert code == 0
    result = json.loads((tmp_path / "serve-restart-t.json").read_text())
    runs = result["runs"]
    assert list(runs) == list(bench_serve_restart.STARTS)
    answers = {tuple(r["tokens"]) for r in runs.values()}
    assert len(answers) == 1 and len(next(iter(answers))) == 4
    # Loaded, not compiled: several times faster than the in-process compile.
    restart, compiled = (runs[n]["seconds"] for n in bench_serve_restart.STARTS[1:])
    assert restart < compiled
    text = (tmp_path / "serve-restart-t.md").read_text()
    assert "| restart |" in text and "--max-bs 2" in text
