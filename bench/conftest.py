"""Benchmark plumbing: collect medians, print ratios against the baseline
measured in the same run, and write them with the machine to bench/results/,
with pictures (:mod:`bench.plots`) beside the tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from graphrunner.sizing.report import CaptureReport
from graphrunner.testing import torch_threads

#: Where results files go: bench/results, or GRAPHRUNNER_RESULTS_DIR (the
#: suite's run of the docs' commands sets it, so it never writes the checkout).
RESULTS_DIR = Path(os.environ.get("GRAPHRUNNER_RESULTS_DIR") or Path(__file__).parent / "results")

#: (group, batch size) -> {variant: median seconds}; baselines are named "eager".
MEDIANS: dict[tuple[str, int], dict[str, float]] = {}
#: (group, batch size) -> {variant: summary statistics in seconds, and rounds}.
STATS: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
_STAT_FIELDS = ("min", "median", "mean", "stddev", "iqr", "max", "rounds")
#: Extra per-row facts (e.g. device ops per populate), by (group, batch size).
FACTS: dict[tuple[str, int], dict[str, object]] = {}
#: The variant each group's ratios are taken against, where it is not "eager".
BASELINES: dict[str, str] = {}
#: Capture reports by mechanism label, drawn as capture-costs.png.
CAPTURES: dict[str, CaptureReport] = {}
#: Traces and the capture lists compared on them (bench.plots.PaddingPanel), by name.
PADDING: dict[str, Any] = {}


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def record(benchmark: object, group: str, bs: int, variant: str) -> None:
    """Remember the median of a finished pytest-benchmark run (no-op when disabled)."""
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        MEDIANS.setdefault((group, bs), {})[variant] = stats.stats.median
        summary = {f: float(getattr(stats.stats, f)) for f in _STAT_FIELDS}
        STATS.setdefault((group, bs), {})[variant] = summary


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
    return {
        "device": device,
        "cpus": str(os.cpu_count()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def command(module: str, argv: Sequence[str] | None) -> str:
    """How bench ``module`` was run, for its results: ``PYTHONPATH=.
    .venv/bin/python -m bench.MODULE`` and its arguments (``argv``, or the
    process's own where None)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["PYTHONPATH=. .venv/bin/python -m", f"bench.{module}", *args])


def table(groups: list[str]) -> list[str]:
    baseline = BASELINES.get(groups[0], "eager") if len(groups) == 1 else "eager"
    lines = [
        f"| group | bs | variant | median (µs) | vs {baseline} | facts |",
        "|---|---|---|---|---|---|",
    ]
    for (group, bs), variants in sorted(MEDIANS.items()):
        if group not in groups:
            continue
        base = variants.get(BASELINES.get(group, "eager"))
        for variant, median in sorted(variants.items()):
            is_base = variant == BASELINES.get(group, "eager")
            ratio = f"{base / median:.2f}x" if base and not is_base else ""
            facts = json.dumps(FACTS.get((group, bs), {})) if variant == min(variants) else ""
            lines.append(f"| {group} | {bs} | {variant} | {median * 1e6:.1f} | {ratio} | {facts} |")
    return lines


def write_results(folder: Path, name: str, text: str, data: object) -> Path:
    """A bench's results: ``folder/name.md`` (``text``) and ``folder/name.json``
    (``data``); returns the markdown file's path, said on stdout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text(text)
    (folder / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {folder / name}.md")
    return folder / f"{name}.md"


def slug(text: str) -> str:
    """``text`` as a results file's name: lower case, runs of anything else one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print every group's table; write each to its own file, so a run of one
    benchmark module never erases another's results."""
    if not MEDIANS:
        return
    info = machine()
    RESULTS_DIR.mkdir(exist_ok=True)
    for group in sorted({g for g, _ in MEDIANS}):
        lines = table([group])
        for line in lines:
            terminalreporter.write_line(line)
        out = RESULTS_DIR / f"{slug(group)}.md"
        header = [f"# {group}", "", *(f"- {k}: {v}" for k, v in info.items()), ""]
        out.write_text("\n".join(header + lines) + "\n")
        raw = {
            "group": group,
            "machine": info,
            "seconds": {str(bs): v for (g, bs), v in sorted(STATS.items()) if g == group},
            "facts": {str(bs): v for (g, bs), v in sorted(FACTS.items()) if g == group},
        }
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
        terminalreporter.write_line(f"results written to {out} and {out.with_suffix('.json')}")
    _write_inputs()
    from bench import plots  # matplotlib only where pictures are drawn

    for path in plots.draw_all(RESULTS_DIR):
        terminalreporter.write_line(f"picture written to {path}")


def _write_inputs() -> None:
    """The capture reports and traces of this run, beside the tables, for the pictures."""
    from graphrunner.sizing.report_file import write_capture_report

    for label, report in CAPTURES.items():
        write_capture_report(report, RESULTS_DIR / f"capture-{slug(label)}.json", mechanism=label)
    for name, panel in PADDING.items():
        panel.write(RESULTS_DIR / f"padding-{slug(name)}.json")
