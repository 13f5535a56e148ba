"""``bench.bench_multiturn`` end to end on a tiny chat checkpoint: every turn
of every conversation is timed, the history each turn resends is found in
the prefix cache (the hit rate ``/metrics`` reports), and the table gives
each turn's TTFT and the last over the first."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

import bench.bench_multiturn as b
from gguf_world import tiny_text_checkpoint


def _args(**over: object) -> argparse.Namespace:
    base = dict(conversations=2, turns=2, system_len=8, question_len=2, answer_len=3)
    return argparse.Namespace(**{**base, "name": "t", "model": "m", **over})


def test_each_turn_is_timed_and_the_history_hits_the_cache(tmp_path: Path) -> None:
    ckpt = tmp_path / "hf"
    tiny_text_checkpoint(ckpt)
    command = [sys.executable, "-m", "graphrunner", "serve", str(ckpt), "--port", "{port}"]
    command += ["--runner", "eager", "--max-bs", "2", "--served-model-name", "m", "--quiet"]
    row = b.run_contender(b.Contender("tiny", tuple(command)), _args(), tmp_path)
    assert len(row["ttft_p50_ms"]) == 2 and all(t > 0 for t in row["ttft_p50_ms"])
    # Turn 2 resends turn 1's history, and the conversations share the
    # system prompt: about half the looked-up prompt tokens are cached.
    assert row["hit_rate"] is not None and row["hit_rate"] > 0.4, row


def test_the_table_gives_each_turn_and_last_over_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(b, "RESULTS_DIR", tmp_path)
    rows: dict[str, dict[str, Any]] = {
        "a": {"ttft_p50_ms": [100.0, 110.0, 120.0], "hit_rate": 0.8},
        "b": {"ttft_p50_ms": [100.0, 200.0, 300.0], "hit_rate": None},
    }
    b.write_results(_args(), rows)
    text = (tmp_path / "multiturn-t.md").read_text()
    assert "| a | 100 | 110 | 120 | 1.20x | 80% |" in text
    assert "| b | 100 | 200 | 300 | 3.00x | — |" in text
