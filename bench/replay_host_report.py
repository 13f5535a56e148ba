"""The GPU replay host-time table (:mod:`bench.bench_replay_host`) as markdown
and JSON: rows in, files out, no device needed (so it is tested on a CPU).

A row: ``raw_bs``, ``bs``, ``variant``, ``idle`` and ``busy`` (each a
:meth:`bench.host_timing.HostTimes.summary`), ``occupy_us`` (the busy mode's
occupying work per block), ``device_calls_per_step`` and ``besides_graph``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

COMMAND = ".venv/bin/python -m bench.bench_replay_host"
STEPS_COMMAND = "bash bench/gpu_steps.sh replay [LOGDIR]"
#: The issue's goal: runner.replay() host time with the GPU idle, at these graphs.
GOAL_US = 15.0
GOAL_SIZES = (1, 8, 64)
#: The rows that are a whole runner.replay() (device fields).
REPLAYS = ("torch", "fused", "graph")
MODES = ("idle", "busy")


def _driver() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown"
    query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def gpu_info() -> dict[str, str]:
    """The machine (:func:`bench.conftest.machine`), the CUDA device's
    capability, torch's CUDA version, the driver, and how this run was invoked."""
    import torch

    from bench.conftest import machine

    info = machine()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["capability"] = f"{props.major}.{props.minor}"
    info["cuda (torch built with)"] = str(torch.version.cuda or "unknown")
    info["driver"] = _driver()
    info["invoked as"] = " ".join([sys.executable, "-m", "bench.bench_replay_host", *sys.argv[1:]])
    return info


def _x(value: float, reference: float, digits: int = 1) -> str:
    return f"{value / reference:.{digits}f}" if reference > 0 else "-"


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Whether the best idle runner.replay() median meets the goal, per size."""
    lines = []
    for bs in GOAL_SIZES:
        replays = [r for r in rows if r["bs"] == bs and r["variant"] in REPLAYS]
        if not replays:
            continue
        best = min(replays, key=lambda r: r["idle"]["median_us"])
        median = best["idle"]["median_us"]
        verdict = "met" if median <= GOAL_US else "NOT met"
        lines.append(
            f"- graph of {bs} ({best['raw_bs']} live): best `runner.replay()` "
            f"({best['variant']}) {median:.1f} µs idle: {verdict}"
        )
    return lines


def method_text(params: dict[str, int]) -> str:
    """The method, in one paragraph, with this run's counts."""
    p = params
    return (
        "Method (`bench/host_timing.py`): every call is timed on its own with "
        "`time.perf_counter_ns`, after untimed warm-up calls. **Idle**: "
        f"{p['idle_blocks']} blocks of {p['idle_calls_per_block']} calls "
        f"({p['warmup']} warm-up calls), the GPU drained before each block and "
        "after each call (`torch.cuda.synchronize()`, untimed), so each call starts "
        f"with the GPU idle. **Busy**: {p['busy_blocks']} blocks of {p['busy_calls']} "
        "calls back to back, each block queued behind a `torch.cuda._sleep` long "
        "enough that an event recorded after it is still pending after the last call "
        "(checked: a block that finds it complete is refused and the variant re-timed "
        "with a longer sleep), so the host runs ahead of a busy GPU; at most "
        f"{p['busy_calls']} calls are queued at once (the staging ring's depth). "
        "Medians and p10-p90 over all timed calls; `x bare`: against `graph.replay()` "
        "alone in the same mode, same size, same run. Device calls per step: CUDA "
        f"launch, copy and set calls in a torch profiler trace of {p['traced']} steps. "
        "NVTX on, no profiler attached while timing."
    )


def format_results(rows: list[dict[str, Any]], info: dict[str, str], params: dict[str, int]) -> str:
    """The markdown table: idle and busy host µs with their spread and ratio to
    the bare launch of the same mode, and the device calls per step."""
    bare = {(r["bs"], m): r[m]["median_us"] for r in rows if r["variant"] == "bare" for m in MODES}
    per_field = {(r["bs"], r["variant"]): r["idle"]["median_us"] for r in rows}
    lines = [
        f"# Replay host time: {info['device']}",
        "",
        f"Produced by `{COMMAND}` (or `{STEPS_COMMAND}`, which runs the same module "
        "under a time limit).",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        method_text(params),
        "",
        f"Goal (the issue): replay host time at most {GOAL_US:g} µs at graphs of "
        f"{', '.join(map(str, GOAL_SIZES))} with the GPU idle (populate, metadata, "
        "launch and output slice included):",
        "",
        *goal_lines(rows),
        "",
        "| raw -> graph | variant | idle median µs | idle p10-p90 | idle x bare "
        "| busy median µs | busy p10-p90 | busy x bare | per-field / this (idle) "
        "| device calls | besides graph |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bs, idle, busy = r["bs"], r["idle"], r["busy"]
        host = r["variant"].endswith("(host fields)")
        reference = per_field.get((bs, "per-field (host fields)" if host else "per-field"), 0.0)
        spreads = [f"{t['p10_us']:.1f}-{t['p90_us']:.1f}" for t in (idle, busy)]
        lines.append(
            f"| {r['raw_bs']} -> {bs} | {r['variant']} | {idle['median_us']:.1f} | "
            f"{spreads[0]} | {_x(idle['median_us'], bare[(bs, 'idle')])} | "
            f"{busy['median_us']:.1f} | {spreads[1]} | "
            f"{_x(busy['median_us'], bare[(bs, 'busy')])} | "
            f"{_x(reference, idle['median_us'], 2)} | {r['device_calls_per_step']:g} | "
            f"{r['besides_graph']:g} |"
        )
    return "\n".join(lines) + "\n"


def write_results(
    rows: list[dict[str, Any]], info: dict[str, str], params: dict[str, int], results_dir: Path
) -> Path:
    """Write ``replay-host-<device>.md`` and ``.json`` into ``results_dir``;
    returns the markdown file's path."""
    slug = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-")
    results_dir.mkdir(parents=True, exist_ok=True)
    md = results_dir / f"replay-host-{slug}.md"
    md.write_text(format_results(rows, info, params))
    payload = {"machine": info, "command": COMMAND, "params": params, "rows": rows}
    md.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    return md
