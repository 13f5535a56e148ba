"""Capture in the time of one compile: the CPU runner's capture, cold and warm,
with one program for every size (``dynamic_batch=True``, the default) against
one program per size (``dynamic_batch=False``, the old way), and the step time
of each size under both, in one run.

Every capture runs in a fresh interpreter with an inductor cache folder of its
own (``TORCHINDUCTOR_CACHE_DIR``): *cold* is an empty folder, *warm* the
folder a cold capture of the same model and sizes filled. Measured per model
(``--models``: the embedded default model, and SmolLM2-135M-Instruct, 30
layers, the checkpoint ``make demo-real`` fetches):

- cold, one size (16) / cold, six sizes (1, 2, 4, 8, 12, 16) / warm, six sizes,
  one program for every size; cold, six sizes, one program per size;
- the step time of each size (median replay of a batch of that many
  requests, 64 cached tokens each) for both, and whether their tokens (the
  argmax of each row's logits) are equal.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_capture`` (writes
``bench/results/capture-one-compile-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.conftest import RESULTS_DIR, machine

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_capture"
SIX = [1, 2, 4, 8, 12, 16]
ONE = [16]
CONTEXT = 64  # cached tokens per request in the step-time batches
REPEATS = 30


def _bundle(model: str) -> Any:
    if model == "embedded":
        from graphrunner_ref.model import default_model

        return default_model(max_requests=max(SIX), max_context_len=256)
    from bench.bench_context import smollm2_chats
    from graphrunner_ref.io import load_model

    checkpoint, _ = smollm2_chats()
    return load_model(checkpoint, max_requests=max(SIX), max_context_len=256)


def _runner(bundle: Any, sizes: list[int], dynamic: bool) -> Any:
    from graphrunner_ref import create_decode_runner

    return create_decode_runner(bundle, "cpu", capture_sizes=sizes, dynamic_batch=dynamic)


def child_capture(model: str, sizes: list[int], dynamic: bool) -> dict[str, Any]:
    """One capture in this (fresh) interpreter: seconds, split and start."""
    bundle = _bundle(model)
    runner = _runner(bundle, sizes, dynamic)
    start = time.perf_counter()
    report = runner.capture()
    return {
        "seconds": time.perf_counter() - start,
        "compile_seconds": report.compile_seconds,
        "compilations": report.compilations,
        "cache_hits": report.cache_hits,
        "start": report.start,
    }


def child_steps(model: str) -> dict[str, Any]:
    """Step time per size, one program per size against one for every size,
    and whether their tokens agree (same batch, same state)."""
    from bench.bench_gpu_model import filled_batch

    bundle = _bundle(model)
    runners = {"per size": _runner(bundle, SIX, False), "one program": _runner(bundle, SIX, True)}
    for runner in runners.values():
        runner.capture()
    rows = []
    for bs in SIX:
        batch = filled_batch(bundle, bs, CONTEXT)
        medians, tokens = {}, {}
        for name, runner in runners.items():
            tokens[name] = runner.replay(batch).argmax(-1)
            times = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                runner.replay(batch)
                times.append(time.perf_counter() - start)
            medians[name] = statistics.median(times)
        rows.append(
            {
                "bs": bs,
                "per_size_ms": medians["per size"] * 1e3,
                "one_program_ms": medians["one program"] * 1e3,
                "tokens_equal": bool(torch.equal(tokens["per size"], tokens["one program"])),
            }
        )
    return {"rows": rows}


def fresh_child(module: str, argv: list[str], cache: Path) -> dict[str, Any]:
    """``python -m module --child *argv`` in a fresh interpreter whose inductor
    cache folder is ``cache``: the JSON its last line prints."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": "."}
    out = subprocess.run(
        [sys.executable, "-m", module, "--child", *argv],
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"child {argv} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(argv: list[str], cache: Path) -> dict[str, Any]:
    return fresh_child("bench.bench_capture", argv, cache)


def write_models(
    name: str,
    models: str,
    measure: Callable[[str, Path], dict[str, Any]],
    header: Callable[[dict[str, Any]], list[str]],
    table: Callable[[str, dict[str, Any]], list[str]],
    facts: dict[str, Any],
) -> int:
    """Measure each of ``models`` (comma-separated) in a temporary folder and
    write ``bench/results/<name>.json`` and ``.md``: ``header`` of the
    results, then each model's ``table``. Models measured in other runs (the
    same machine) stay in the file."""
    path = RESULTS_DIR / f"{name}.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results.update({"machine": machine(), "threads": 1, **facts})
    measured = results.setdefault("models", {})
    with tempfile.TemporaryDirectory(prefix=f"graphrunner-{name}-") as tmp:
        for model in models.split(","):
            print(f"measuring {model} ...", file=sys.stderr)
            measured[model] = measure(model, Path(tmp))
    lines = header(results)
    for model, result in measured.items():
        lines += table(model, result)
    RESULTS_DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    path.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def machine_words(results: dict[str, Any]) -> str:
    """The results' machine as words: ``device AMD EPYC, cpus 2, ...``."""
    return ", ".join(f"{k} {v}" for k, v in results["machine"].items())


def measure(model: str, root: Path) -> dict[str, Any]:
    six, one, old = root / f"{model}-six", root / f"{model}-one", root / f"{model}-old"
    sizes_six, sizes_one = ",".join(map(str, SIX)), ",".join(map(str, ONE))
    result = {
        "cold one size": _child(["capture", model, sizes_one, "1"], one),
        "cold six sizes": _child(["capture", model, sizes_six, "1"], six),
        "warm six sizes": _child(["capture", model, sizes_six, "1"], six),
        "cold six sizes, per size": _child(["capture", model, sizes_six, "0"], old),
    }
    result["steps"] = _child(["steps", model], root / f"{model}-steps")["rows"]
    return result


def _table(model: str, r: dict[str, Any]) -> list[str]:
    one = r["cold one size"]["seconds"]
    lines = [
        f"### {model}",
        "",
        "| capture | seconds | compile s | compilations | from cache | vs cold one size |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("cold one size", "cold six sizes", "warm six sizes", "cold six sizes, per size"):
        c = r[name]
        lines.append(
            f"| {name} | {c['seconds']:.2f} | {c['compile_seconds']:.2f} | "
            f"{c['compilations']} | {c['cache_hits']} | {c['seconds'] / one:.2f}x |"
        )
    lines += [
        "",
        "| bs | per size (ms) | one program (ms) | one / per size | tokens equal |",
        "|---|---|---|---|---|",
    ]
    for s in r["steps"]:
        ratio = s["one_program_ms"] / s["per_size_ms"]
        lines.append(
            f"| {s['bs']} | {s['per_size_ms']:.3f} | {s['one_program_ms']:.3f} | "
            f"{ratio:.2f}x | {s['tokens_equal']} |"
        )
    return [*lines, ""]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="embedded,smollm2")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.child:
        what, model, *rest = args.child
        if what == "capture":
            sizes = [int(x) for x in rest[0].split(",")]
            print(json.dumps(child_capture(model, sizes, rest[1] == "1")))
        else:
            print(json.dumps(child_steps(model)))
        return 0
    return write_models(
        "capture-one-compile-cpu", args.models, measure, _header, _table, {"command": CMD}
    )


def _header(results: dict[str, Any]) -> list[str]:
    return [
        "# Capture in the time of one compile (CPU runner)",
        "",
        f"Machine: {machine_words(results)}; one torch thread. Command: `{CMD}`.",
        "Each capture in a fresh interpreter; cold: an empty inductor cache folder,",
        "warm: the folder the cold six-size capture filled.",
        "",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
