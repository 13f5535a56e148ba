"""The served-batch-size histogram: counted per replay by the runner (graphs
and eager fallbacks, nothing for a refused batch), the same in the engine's
step counts, and its files (JSON and one size per line)."""

from __future__ import annotations

import json
import warnings

import pytest

from graphrunner import create_runner, decode_buffer_specs
from graphrunner.sizing.histogram import BatchSizeHistogram, HistogramFileError, read_histogram
from graphrunner.sizing.sizes import BatchSizeError
from graphrunner.testing import ToyWorld
from test_engine import _engine, _trace


def test_runner_counts_each_replay_by_raw_size_eager_fallbacks_included():
    world = ToyWorld()
    runner = create_runner(
        world.model,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[2, 4],
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    for bs in (3, 1, 3, 4):
        runner.replay(world.make_batch(bs, seed=bs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.replay(world.make_batch(6, seed=6))  # above 4: eager
    empty = world.make_batch(1, seed=0)
    empty.filter([])
    with pytest.raises(BatchSizeError):
        runner.replay(empty)  # refused: not served, not counted
    assert runner.batch_sizes.counts() == {1: 1, 3: 2, 4: 1, 6: 1}
    assert runner.batch_sizes.steps == runner.stats.replays + runner.stats.eager_fallbacks
    assert runner.batch_sizes.rows == runner.stats.live_rows


def test_engine_step_counts_equal_the_runners_histogram():
    engine = _engine()
    result = engine.run(_trace(12, seed=5))
    assert result.stats.histogram == engine.runner.batch_sizes
    assert result.stats.histogram.steps == result.stats.steps
    assert len(result.stats.histogram.counts()) > 1


def test_json_round_trip(tmp_path):
    hist = BatchSizeHistogram.from_sizes([3, 3, 1, 17])
    hist.write(tmp_path / "h.json")
    doc = json.loads((tmp_path / "h.json").read_text())
    assert doc == {"format": "graphrunner.batch_sizes", "version": 1,
                   "counts": {"1": 1, "3": 2, "17": 1}}  # fmt: skip
    assert read_histogram(tmp_path / "h.json") == hist
    assert list(tmp_path.iterdir()) == [tmp_path / "h.json"]  # no temporary left


def test_one_size_per_line_with_comments_and_blanks(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("# served\n3\n\n 5 \n3  # again\n")
    assert read_histogram(path).counts() == {3: 2, 5: 1}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("3\n0\n", r"t:2: '0'; expected one batch size"),
        ("3\nfour\n", r"t:2: 'four'"),
        ("-2\n", r"t:1: '-2'"),
        ("# nothing\n\n", "no batch sizes"),
        ('{"format": "graphrunner.batch_sizes", "version": 1, "counts": {"3": -1}}', "count -1"),
        ('{"format": "graphrunner.batch_sizes", "version": 1, "counts": {"x": 1}}', "'x'"),
        ('{"format": "graphrunner.batch_sizes", "version": 1, "counts": {"2": true}}', "True"),
        ('{"format": "other", "version": 1, "counts": {}}', "format 'other'"),
        ('{"format": "graphrunner.batch_sizes", "version": 1, "counts": []}', "'counts'"),
        ('{"format": ', "not valid JSON"),
    ],
)
def test_bad_files_name_the_file_line_and_value(tmp_path, text, match):
    path = tmp_path / "t"
    path.write_text(text)
    with pytest.raises(HistogramFileError, match=match):
        read_histogram(path)


def test_missing_and_directory(tmp_path):
    with pytest.raises(HistogramFileError, match="no such file"):
        read_histogram(tmp_path / "absent")
    with pytest.raises(HistogramFileError, match="is a directory"):
        read_histogram(tmp_path)


def test_bad_entries_refused():
    with pytest.raises(ValueError, match="batch size 0"):
        BatchSizeHistogram({0: 1})
    with pytest.raises(ValueError, match=r"sizes\[1\]: batch size True"):
        BatchSizeHistogram.from_sizes([2, True])
