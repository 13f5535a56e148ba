"""``graphrunner sizes``: the capture list chosen from served traffic, and the
demo's outputs that feed it (the batch sizes served, the capture report, a
torch profiler trace).

The loop: ``graphrunner demo --batch-sizes-out sizes.json`` (run, collect),
``graphrunner sizes --trace sizes.json --graphs 8 --output list.txt``
(optimise), ``graphrunner demo --capture-sizes $(cat list.txt)`` (recapture).
``--plot FILE.png`` draws the trace, the chosen sizes and the padding per size
(:mod:`graphrunner_ref.cli.sizes_plot`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch

from graphrunner import GraphRunner
from graphrunner.sizing import (
    HistogramFileError,
    PaddingWaste,
    ReportFileError,
    SizePlan,
    budget_capture_sizes,
    default_capture_sizes,
    expected_waste,
    optimal_capture_sizes,
    read_capture_report,
    read_histogram,
    write_capture_report,
)
from graphrunner.util import remove_stale_temps, temp_path, write_atomically
from graphrunner_ref.cli import sizes_plot
from graphrunner_ref.cli.common import UsageError, check_range

__all__ = ["MAX_GRAPHS", "check_run_outputs", "profiled", "run", "write_outputs"]

#: The CLI's bound on batch sizes (``cli.MAX_BATCH_SIZE``; a test keeps them equal).
MAX_BATCH_SIZE = 1_000_000
#: --graphs: more graphs than this is no capture list anyone runs.
MAX_GRAPHS = 4096
#: Element operations the exact search may take (graphs x distinct sizes^2 / 2)
#: before it is refused as too long a wait.
MAX_SEARCH_WORK = 20_000_000_000


def run(args: argparse.Namespace) -> int:
    """Read, optimise, print; write ``--output`` last, after every check passed."""
    check_range("--graphs", args.graphs, 1, MAX_GRAPHS)
    if args.max_bs is not None:
        check_range("--max-bs", args.max_bs, 1, MAX_BATCH_SIZE)
    if (args.memory_budget is None) != (args.capture_report is None):
        raise UsageError(
            "--memory-budget and --capture-report go together; got only "
            + ("--memory-budget" if args.capture_report is None else "--capture-report")
        )
    if args.output is not None:
        _check_output("--output", args.output)
    if args.plot is not None:
        _check_output("--plot", args.plot)
        sizes_plot.check_plot(args.plot)
    try:
        counts = read_histogram(args.trace).counts()
    except HistogramFileError as e:
        raise UsageError(f"--trace {e}") from None
    if args.memory_budget is None:
        top = max(counts) if args.max_bs is None else args.max_bs
        check_range("--max-bs", top, 1, MAX_BATCH_SIZE, "the trace's largest batch")
        _check_work(args.graphs, len({bs for bs in counts if bs < top}) + 1)
        plan = optimal_capture_sizes(counts, args.graphs, max_bs=top)
        nbytes: dict[int, int] | None = None
    else:
        nbytes = _report_bytes(args)
        plan = _budget_plan(args, counts, nbytes)
    _print(args, counts, plan, nbytes)
    text = ",".join(map(str, plan.sizes))
    if args.output is not None:
        write_atomically(args.output, text + "\n")
        print(f"written to {args.output}")
    if args.plot is not None:
        sizes_plot.plot_plan(args.plot, f"trace {args.trace}", counts, plan.sizes)
        print(f"picture written to {args.plot}")
    print(f"--{'token-' if args.tokens else ''}capture-sizes {text}")
    return 0


def _check_work(graphs: int, candidates: int) -> None:
    if min(graphs, candidates) * candidates**2 // 2 > MAX_SEARCH_WORK:
        raise UsageError(
            f"--graphs {graphs} over {candidates} distinct batch sizes: the exact search "
            f"would take too long; expected fewer graphs or a smaller --max-bs"
        )


def _report_bytes(args: argparse.Namespace) -> dict[int, int]:
    check_range("--memory-budget", args.memory_budget, 1, 2**62)
    try:
        report, mechanism = read_capture_report(args.capture_report)
    except ReportFileError as e:
        raise UsageError(f"--capture-report {e}") from None
    missing = [s.bs for s in report.sizes if s.memory_bytes is None]
    if missing:
        raise UsageError(
            f"--capture-report {args.capture_report}: no memory bytes for sizes {missing} "
            f"(mechanism {mechanism or 'unknown'} pools nothing); expected a report "
            "captured with CUDA graphs"
        )
    return {s.bs: s.memory_bytes for s in report.sizes if s.memory_bytes is not None}


def _budget_plan(
    args: argparse.Namespace, counts: dict[int, int], nbytes: dict[int, int]
) -> SizePlan:
    top = max(nbytes) if args.max_bs is None else args.max_bs
    if top not in nbytes:
        raise UsageError(
            f"--max-bs {top}: expected a size of --capture-report {args.capture_report} "
            f"({sorted(nbytes)})"
        )
    if nbytes[top] > args.memory_budget:
        raise UsageError(
            f"--memory-budget {args.memory_budget}: expected at least {nbytes[top]} bytes, "
            f"what the largest size {top} alone takes per --capture-report"
        )
    return budget_capture_sizes(counts, args.graphs, nbytes, args.memory_budget, max_bs=top)


def _print(
    args: argparse.Namespace,
    counts: dict[int, int],
    plan: SizePlan,
    nbytes: dict[int, int] | None,
) -> None:
    top = plan.sizes[-1]
    steps = sum(counts.values())
    above = sum(n for bs, n in counts.items() if bs > top)
    print(
        f"trace {args.trace}: {steps} steps, {len(counts)} distinct batch sizes "
        f"in {min(counts)}..{max(counts)}"
        + (f"; {above} steps above {top} run eagerly" if above else "")
    )
    default = default_capture_sizes(top)
    print(f"default: {_line(default, expected_waste(default, counts), nbytes)}")
    print(f"optimum: {_line(list(plan.sizes), plan.waste, nbytes)}")
    if len(plan.sizes) < args.graphs:
        print(f"  ({len(plan.sizes)} graphs suffice: more would pad no less)")
    if nbytes is None and len(default) != args.graphs:  # like for like, as many graphs
        same = optimal_capture_sizes(counts, len(default), max_bs=top)
        print(
            f"optimum, as many graphs as the default: {_line(list(same.sizes), same.waste, None)}"
        )
    if nbytes is not None:
        print(f"  memory budget {_mib(args.memory_budget)}")


def _line(sizes: list[int], waste: PaddingWaste, nbytes: dict[int, int] | None) -> str:
    computed = waste.live_rows + waste.padded_rows
    text = (
        f"{len(sizes)} graphs up to {sizes[-1]}: padded rows {waste.fraction:.2%} "
        f"({waste.padded_rows} of {computed} computed)"
    )
    if nbytes is not None:
        known = all(s in nbytes for s in sizes)
        text += f", {_mib(sum(nbytes[s] for s in sizes))}" if known else ", bytes not in report"
    return text


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _check_output(flag: str, path: Path) -> None:
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; expected a file path")


def check_run_outputs(args: argparse.Namespace) -> None:
    """Refuse bad output paths (and outputs a mode does not make) before any work."""
    for flag in ("--batch-sizes-out", "--token-sizes-out", "--capture-report-out", "--trace-out"):
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if path is None:
            continue
        _check_output(flag, path)
        if flag != "--trace-out" and (args.speculative or args.overlap):
            mode = "--speculative" if args.speculative else "--overlap"
            raise UsageError(f"{flag} records the plain engine's runner; not with {mode}")
        if flag == "--token-sizes-out" and not getattr(args, "chunked_prefill", True):
            raise UsageError(
                f"{flag} records the token-batch runner; not with --no-chunked-prefill"
            )


@contextlib.contextmanager
def profiled(args: argparse.Namespace, file: TextIO | None = None) -> Iterator[None]:
    """Profile the block when ``--trace-out`` is given; the trace file is
    written (atomically) only when the block returns, not when it raises.
    ``file``: where to say so (default stdout)."""
    if args.trace_out is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if str(args.device).startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    path: Path = args.trace_out
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"profiler trace written to {path} (open in Perfetto or chrome://tracing)", file=file)


def write_outputs(
    args: argparse.Namespace,
    runner: GraphRunner,
    file: TextIO | None = None,
    tokens: GraphRunner | None = None,
) -> None:
    """Write ``--batch-sizes-out`` and ``--capture-report-out`` for ``runner``
    and ``--token-sizes-out`` for the token-batch runner ``tokens``;
    ``file``: where to say so (default stdout)."""
    if args.batch_sizes_out is not None:
        runner.batch_sizes.write(args.batch_sizes_out)
        print(f"batch sizes written to {args.batch_sizes_out}", file=file)
    token_out = getattr(args, "token_sizes_out", None)
    if token_out is not None:
        if tokens is None:
            raise UsageError(
                f"--token-sizes-out {token_out}: no prompt chunk ran as a token batch "
                f"(chunked prefill off, or a model that runs none)"
            )
        tokens.batch_sizes.write(token_out)
        print(f"token counts written to {token_out}", file=file)
    if args.capture_report_out is not None and runner.capture_report is not None:
        write_capture_report(
            runner.capture_report, args.capture_report_out, mechanism=runner.mechanism.label
        )
        print(f"capture report written to {args.capture_report_out}", file=file)
