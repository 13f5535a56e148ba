"""``graphrunner sizes --plot FILE.png``: the served traffic as a histogram,
the chosen capture sizes, and the padding each served size pays under them.

matplotlib is imported only here, and only when a picture is drawn (the
``plots`` extra); the figure is built without pyplot, so drawing touches no
global state and needs no display. ``bench/plots.py`` draws its padding
panels through :func:`draw_padding` too.
"""

from __future__ import annotations

import importlib.util
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from graphrunner.sizing import default_capture_sizes, expected_waste, pad_to
from graphrunner.util import remove_stale_temps, temp_path
from graphrunner_ref.cli.common import UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "MISSING",
    "check_plot",
    "draw_padding",
    "padding_figure",
    "padding_fractions",
    "plot_plan",
    "write_png",
]

#: What to run when matplotlib is not installed.
MISSING = "drawing needs matplotlib: pip install 'graphrunner[plots]'"
DPI = 120


def check_plot(path: Path) -> None:
    """Refuse (:class:`UsageError`) a ``--plot`` that is no ``.png`` name, or
    matplotlib missing, before any work."""
    if path.suffix.lower() != ".png":
        raise UsageError(f"--plot {path}: expected a file name ending in .png")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"--plot {path}: {MISSING}")


def plot_plan(path: Path, title: str, counts: Mapping[int, int], sizes: Sequence[int]) -> None:
    """Draw trace ``counts`` under the chosen ``sizes`` (marked) and under the
    default list of the same largest size; write it to ``path``."""
    lists = {"default": default_capture_sizes(sizes[-1]), "optimum": list(sizes)}
    write_png(padding_figure(counts, lists, title, mark="optimum"), path)


def padding_fractions(capture: Sequence[int], sizes: Sequence[int]) -> list[float]:
    """Per served size in ``sizes``: the percent of the rows its graph computes
    that are padding under capture list ``capture`` (0 above its largest size,
    which runs eagerly)."""
    return [100 * (1 - b / pad_to(capture, b)) if b <= capture[-1] else 0.0 for b in sizes]


def draw_padding(
    ax: Axes,
    counts: Mapping[int, int],
    lists: Mapping[str, Sequence[int]],
    title: str,
    *,
    mark: str | None = None,
) -> None:
    """On ``ax``: one grey bar per served batch size (its share of the
    ``counts`` steps, on a twin axis), one line per capture list in ``lists``
    (the padding per served size, :func:`padding_fractions`) and, with
    ``mark``, one dotted vertical line at each size of list ``mark``."""
    import matplotlib.ticker

    sizes = sorted(counts)
    steps = sum(counts.values())
    wide = sizes[-1] > 64  # a log axis gives the small, busy sizes room
    share = ax.twinx()
    widths = [0.8 * b * 0.06 if wide else 0.8 for b in sizes]
    share.bar(sizes, [100 * counts[b] / steps for b in sizes], widths, color="0.85")
    share.set_ylabel("share of steps (%), grey bars", color="0.45")
    share.set_ylim(0, 2 * share.get_ylim()[1])  # bars in the lower half, under the legend
    ax.set_zorder(share.get_zorder() + 1)  # lines over the bars
    ax.patch.set_visible(False)
    for (label, capture), style in zip(lists.items(), ("-", "--", ":"), strict=False):
        total = expected_waste(capture, counts).fraction
        ax.plot(sizes, padding_fractions(capture, sizes), style, lw=1.2,
                marker="." if not wide else None,
                label=f"{label}: {total:.2%} of all rows computed")  # fmt: skip
    if mark is not None:
        for k, size in enumerate(lists[mark]):
            ax.axvline(size, color="tab:red", ls=":", lw=0.9,
                       label=f"{mark}: the sizes captured" if k == 0 else None)  # fmt: skip
    if wide:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set(title=f"{title}\n{steps:,} steps", xlabel="live batch size")
    ax.set_ylabel("padded rows / rows computed at that size (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", fontsize="small", framealpha=0.9)


def padding_figure(
    counts: Mapping[int, int], lists: Mapping[str, Sequence[int]], title: str, *, mark: str
) -> Figure:
    """A one-panel figure of :func:`draw_padding` (not yet written anywhere).
    Raises :class:`ImportError` naming the ``plots`` extra without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(MISSING) from None
    fig = Figure(figsize=(7.5, 4.8))
    draw_padding(fig.add_subplot(), counts, lists, title, mark=mark)
    fig.tight_layout()
    return fig


def write_png(fig: Figure, path: Path) -> None:
    """Write ``fig`` to ``path`` as a PNG, atomically: rendered in memory, then
    a temporary file beside ``path`` renamed over it."""
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=DPI)
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        tmp.write_bytes(data.getvalue())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
