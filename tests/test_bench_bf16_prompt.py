"""bench/bench_bf16_prompt.py: the chunk path's figures come from outputs
checked equal to the tile path's, and bad arguments are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_bf16_prompt
from graphrunner_ref.model.cpu_features import kernel_path


def test_bad_rows_and_rounds_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, named in ((["--rows", "8"], "--rows [8]"), (["--rounds", "0"], "--rounds 0")):
        with pytest.raises(SystemExit):
            bench_bf16_prompt.main(argv)
        assert named in capsys.readouterr().err


def test_a_short_run_checks_both_paths_and_reports_their_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernel_path("int4-bf16") is None:
        pytest.skip("no int4-bf16 kernel on this CPU")
    monkeypatch.setattr(bench_bf16_prompt, "SHAPES", {"small": (70, 96)})
    monkeypatch.setattr(bench_bf16_prompt, "RESULTS_DIR", tmp_path)
    assert bench_bf16_prompt.main(["--rows", "9", "23", "--rounds", "2", "--out", "t"]) == 0
    text = (tmp_path / "t.md").read_text()
    assert "| small | 70 x 96 | 9 |" in text and "| small | 70 x 96 | 23 |" in text
    ms = bench_bf16_prompt.measure(70, 96, 23, rounds=1)
    assert set(ms) == {"chunk", "tiles"} and all(v > 0 for v in ms.values())
