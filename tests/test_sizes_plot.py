"""``graphrunner sizes --plot``: the picture of a trace under the chosen sizes,
drawn from the installed package and written atomically; bad ``--plot``
values and a missing matplotlib refused before any work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner.sizing.plan import optimal_capture_sizes
from graphrunner.sizing.sizes import default_capture_sizes
from graphrunner_ref.cli import sizes_plot

PNG = b"\x89PNG\r\n\x1a\n"
COUNTS = {1: 50, 2: 30, 3: 20, 5: 10, 7: 6, 12: 3, 16: 1}


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.txt"
    path.write_text("".join(f"{bs}\n" * n for bs, n in COUNTS.items()))
    return path


def test_padding_fractions_are_the_padded_share_of_each_graph() -> None:
    # 3 pads to 4 (1 of 4 rows), 5 to 8 (3 of 8), 8 exactly, 9 runs eagerly.
    assert sizes_plot.padding_fractions([1, 4, 8], [1, 3, 5, 8, 9]) == [0, 25, 37.5, 0, 0]


def test_the_figure_has_a_bar_per_size_a_line_per_list_and_a_mark_per_chosen_size() -> None:
    chosen = list(optimal_capture_sizes(COUNTS, 3, max_bs=16).sizes)
    lists = {"default": default_capture_sizes(16), "optimum": chosen}
    fig = sizes_plot.padding_figure(COUNTS, lists, "trace", mark="optimum")
    ax, share = fig.axes
    assert [round(p.get_height(), 6) for p in share.patches] == [
        round(100 * n / 120, 6) for n in COUNTS.values()
    ]
    lines = ax.get_lines()
    assert len(lines) == len(lists) + len(chosen)
    for line, capture in zip(lines, lists.values(), strict=False):
        assert list(line.get_xdata()) == sorted(COUNTS)
        assert list(line.get_ydata()) == sizes_plot.padding_fractions(capture, sorted(COUNTS))
    assert [line.get_xdata()[0] for line in lines[len(lists) :]] == chosen


def test_sizes_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picture = tmp_path / "sizes.png"
    argv = ["sizes", "--trace", str(_trace(tmp_path)), "--graphs", "3", "--plot", str(picture)]
    assert cli.main(argv) == 0
    assert picture.read_bytes().startswith(PNG)
    assert f"picture written to {picture}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sizes.png", "trace.txt"]


def test_a_failed_write_leaves_the_old_picture_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    picture = tmp_path / "sizes.png"
    picture.write_bytes(b"old")

    def fail(src: object, dst: object) -> None:
        tmp = Path(str(src))  # the whole picture is in the temporary beside it
        assert tmp.parent == tmp_path and tmp.name.startswith(".sizes.png.")
        assert tmp.read_bytes().startswith(PNG)
        raise OSError("disk full")

    monkeypatch.setattr(sizes_plot.os, "replace", fail)
    fig = sizes_plot.padding_figure(COUNTS, {"optimum": [2, 16]}, "t", mark="optimum")
    with pytest.raises(OSError, match="disk full"):
        sizes_plot.write_png(fig, picture)
    assert picture.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sizes.png"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("sizes.jpg", "expected a file name ending in .png"),
        ("no-dir/sizes.png", "does not exist"),
    ],
)
def test_a_bad_plot_path_exits_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, message: str
) -> None:
    argv = ["sizes", "--trace", str(_trace(tmp_path)), "--graphs", "3"]
    assert cli.main([*argv, "--plot", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"--plot {tmp_path / name}: " in captured.err and message in captured.err


def test_without_matplotlib_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find = importlib.util.find_spec
    monkeypatch.setattr(
        sizes_plot.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else find(name, *a),
    )
    argv = ["sizes", "--trace", str(_trace(tmp_path)), "--graphs", "3"]
    assert cli.main([*argv, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'graphrunner[plots]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
