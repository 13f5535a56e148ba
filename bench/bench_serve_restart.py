"""How long ``graphrunner serve`` takes to listen: its first start, a restart
(the step's saved program loaded), and a restart with ``--aot-cache none``
(compiled in process, inductor's cache warm: what a sampled step's restart
cost while its program could not be saved), in one run.

Each start is a fresh ``graphrunner serve MODEL SERVE_ARGS --port 0
--aot-cache DIR`` on 127.0.0.1, timed from the launch to its ``listening``
line, then asked one greedy completion (``--prompt-len`` token ids,
``--max-tokens`` new tokens, the end token ignored) and stopped. The three
answers must be the same tokens, or the run exits 1. The first start uses an
empty ``DIR``; the restart the ``DIR`` it filled.

    PYTHONPATH=. .venv/bin/python -m bench.bench_serve_restart \\
        [--model DIR] [--name NAME] [-- SERVE_ARGS ...]

writes ``bench/results/serve-restart-NAME.md`` (and ``.json``); SERVE_ARGS
default to ``--quantize int4-q8 --kv-dtype float16 --threads 1 --max-bs 8``
with ``--model``, ``--threads 1`` with the embedded model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bench_real_cpu import save_results
from bench.conftest import command, machine
from bench.serve_load import start_server
from graphrunner_ref.model.cpu_features import cpu_features

#: The starts timed, in order, and the ``--aot-cache`` each passes.
STARTS = ("first start", "restart", "restart, --aot-cache none")
SMOLLM2_ARGS = ["--quantize", "int4-q8", "--kv-dtype", "float16", "--threads", "1"]


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy completion's token ids (``token_ids`` of the answer)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        choice = json.loads(answer.read())["choices"][0]
    return list(choice["token_ids"])


def one_start(model: str, args: list[str], aot: str, prompt: list[int], tokens: int) -> Any:
    """Seconds to listen, and the tokens of one greedy answer."""
    began = time.perf_counter()
    proc, url = start_server(model, [*args, "--aot-cache", aot, "--served-model-name", "m"])
    seconds = time.perf_counter() - began
    try:
        answer = complete(url, prompt, tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"seconds": seconds, "tokens": answer}


def report(result: dict[str, Any]) -> list[str]:
    runs = result["runs"]
    first = runs[STARTS[0]]["seconds"]
    lines = [
        f"# graphrunner serve: first start and restart ({result['name']})",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- CPU features: {result['cpu']}",
        f"- serve: `{result['model']} {' '.join(result['serve_args'])}`",
        "- seconds from the launch to `listening` (model load, capture, warm-up); "
        f"then one greedy completion of {result['prompt_len']} prompt tokens, "
        f"{result['max_tokens']} new",
        "",
        "| start | seconds | vs first start | same tokens as the first start |",
        "|---|---|---|---|",
    ]
    for name in STARTS:
        run = runs[name]
        same = run["tokens"] == runs[STARTS[0]]["tokens"]
        lines.append(
            f"| {name} | {run['seconds']:.1f} | {run['seconds'] / first:.2f}x | "
            f"{'yes' if same else 'NO'} |"
        )
    saved, none = runs[STARTS[1]]["seconds"], runs[STARTS[2]]["seconds"]
    lines += [
        "",
        f"A restart loads in {saved:.1f} s: **{none / saved:.1f}x** faster than "
        f"compiling in process ({none:.1f} s).",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint (default: the embedded model)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--name", help="results name (default: the model folder's or embedded)")
    p.add_argument("serve_args", nargs="*", help="after --: graphrunner serve's own flags")
    args = p.parse_args(argv)
    model = args.model or "embedded"
    serve_args = args.serve_args or (SMOLLM2_ARGS if args.model else ["--threads", "1"])
    prompt = [(7 * i) % 50 + 1 for i in range(args.prompt_len)]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in STARTS:
            aot = "none" if name.endswith("none") else folder
            runs[name] = one_start(model, serve_args, aot, prompt, args.max_tokens)
            print(f"{name}: {runs[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
    name = args.name or (Path(args.model).name if args.model else "embedded")
    result = {
        "name": name,
        "command": command("bench_serve_restart", argv),
        "machine": machine(),
        "cpu": cpu_features().describe(),
        "model": model,
        "serve_args": serve_args,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "runs": runs,
    }
    print(save_results(f"serve-restart-{name}", report(result), result))
    same = all(r["tokens"] == runs[STARTS[0]]["tokens"] for r in runs.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
