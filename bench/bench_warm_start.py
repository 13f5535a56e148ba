"""Warm start: the CPU runner's capture of six sizes (1, 2, 4, 8, 12, 16) cold,
warm from inductor's cache (today's warm start: dynamo traces the forward,
AOTAutograd and inductor answer from their caches), and from the program saved
ahead of time (``aot_cache``: loaded, nothing traced), in one run, per model:
the embedded default model and SmolLM2-135M-Instruct (the checkpoint
``make demo-real`` fetches).

Every capture runs in a fresh interpreter with an inductor cache folder of its
own (``TORCHINDUCTOR_CACHE_DIR``): *cold* an empty one, *warm cache* the one
the cold capture filled, *AOT build* an empty one and an empty ``aot_cache``
(it traces, exports and AOTInductor-compiles, then saves), *AOT load* an empty
inductor folder and the ``aot_cache`` the build filled. Each child also
decodes one batch of 8 requests (64 cached tokens, fixed seed) and reports
its argmax tokens: the AOT load's must equal the cold capture's.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_warm_start [--out NAME]`` (writes
``bench/results/NAME.md`` and ``.json``, ``warm-start-cpu`` by default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.bench_capture import fresh_child, machine_words, write_models
from bench.conftest import command

SIX = [1, 2, 4, 8, 12, 16]
GOALS = {"embedded": 2.0, "smollm2": 4.0}  # seconds, warm capture of six sizes (issue 53)
RUNS = ("cold", "warm cache", "AOT build", "AOT load")


def child(model: str, aot: str | None) -> dict[str, Any]:
    """One capture in this (fresh) interpreter: its seconds, how it started,
    and the tokens of one decode step."""
    from bench.bench_capture import _bundle
    from bench.bench_gpu_model import filled_batch
    from graphrunner_ref import create_decode_runner

    bundle = _bundle(model)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=SIX, aot_cache=aot)
    start = time.perf_counter()
    report = runner.capture()
    seconds = time.perf_counter() - start
    torch.manual_seed(0)
    batch = filled_batch(bundle, 8, 64)
    logits: Any = runner.replay(batch)
    tokens = logits.argmax(-1).tolist()
    return {
        "seconds": seconds,
        "start": report.start,
        "aot": getattr(runner.mechanism, "aot_status", None),
        "dynamo imported": "torch._dynamo" in sys.modules,
        "tokens": tokens,
    }


def _child(model: str, cache: Path, aot: Path | None) -> dict[str, Any]:
    return fresh_child("bench.bench_warm_start", [model, *([str(aot)] if aot else [])], cache)


def measure(model: str, root: Path) -> dict[str, Any]:
    inductor, aot = root / f"{model}-inductor", root / f"{model}-aot"
    result = {
        "cold": _child(model, inductor, None),
        "warm cache": _child(model, inductor, None),
        "AOT build": _child(model, root / f"{model}-inductor-build", aot),
        "AOT load": _child(model, root / f"{model}-inductor-empty", aot),
    }
    print(f"{model}: " + ", ".join(f"{k} {v['seconds']:.2f}s" for k, v in result.items()))
    return result


def _table(model: str, r: dict[str, Any]) -> list[str]:
    cold, warm, load = (r[k]["seconds"] for k in ("cold", "warm cache", "AOT load"))
    goal = GOALS[model]
    lines = [
        f"### {model}",
        "",
        "| capture of six sizes | seconds | vs cold | vs warm cache | start | aot_cache | "
        "dynamo imported |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        c = r[name]
        lines.append(
            f"| {name} | {c['seconds']:.2f} | {c['seconds'] / cold:.3f}x | "
            f"{c['seconds'] / warm:.3f}x | {c['start']} | {c['aot'] or '-'} | "
            f"{c['dynamo imported']} |"
        )
    same = r["AOT load"]["tokens"] == r["cold"]["tokens"]
    met = "met" if load <= goal else "not met"
    lines += [
        "",
        f"Goal: warm capture of six sizes <= {goal:.0f} s: **{met}** ({load:.2f} s loaded "
        f"from the AOT cache; {warm:.2f} s warm from inductor's cache, "
        f"{warm / load:.1f}x slower). Tokens of one batch of 8, AOT load vs cold: "
        f"{'equal' if same else 'DIFFERENT'}.",
        "",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="embedded,smollm2")
    p.add_argument("--out", default="warm-start-cpu", help="results name under bench/results/")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.child:
        model, *aot = args.child
        print(json.dumps(child(model, aot[0] if aot else None)))
        return 0
    from graphrunner_ref.model.cpu_features import cpu_features

    facts = {
        "command": command("bench_warm_start", argv),
        "cpu": cpu_features().describe(),
        "kernel path": f"inductor C++ codegen at {torch.backends.cpu.get_cpu_capability()}",
    }
    return write_models(args.out, args.models, measure, _header, _table, facts)


def _header(results: dict[str, Any]) -> list[str]:
    return [
        "# Warm start: the CPU runner's capture from the AOT cache",
        "",
        f"Machine: {machine_words(results)}; CPU: {results['cpu']}; kernel path: "
        f"{results['kernel path']} (float32 models, no compact-weight kernel); one torch "
        f"thread. Command: `{results['command']}`.",
        "Each capture in a fresh interpreter (seconds: `runner.capture()`, imports and "
        "model load outside). Cold: an empty inductor cache folder; warm cache: the folder "
        "the cold capture filled; AOT build: empty folders, `aot_cache=DIR` (traces, "
        "exports, AOTInductor-compiles, saves); AOT load: an empty inductor folder and the "
        "DIR the build filled.",
        "",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
