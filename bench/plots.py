"""The pictures ``make bench`` writes next to its tables (PNG, matplotlib):
step time against batch size per runner, padded-row fraction per served size
for a trace, and capture seconds and pool memory per captured size.

Drawn from the files in ``bench/results/`` alone (the tables' JSON, capture
reports ``capture-*.json``, traces ``padding-*.json``), so the pictures always
show the committed numbers: ``python -m bench.plots`` redraws them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a CI box

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from graphrunner.sizing.report import CaptureReport, SizeReport  # noqa: E402
from graphrunner.sizing.report_file import read_capture_report  # noqa: E402
from graphrunner_ref.cli.sizes_plot import draw_padding  # noqa: E402

DPI = 120
#: One colour per variant, the same in every picture.
COLOURS = {"eager": "tab:gray", "cpu": "tab:blue", "cuda": "tab:green", "cuda+compile": "tab:red"}


@dataclass(frozen=True)
class PaddingPanel:
    """One trace ({raw bs: steps}) and the capture lists to compare on it."""

    title: str
    counts: Mapping[int, int]
    lists: Mapping[str, Sequence[int]]

    def write(self, path: Path) -> None:
        doc = asdict(self)
        doc["counts"] = {str(bs): n for bs, n in sorted(self.counts.items())}
        doc["lists"] = {k: list(v) for k, v in self.lists.items()}
        path.write_text(json.dumps(doc, indent=1) + "\n")

    @classmethod
    def read(cls, path: Path) -> PaddingPanel:
        doc = json.loads(path.read_text())
        counts = {int(bs): n for bs, n in doc["counts"].items()}
        return cls(doc["title"], counts, doc["lists"])


def draw_all(results: Path) -> list[Path]:
    """Every picture the files in ``results`` allow; returns the paths written."""
    written = []
    for table in sorted(results.glob("*.json")):
        doc = json.loads(table.read_text())
        if "seconds" not in doc:  # a capture report or a trace
            continue
        per_bs = {
            int(bs): {v: stats["median"] for v, stats in variants.items()}
            for bs, variants in doc["seconds"].items()
        }
        if len(per_bs) > 1 and any("eager" in v for v in per_bs.values()):
            written.append(table.with_suffix(".png"))
            step_times(doc.get("group", table.stem), per_bs, written[-1])
    # padding-fuzz-*.json is a table, not a trace: a panel has counts and lists.
    panels = [
        PaddingPanel.read(p)
        for p in sorted(results.glob("padding-*.json"))
        if "counts" in json.loads(p.read_text())
    ]
    if panels:
        written.append(results / "padding-per-size.png")
        padding_per_size(panels, written[-1])
    reports = dict(_report(p) for p in sorted(results.glob("capture-*.json")))
    if reports:
        written.append(results / "capture-costs.png")
        capture_costs(reports, written[-1])
    return written


def _report(path: Path) -> tuple[str, CaptureReport]:
    report, mechanism = read_capture_report(path)
    return mechanism, report


def step_times(group: str, medians: Mapping[int, Mapping[str, float]], path: Path) -> None:
    """Median step time (µs) against live batch size, one line per variant."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    variants = sorted({v for per_bs in medians.values() for v in per_bs})
    for variant in variants:
        points = sorted((bs, m[variant]) for bs, m in medians.items() if variant in m)
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, [y * 1e6 for y in ys], "o-", label=variant, color=COLOURS.get(variant))
    ax.set(title=f"{group}: one step", xlabel="live batch size", ylabel="median step time (µs)")
    ax.set_xticks(sorted(medians))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def padding_per_size(panels: Sequence[PaddingPanel], path: Path) -> None:
    """Per served size: the fraction of computed rows that are padding under
    each list (lines), over the trace's share of steps (bars)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        _padding_panel(ax, panel)
    _save(fig, path)


def _padding_panel(ax: Axes, panel: PaddingPanel) -> None:
    draw_padding(ax, panel.counts, panel.lists, panel.title)


def capture_costs(reports: Mapping[str, CaptureReport], path: Path) -> None:
    """Capture seconds per captured size, per mechanism, and beside it the pool
    bytes of the mechanisms that pool memory (CUDA graphs), when any report
    has them: a panel with nothing to show is not drawn."""
    pooled = {
        label: report
        for label, report in reports.items()
        if all(s.memory_bytes is not None for s in report.sizes)
    }
    panels = 2 if pooled else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    secs = axes[0][0]
    ticks = _bars(secs, reports, lambda s: s.seconds)
    secs.set(title="capture time per size (warm-up and compile included)", ylabel="seconds")
    if pooled:
        mem = axes[0][1]
        _bars(mem, pooled, lambda s: (s.memory_bytes or 0) / 2**20)
        mem.set(title="graph pool bytes each size added", ylabel="MiB")
    for ax in axes[0]:
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlabel("captured batch size (captured largest first)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    _save(fig, path)


def _bars(
    ax: Axes, reports: Mapping[str, CaptureReport], value: Callable[[SizeReport], float]
) -> list[str]:
    """One bar group per captured size, one bar per mechanism; returns the tick labels."""
    width = 0.8 / max(len(reports), 1)
    ticks: list[str] = []
    for k, (label, report) in enumerate(sorted(reports.items())):
        sizes = sorted(report.sizes, key=lambda s: s.bs)
        xs = [i + (k - (len(reports) - 1) / 2) * width for i in range(len(sizes))]
        ax.bar(xs, [value(s) for s in sizes], width, label=label, color=COLOURS.get(label))
        ticks = [str(s.bs) for s in sizes]
    return ticks


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


if __name__ == "__main__":
    for written in draw_all(
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results"
    ):
        print(f"picture written to {written}")
