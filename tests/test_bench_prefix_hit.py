"""bench/bench_prefix_hit.py on the embedded model, small sizes: the hit
request really hits (its cached tokens are the prefix's full pages), the
alone and miss requests cache nothing, and the report gives the ratios;
with the cache off the bench's own check fails, so a broken hit cannot pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import bench_prefix_hit
from bench.bench_prefix_hit import FreshPrompts

#: The embedded model, eager steps, 8-token suffixes, 2 rounds of 2 pairs.
SMALL = ("--runner", "eager", "--suffix", "8", "--rounds", "2", "--pairs", "2")


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> tuple[int, dict[str, Any], str]:
    monkeypatch.setattr(bench_prefix_hit, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("GRAPHRUNNER_TOKEN_BATCHES", "1")  # the bench's path, not the suite's
    code = bench_prefix_hit.main([*SMALL, "--name", "t", *extra])
    result = json.loads((tmp_path / "prefix-hit-t.json").read_text())
    return code, result, (tmp_path / "prefix-hit-t.md").read_text()


@pytest.mark.parametrize(("prefix", "page", "full_pages"), [(64, 1, 64), (66, 4, 64)])
def test_the_hit_caches_the_prefix_full_pages_and_the_others_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: int, page: int, full_pages: int
) -> None:
    code, result, text = _run(
        tmp_path, monkeypatch, "--prefix", str(prefix), "--page-size", str(page)
    )
    assert code == 0
    (row,) = result["rows"]
    assert row["timed"] == {"hit": 4, "alone": 4, "miss": 2}
    assert row["cached"]["hit"] == [full_pages] * 4
    assert row["cached"]["alone"] == [0] * 4 and row["cached"]["miss"] == [0] * 2
    assert row["cached_ok"] and row["hit_rate"] == full_pages / (prefix + 8)
    best = row["best_s"]
    assert row["hit_over_alone"] == best["hit"] / best["alone"]
    assert row["miss_over_hit"] == best["miss"] / best["hit"]
    paired = sorted(h / a for h, a in zip(*map(row["seconds"].get, ("hit", "alone")), strict=True))
    assert row["hit_over_alone_paired_median"] == pytest.approx(sum(paired[1:3]) / 2)
    assert f"**{row['hit_over_alone']:.2f}x**" in text
    assert f" | {row['hit_over_alone_paired_median']:.2f}x | " in text
    assert f"| {row['miss_over_hit']:.1f}x |" in text
    cells = f"| {full_pages} of {full_pages} expected | {row['hit_rate']:.1%} | 0 / 0 |"
    # 8 uncached tokens replay the captured size 8; the miss's the next size up.
    assert f"{cells} 8 / 8 / 128 |" in text
    assert "hit / alone (goal <= 1.2x)" in text and "| miss / hit |" in text
    assert f"- P={prefix}: the hit takes " in text and " ms per 1,000 cached tokens" in text
    assert "`PYTHONPATH=. .venv/bin/python -m bench.bench_prefix_hit --runner eager" in text
    assert "- device: " in text and "kernel: " in text and "load average" in text


def test_without_the_cache_the_hit_check_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, result, text = _run(tmp_path, monkeypatch, "--prefix", "64", "--no-prefix-caching")
    (row,) = result["rows"]
    assert row["cached"]["hit"] == [0] * 4 and not row["cached_ok"]
    assert code == 1 and "prefix caching OFF" in text
    assert "| 0 of 64 expected | 0.0% |" in text
    assert "**The cache did not hold what it should at P = [64]**" in text


def test_fresh_prompts_never_share_a_first_token() -> None:
    fresh = FreshPrompts(vocab=9, seed=3)
    prompts = [fresh(3) for _ in range(8)]
    assert sorted(p[0] for p in prompts) == list(range(1, 9))
    assert all(len(p) == 3 and set(p) <= set(range(1, 9)) for p in prompts)
    with pytest.raises(RuntimeError, match="no fresh first token left in vocab 9"):
        fresh(3)
