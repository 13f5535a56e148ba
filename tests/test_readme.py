"""The README's usage example runs as written (with the eager runner, so the
test does not compile graphs) and its replays pass the sanitizer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import graphrunner

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "expected one python example in the README"
    monkeypatch.setattr(graphrunner, "best_runner_kind", lambda: "eager")
    scope: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    runner = scope["runner"]
    assert isinstance(runner, graphrunner.GraphRunner) and runner.kind == "eager"
    assert runner.stats.replays == 4 and runner.stats.padded_rows == 4  # 3 rows -> graph of 4
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked == 4
    assert "total" in capsys.readouterr().out
