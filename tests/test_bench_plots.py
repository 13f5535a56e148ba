"""bench/plots.py draws every picture its results files allow, from the files alone."""

from __future__ import annotations

import json

from bench import plots
from bench.plots import PaddingPanel, draw_all
from graphrunner.sizing.report import CaptureReport, SizeReport
from graphrunner.sizing.report_file import write_capture_report

PNG = b"\x89PNG\r\n\x1a\n"


def _table(path, group, variants):
    seconds = {str(bs): {v: {"median": 1e-4 * bs} for v in variants} for bs in (1, 4, 8)}
    path.write_text(json.dumps({"group": group, "machine": {}, "seconds": seconds, "facts": {}}))


def test_draws_step_times_padding_and_capture_costs(tmp_path):
    _table(tmp_path / "model-step-cpu.json", "model step (cpu)", ["eager", "cpu"])
    _table(tmp_path / "optimiser.json", "size optimiser", ["dp"])  # no eager baseline: no picture
    report = CaptureReport([SizeReport(8, 1.5, 2**20), SizeReport(4, 0.5, 2**18)])
    write_capture_report(report, tmp_path / "capture-cuda.json", mechanism="cuda")
    panel = PaddingPanel(
        "trace", {1: 5, 3: 2, 7: 1}, {"default": [1, 2, 4, 8], "optimum": [1, 3, 8]}
    )
    panel.write(tmp_path / "padding-trace.json")
    (tmp_path / "padding-fuzz-cpu.json").write_text(json.dumps({"runs": []}))  # not a trace
    assert PaddingPanel.read(tmp_path / "padding-trace.json") == panel
    written = draw_all(tmp_path)
    names = ["model-step-cpu.png", "padding-per-size.png", "capture-costs.png"]
    assert written == [tmp_path / n for n in names]
    assert all(p.read_bytes().startswith(PNG) for p in written)


def test_capture_costs_draws_no_empty_panel(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    cpu = CaptureReport([SizeReport(8, 1.5, None), SizeReport(4, 0.5, None)])
    cuda = CaptureReport([SizeReport(8, 1.0, 2**20), SizeReport(4, 0.2, 2**18)])
    plots.capture_costs({"cpu": cpu}, tmp_path / "cpu.png")
    plots.capture_costs({"cpu": cpu, "cuda": cuda}, tmp_path / "both.png")
    [alone], [secs, mem] = (figure.axes for figure in figures)
    assert [p.get_height() for p in alone.patches] == [0.5, 1.5]  # sizes 4, 8
    assert [p.get_height() for p in secs.patches] == [0.5, 1.5, 0.2, 1.0]
    assert [p.get_height() for p in mem.patches] == [0.25, 1.0]  # MiB, cuda only
