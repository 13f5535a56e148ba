"""A load generator for ``graphrunner serve`` over the official ``openai``
async client, against offline ``generate`` on the same prompts in the same run.

It starts ``graphrunner serve MODEL --port 0 SERVE_ARGS``, sends ``--requests``
streamed completions (token-id prompts of ``--prompt-len`` tokens, each
``--max-tokens`` new tokens, the end token ignored) at each concurrency of
``--concurrency``, and measures request throughput, output tokens/s, time to
first token and inter-token latency (p50 / p99) as the client sees them, and
requests lost (anything but a whole answer). Then it serves the same prompts
offline through the one engine path (:func:`graphrunner_ref.engine.serving.serve`,
what ``generate`` runs; capture excluded from the time) with the rows the
concurrency allows: at batch 8 (the goals: the server at concurrency 8 gives
at least 0.9x its output tokens/s, and its median inter-token latency is at
most 1.1x the offline decode step at 8 rows) and at batch 1 (the server's
overhead per streamed token at concurrency 1, against the offline decode
step: at most 5%).

``PYTHONPATH=. .venv/bin/python -m bench.serve_load --model embedded --runner cpu``
writes ``bench/results/serve-load-<name>.md`` (and ``.json``). Flags after
``--`` go to both the server and the offline run (``-- --quantize int4-q8
--kv-dtype float16``); the CPU's features and kernel paths are named.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.conftest import RESULTS_DIR, machine
from graphrunner_ref.model.cpu_features import cpu_features

ROOT = Path(__file__).resolve().parents[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "graphrunner", "serve", model, "--port", "0", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        if "listening on http://" in line:
            return proc, line.split("listening on ")[1].strip()
    raise RuntimeError("graphrunner serve did not start")


async def load(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    lost = 0

    async def one(prompt: list[int]) -> None:
        nonlocal tokens, lost
        async with gate:
            start = time.perf_counter()
            last = None
            got = 0
            try:
                stream = await client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    stream=True,
                )
                async for chunk in stream:
                    ids = (
                        (chunk.choices[0].model_extra or {}).get("token_ids")
                        if chunk.choices
                        else None
                    )
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - start)
                    else:
                        itl.extend([(now - last) / len(ids)] * len(ids))
                    last = now
                    got += len(ids)
            except openai.APIError:
                lost += 1
                return
            if got != max_tokens:
                lost += 1
            tokens += got

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    await client.close()
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "lost": lost,
        "seconds": seconds,
        "requests_per_s": len(prompts) / seconds,
        "output_tokens_per_s": tokens / seconds,
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
        "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * _pct(itl, 0.5),
        "itl_p99_ms": 1e3 * _pct(itl, 0.99),
        "itl_mean_ms": 1e3 * sum(itl) / len(itl) if itl else float("nan"),
    }


def offline(args: argparse.Namespace, prompts: list[list[int]], rows: int) -> dict[str, Any]:
    """The same prompts served offline through the one engine path, ``rows``
    at a time; output tokens/s over the run (capture excluded) and the mean
    decode step."""
    import graphrunner_ref.cli.main as cli
    from graphrunner_ref.cli.options import config_of
    from graphrunner_ref.engine import serving
    from graphrunner_ref.engine.workload import requests_from_prompts

    line = [
        "serve",
        args.model,
        "--runner",
        args.runner,
        "--max-bs",
        str(rows),
        "--threads",
        str(args.threads),
        *args.serve_args,
    ]
    parsed = cli._parse(line)
    from graphrunner_ref.cli import checks

    kind = checks.check_common(parsed)
    checks.model_kind(parsed)
    sizes = checks.capture_sizes(parsed)
    config = config_of(parsed, kind, sizes)
    bundle = serving.build(config, rows, args.max_context_len)
    trace = requests_from_prompts(prompts, max_new_tokens=args.max_tokens)
    # A warm-up on the same model first (the server has had its own): the
    # first prefill after a capture may still compile.
    serving.serve(config, bundle, trace[:rows])
    began: list[float] = []
    outcome = serving.serve(
        config, bundle, trace, on_capture=lambda runner, report: began.append(time.perf_counter())
    )
    seconds = time.perf_counter() - began[-1]  # after the last runner (decode, then token) captured
    stats = outcome.result.stats
    made = sum(len(t) for t in outcome.result.outputs.values())
    return {
        "rows": rows,
        "output_tokens_per_s": made / seconds,
        "decode_step_ms": 1e3 * stats.decode_seconds / max(stats.steps, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--runner", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-bs", type=int, default=16)
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-context-len",
        type=int,
        default=256,
        help="the context of the server's pools and the offline run's",
    )
    p.add_argument("--name", default=None)
    p.add_argument("--repeat", type=int, default=2, help="runs of each measurement; the best kept")
    p.add_argument("serve_args", nargs="*", help="after --: flags of both the server and offline")
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 200) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    serve_args = [
        "--max-context-len",
        str(args.max_context_len),
        "--runner",
        args.runner,
        "--max-bs",
        str(args.max_bs),
        "--threads",
        str(args.threads),
        "--quiet",
        "--ignore-eos",
        *args.serve_args,
    ]
    proc, url = start_server(args.model, serve_args)
    rows = []
    try:
        asyncio.run(load(url, args.model, prompts[:4], args.max_tokens, 4))  # warm-up
        for c in (int(x) for x in args.concurrency.split(",")):
            # Best of --repeat: a shared machine's other load only ever slows a run down.
            runs = [
                asyncio.run(load(url, args.model, prompts, args.max_tokens, c))
                for _ in range(args.repeat)
            ]
            rows.append(max(runs, key=lambda r: r["output_tokens_per_s"]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        proc.terminate()
        status = proc.wait(120)
    offline8 = max(
        (offline(args, prompts, 8) for _ in range(args.repeat)),
        key=lambda r: r["output_tokens_per_s"],
    )
    offline1 = min(
        (offline(args, prompts[:8], 1) for _ in range(args.repeat)),
        key=lambda r: r["decode_step_ms"],
    )
    at8 = next((r for r in rows if r["concurrency"] == 8), None)
    at1 = next((r for r in rows if r["concurrency"] == 1), None)
    ratio = at8["output_tokens_per_s"] / offline8["output_tokens_per_s"] if at8 else float("nan")
    itl8 = at8["itl_p50_ms"] / offline8["decode_step_ms"] if at8 else float("nan")
    overhead = (
        (at1["itl_mean_ms"] - offline1["decode_step_ms"]) / offline1["decode_step_ms"]
        if at1
        else float("nan")
    )
    name = args.name or Path(args.model).name
    out = RESULTS_DIR / f"serve-load-{name}-{args.runner}"
    command = "PYTHONPATH=. .venv/bin/python -m bench.serve_load " + " ".join(sys.argv[1:])
    lines = [
        f"# graphrunner serve under load: {args.model}, {args.runner} runner, {os.cpu_count()} cores",
        "",
        "- machine: " + ", ".join(f"{k} {v}" for k, v in machine().items()),
        f"- CPU features: {cpu_features().describe()}",
        "",
        f"`{command}`: {args.requests} streamed completions per concurrency, prompts of "
        f"{args.prompt_len} token ids, {args.max_tokens} new tokens each (end token ignored), "
        f"--max-bs {args.max_bs}, --max-context-len {args.max_context_len}, --threads {args.threads}; each figure the best of "
        f"{args.repeat} runs; server exit status {status}.",
        "",
        "| concurrency | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
            f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} | "
            f"{r['itl_p99_ms']:.2f} | {r['lost']} |"
        )
    lines += [
        "",
        f"Offline (the engine path `generate` runs, capture excluded): {offline8['output_tokens_per_s']:.1f} "
        f"output tok/s at 8 rows, decode step {offline8['decode_step_ms']:.2f} ms; "
        f"decode step at 1 row {offline1['decode_step_ms']:.2f} ms.",
        "",
        f"- goal: concurrency 8 >= 0.9x offline output tok/s: {ratio:.2f}x "
        f"({'met' if ratio >= 0.9 else 'unmet'})",
        f"- goal: served ITL p50 at concurrency 8 <= 1.1x the offline decode step at 8 rows: "
        f"{itl8:.2f}x ({at8['itl_p50_ms'] if at8 else 0:.2f} ms against "
        f"{offline8['decode_step_ms']:.2f} ms; {'met' if itl8 <= 1.1 else 'unmet'})",
        f"- goal: server overhead per streamed token at concurrency 1 <= 5% of the decode step: "
        f"{100 * overhead:.1f}% (mean gap between tokens {at1['itl_mean_ms'] if at1 else 0:.2f} ms "
        f"against the offline step; {'met' if overhead <= 0.05 else 'unmet'})",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "rows": rows,
                "offline8": offline8,
                "offline1": offline1,
                "ratio8": ratio,
                "itl8": itl8,
                "serve_args": args.serve_args,
                "overhead1": overhead,
            },
            indent=1,
        )
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
