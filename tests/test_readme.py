"""The README's examples run as written: the declarations, and the usage
example (with the eager runner, so the test does not compile graphs), whose
replays pass the sanitizer."""

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
    usage = [b for b in blocks if "create_runner" in b]
    assert len(usage) == 1, "expected one usage example in the README"
    for block in blocks:
        if block is not usage[0]:
            exec(compile(block, str(README), "exec"), {})
    monkeypatch.setattr(graphrunner, "best_runner_kind", lambda: "eager")
    scope: dict[str, object] = {}
    exec(compile(usage[0], str(README), "exec"), scope)
    runner = scope["runner"]
    assert isinstance(runner, graphrunner.GraphRunner) and runner.kind == "eager"
    assert runner.stats.replays == 4 and runner.stats.padded_rows == 4  # 3 rows -> graph of 4
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked == 4
    assert "total" in capsys.readouterr().out


def test_readme_examples_import_only_the_public_api() -> None:
    """Everything a user needs is importable from ``graphrunner`` itself:
    ``__all__`` is the contract, and the examples prove it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    deep = [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if re.match(r"\s*(from|import) graphrunner\.", line)
    ]
    assert deep == []
    assert sorted(graphrunner.__all__) == sorted(set(graphrunner.__all__))
    missing = [name for name in graphrunner.__all__ if not hasattr(graphrunner, name)]
    assert missing == []
