"""``graphrunner sizes``: its list and figures, the run -> collect -> optimise ->
recapture loop through the demo's files, and every bad input refused (exit 2)
with nothing written."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest

import graphrunner_ref.cli.checks as cli_checks
import graphrunner_ref.cli.main as cli
import graphrunner_ref.cli.sizes as cli_sizes
from graphrunner.sizing.histogram import BatchSizeHistogram, read_histogram
from graphrunner.sizing.plan import expected_waste, optimal_capture_sizes
from graphrunner.sizing.report import CaptureReport, SizeReport
from graphrunner.sizing.report_file import (
    ReportFileError,
    read_capture_report,
    write_capture_report,
)

EAGER = ["--runner", "eager"]


@pytest.fixture
def decaying(tmp_path: Path) -> Path:
    """exp(-b/24) traffic, 1000 steps at size 1, as one size per line."""
    path = tmp_path / "trace.txt"
    lines = [str(b) for b in range(1, 257) for _ in range(round(1000 * math.exp(-b / 24)))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _report_file(path: Path, nbytes: dict[int, int | None]) -> Path:
    sizes = [SizeReport(bs, 0.1, b) for bs, b in sorted(nbytes.items(), reverse=True)]
    write_capture_report(CaptureReport(sizes), path, mechanism="cuda")
    return path


def test_prints_both_paddings_and_writes_the_list(decaying, tmp_path, capsys):
    out = tmp_path / "list.txt"
    args = ["sizes", "--trace", str(decaying), "--graphs", "36", "--max-bs", "256"]
    assert cli.main([*args, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    counts = read_histogram(decaying).counts()
    plan = optimal_capture_sizes(counts, 36, max_bs=256)
    listed = ",".join(map(str, plan.sizes))
    assert out.read_text() == listed + "\n"
    assert text.splitlines()[-1] == f"--capture-sizes {listed}"
    assert "default: 36 graphs up to 256: padded rows 9.16%" in text
    assert f"optimum: 36 graphs up to 256: padded rows {plan.waste.fraction:.2%}" in text
    assert plan.waste.fraction < 0.04


def test_budget_picks_from_the_report_within_the_budget(decaying, tmp_path, capsys):
    nbytes = {256: 1000, 128: 300, 64: 200, 32: 150, 8: 100}
    report = _report_file(tmp_path / "r.json", nbytes)
    args = ["sizes", "--trace", str(decaying), "--graphs", "4"]
    assert cli.main([*args, "--memory-budget", "1400", "--capture-report", str(report)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    counts = read_histogram(decaying).counts()
    lists = [
        [*combo, 256]
        for r in range(4)
        for combo in itertools.combinations([8, 32, 64, 128], r)
        if sum(nbytes[s] for s in combo) <= 400
    ]
    best = min(lists, key=lambda sizes: expected_waste(sizes, counts).padded_rows)
    assert best == [32, 64, 256]  # 8,32,64,256 pads less but takes 1450 bytes
    assert last == f"--capture-sizes {','.join(map(str, best))}"


def test_the_loop_demo_collects_sizes_then_recaptures_with_the_list(tmp_path, capsys):
    hist, report = tmp_path / "bs.json", tmp_path / "report.json"
    demo = ["demo", *EAGER, "--steps", "24", "--max-bs", "8"]
    assert (
        cli.main([*demo, "--batch-sizes-out", str(hist), "--capture-report-out", str(report)]) == 0
    )
    served = read_histogram(hist)
    assert served.steps == 24
    captured, mechanism = read_capture_report(report)
    assert mechanism == "eager" and [s.bs for s in captured.sizes] == [8, 4, 2, 1]
    out = tmp_path / "list.txt"
    assert cli.main(["sizes", "--trace", str(hist), "--graphs", "3", "--output", str(out)]) == 0
    sizes = out.read_text().strip()
    capsys.readouterr()
    assert cli.main(["demo", *EAGER, "--steps", "24", "--capture-sizes", sizes]) == 0
    assert f"sizes {[int(s) for s in sizes.split(',')]}" in capsys.readouterr().out


def _bad(tmp_path: Path, trace: Path) -> list[tuple[list[str], str]]:
    report = _report_file(tmp_path / "r.json", {16: 1000, 4: 10})
    cpu_report = _report_file(tmp_path / "cpu.json", {16: None, 4: None})
    bad_json = tmp_path / "bad.json"
    bad_json.write_text(
        '{"format": "graphrunner.capture_report", "version": 1, "sizes": [{"bs": 0}]}'
    )
    t = ["--trace", str(trace)]
    budget = ["--memory-budget", "2000", "--capture-report"]
    return [
        ([*t, "--graphs", "0"], "--graphs 0: expected 1..4096"),
        ([*t, "--graphs", "5000"], "--graphs 5000: expected 1..4096"),
        ([*t, "--graphs", "2", "--max-bs", "0"], "--max-bs 0: expected 1..1000000"),
        (["--trace", str(tmp_path / "nope"), "--graphs", "2"], "no such file"),
        (["--trace", str(tmp_path), "--graphs", "2"], "is a directory"),
        ([*t, "--graphs", "2", "--memory-budget", "9"], "go together; got only --memory-budget"),
        ([*t, "--graphs", "2", "--capture-report", str(report)], "got only --capture-report"),
        ([*t, "--graphs", "2", "--memory-budget", "0", "--capture-report", str(report)],
         "--memory-budget 0: expected 1.."),
        ([*t, "--graphs", "2", "--memory-budget", "999", "--capture-report", str(report)],
         "expected at least 1000 bytes"),
        ([*t, "--graphs", "2", "--max-bs", "8", *budget, str(report)], "--max-bs 8: expected a size"),
        ([*t, "--graphs", "2", *budget, str(cpu_report)], "no memory bytes for sizes [16, 4]"),
        ([*t, "--graphs", "2", *budget, str(bad_json)], r"sizes[0].bs = 0"),
        ([*t, "--graphs", "2", *budget, str(tmp_path / "none.json")], "no such file"),
        ([*t, "--graphs", "2", "--output", str(tmp_path / "no" / "x")], "does not exist"),
        ([*t, "--graphs", "2", "--output", str(tmp_path)], "is a directory"),
    ]  # fmt: skip


def test_every_bad_input_exits_2_naming_it_and_writes_nothing(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("3\n5\n12\n")
    out = tmp_path / "out.txt"
    for args, message in _bad(tmp_path, trace):
        before = sorted(tmp_path.iterdir())
        code = cli.main(["sizes", *args] + ([] if "--output" in args else ["--output", str(out)]))
        err = capsys.readouterr().err
        assert code == 2, args
        assert err.startswith("graphrunner sizes: error: ") and message in err, (args, err)
        assert sorted(tmp_path.iterdir()) == before, args  # nothing written, no temporary


DEEP, DIGITS = "[" * 100_000 + "]" * 100_000, "1" + "0" * 5000
HISTOGRAM = '{"format": "graphrunner.batch_sizes", "version": 1, "counts": '

#: --trace files that are no histogram: (text, what the one error line says).
BAD_TRACE_FILES = [
    ("3\n-1\n", "trace.txt:2: '-1'"),
    ("", "no batch sizes"),
    ('{"format": "x"}', "format 'x'"),
    (DEEP + "\n", "trace.txt:1: '[[[["),
    (f"3\n{DIGITS}\n", "trace.txt:2: '1000"),
    (HISTOGRAM + DEEP + "}", "not a histogram (nested too deeply)"),
    (HISTOGRAM + f'{{"4": {DIGITS}}}}}', "not a histogram (Exceeds the limit (4300 digits)"),
    (HISTOGRAM + f'{{"{DIGITS}": 3}}}}', "counts: batch size '1000"),
]


@pytest.mark.parametrize(("text", "message"), BAD_TRACE_FILES)
def test_bad_trace_files(tmp_path, capsys, text, message):
    trace = tmp_path / "trace.txt"
    trace.write_text(text)
    assert cli.main(["sizes", "--trace", str(trace), "--graphs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrunner sizes: error: --trace ") and message in err, err
    assert err.count("\n") == 1


REPORT = '{"format": "graphrunner.capture_report", "version": 1, "sizes": '

#: --capture-report files past JSON's own limits: (text, what the error says).
BAD_REPORT_TEXTS = [
    (REPORT + DEEP + "}", "not a capture report (nested too deeply)"),
    (REPORT + f'[{{"bs": {DIGITS}, "seconds": 1}}]}}', "(Exceeds the limit (4300 digits)"),
]


@pytest.mark.parametrize(("text", "message"), BAD_REPORT_TEXTS)
def test_capture_reports_past_the_json_limits(tmp_path, text, message):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ReportFileError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        read_capture_report(path)


def test_demo_refuses_bad_outputs_before_any_work(tmp_path, capsys):
    missing = str(tmp_path / "no" / "f")
    for flag in ("--batch-sizes-out", "--capture-report-out", "--trace-out"):
        assert cli.main(["demo", *EAGER, "--steps", "2", flag, missing]) == 2
        assert f"{flag} {missing}: directory" in capsys.readouterr().err
    assert cli.main(["demo", *EAGER, "--overlap", "--batch-sizes-out", str(tmp_path / "h")]) == 2
    assert "not with --overlap" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_search_too_large_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli_sizes, "MAX_SEARCH_WORK", 10)
    trace = tmp_path / "t.txt"
    BatchSizeHistogram.from_sizes(range(1, 9)).write(trace)
    assert cli.main(["sizes", "--trace", str(trace), "--graphs", "4"]) == 2
    assert "would take too long" in capsys.readouterr().err


def test_bound_matches_the_cli():
    assert cli_sizes.MAX_BATCH_SIZE == cli_checks.MAX_BATCH_SIZE


def test_capture_report_round_trip(tmp_path):
    report = CaptureReport([SizeReport(8, 0.5, 4096, 1), SizeReport(4, 0.25, None, None)])
    write_capture_report(report, tmp_path / "r.json", mechanism="cuda+compile")
    assert read_capture_report(tmp_path / "r.json") == (report, "cuda+compile")
    assert json.loads((tmp_path / "r.json").read_text())["format"] == "graphrunner.capture_report"


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([{"bs": 4, "seconds": -1}], r"sizes\[0\].seconds = -1"),
        ([{"bs": 4, "seconds": float("nan")}], r"sizes\[0\].seconds = nan"),
        ([{"bs": 4, "seconds": True}], r"sizes\[0\].seconds = True"),
        ([{"seconds": 1}], r"sizes\[0\].bs = None"),
        ([{"bs": 4.0, "seconds": 1}], r"sizes\[0\].bs = 4.0"),
        ([{"bs": 4, "seconds": 1, "memory_bytes": -5}], r"memory_bytes = -5"),
        ([{"bs": 4, "seconds": 1, "programs": "2"}], r"programs = '2'"),
        ([{"bs": 4, "seconds": 1}, {"bs": 4, "seconds": 1}], r"repeat a batch size"),
        (["x"], r"sizes\[0\] = 'x'; expected an object"),
        ([], r"expected a non-empty list"),
    ],
)
def test_bad_capture_report_entries(tmp_path, entries, match):
    path = tmp_path / "r.json"
    doc = {"format": "graphrunner.capture_report", "version": 1, "sizes": entries}
    path.write_text(json.dumps(doc))
    with pytest.raises(ReportFileError, match=match):
        read_capture_report(path)


def test_fewer_graphs_than_the_default_also_prints_the_like_for_like_optimum(decaying, capsys):
    assert cli.main(["sizes", "--trace", str(decaying), "--graphs", "8", "--max-bs", "256"]) == 0
    out = capsys.readouterr().out
    same = optimal_capture_sizes(read_histogram(decaying).counts(), 36, max_bs=256)
    expected = (
        f"as many graphs as the default: 36 graphs up to 256: padded rows {same.waste.fraction:.2%}"
    )
    assert expected in out
    assert "optimum: 8 graphs up to 256" in out


@pytest.mark.parametrize("model", ["llama", "mamba"])
def test_generate_writes_its_served_sizes_and_trace_beside_the_answers(model, tmp_path, capsys):
    """All prompts arrive at once and none ends early, so every one of the
    ``new - 1`` decode steps (the first token comes from prefill) serves all
    of them: the histogram is exactly ``{prompts: new - 1}``. The reports go
    to stderr; stdout holds the answers alone."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    (tmp_path / "p.txt").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    argv = ["generate", "--prompts", str(tmp_path / "p.txt"), *EAGER, "--max-new-tokens", "5"]
    if model == "mamba":
        from hf_ssm import save_tiny_mamba

        save_tiny_mamba(tmp_path / "ck")
        argv += ["--checkpoint", str(tmp_path / "ck")]
    sizes, trace = tmp_path / "bs.json", tmp_path / "trace.json"
    assert cli.main([*argv, "--batch-sizes-out", str(sizes), "--trace-out", str(trace)]) == 0
    out, err = capsys.readouterr()
    answers = [json.loads(line) for line in out.splitlines()]
    assert [a["index"] for a in answers] == [0, 1, 2]
    assert all(len(a["token_ids"]) == 5 for a in answers)
    assert read_histogram(sizes).counts() == {3: 4}
    assert f"batch sizes written to {sizes}" in err
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert any(n.startswith("graphrunner::replay") for n in names)


def test_generate_refuses_a_bad_output_before_any_work(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("[1, 2]\n")
    missing = tmp_path / "nowhere" / "bs.json"
    argv = ["generate", "--prompts", str(tmp_path / "p.txt"), *EAGER]
    assert cli.main([*argv, "--batch-sizes-out", str(missing)]) == 2
    assert "--batch-sizes-out" in capsys.readouterr().err
    assert not missing.parent.exists()
