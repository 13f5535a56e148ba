"""bench/bench_prompt_attention.py: its torch path is the attention the kernel
must meet, its work counts the causal pairs, and a short run reports both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import bench_prompt_attention as bench
from graphrunner_ref.model.attention_cpu import cpp_prompt_runs


def test_the_work_counts_each_tokens_own_keys() -> None:
    per_pair = 4.0 * bench.HEADS * bench.DIM
    assert bench.flops(3, 3) == 6 * per_pair  # 1 + 2 + 3 keys
    assert bench.flops(2, 10) == (9 + 10) * per_pair


def test_bad_arguments_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, named in ((["--rounds", "0"], "--rounds 0"), (["--max-len", "0"], "--max-len 0")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert named in capsys.readouterr().err


def test_a_short_run_checks_and_reports_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not cpp_prompt_runs(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)):
        pytest.skip("the C++ prompt attention does not run here")
    monkeypatch.setattr(bench, "CASES", [("hit", 5, 40), ("whole", 33, 33)])
    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path)
    assert bench.main(["--rounds", "1", "--cache", "float32", "--out", "t"]) == 0
    text = (tmp_path / "t.md").read_text()
    assert "| hit | 5 | 40 | float32 |" in text and "| whole | 33 | 33 | float32 |" in text
