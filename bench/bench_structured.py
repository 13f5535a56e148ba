"""Structured output's cost on ``graphrunner serve``: output tokens/s of
JSON-schema requests against free requests, at one concurrency, in one run.

It starts ``graphrunner serve MODEL --port 0 SERVE_ARGS``, warms both kinds
up, then, ``--repeats`` times in turn, sends ``--requests`` completions
(token-id prompts of ``--prompt-len`` tokens, ``--concurrency`` in flight)
constrained by a JSON
schema (``response_format`` ``json_schema``: an object of an enum, a bounded
integer, a boolean and a short array of bounded integers; greedy, so each
answer ends where its grammar does), then as many free requests (the end
token ignored) of the constrained answers' mean length, and reports each
kind's output tokens/s (the best of ``--repeats``) and their ratio. The
issue's goal: the constrained requests at >= 0.9x the free ones.

The embedded model has no tokenizer, which a grammar needs: ``--model
tiny`` builds the tests' tiny trained-tokenizer Llama (vocabulary 320) in a
temporary directory; any checkpoint with a tokenizer (a GGUF) works too.

``PYTHONPATH=. .venv/bin/python -m bench.bench_structured --model PATH --name NAME``
writes ``bench/results/structured-<name>-<cpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.conftest import RESULTS_DIR, cpu_name
from bench.serve_load import start_server

ROOT = Path(__file__).resolve().parents[1]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "sizes": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 3,
        },
    },
    "required": ["color", "count", "ok", "sizes"],
    "additionalProperties": False,
}


def cpu_label(name: str) -> str:
    """A short label for a results file name (``xeon``, ``epyc``, ...)."""
    for word in ("xeon", "epyc", "ryzen", "core"):
        if word in name.lower():
            return word
    return "cpu"


async def load(
    url: str, prompts: list[list[int]], fields: dict[str, Any], concurrency: int
) -> tuple[int, float, list[int]]:
    """Every prompt as one completion with ``fields``, ``concurrency`` in
    flight: (output tokens, seconds, each answer's token count)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    counts: list[int] = []
    extra = {k: v for k, v in fields.items() if k != "max_tokens"}

    async def one(prompt: list[int]) -> None:
        async with gate:
            answer = await client.completions.create(
                model="bench", prompt=prompt, max_tokens=fields["max_tokens"], extra_body=extra
            )
            if "response_format" in fields:
                json.loads(answer.choices[0].text)  # a whole JSON answer
            assert answer.usage is not None
            counts.append(answer.usage.completion_tokens)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    await client.close()
    return sum(counts), seconds, counts


def _tiny_model(tmp: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_world import tiny_text_checkpoint

    tiny_text_checkpoint(tmp / "tiny")
    return str(tmp / "tiny")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a checkpoint with a tokenizer, or tiny")
    p.add_argument("--name", default=None, help="the model's name in the results file")
    p.add_argument("--runner", default="cpu")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", type=int, default=128, help="--max-context-len of the server")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    name = args.name or Path(args.model).stem
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp)) if args.model == "tiny" else args.model
        serve_args = [
            "--runner", args.runner, "--max-bs", str(max(8, args.concurrency)),
            "--max-context-len", str(args.context), "--threads", str(args.threads), "--quiet",
            "--served-model-name", "bench",
        ]  # fmt: skip
        proc, url = start_server(model, serve_args)
        try:
            result = _measure(url, args)
        finally:
            proc.terminate()
            status = proc.wait(120)
    result |= {"model": args.model, "name": name, "runner": args.runner, "cpu": cpu_name()}
    result["server_exit"] = status
    _write(result, args)
    return 0


def _measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 300) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    constrained = {"max_tokens": args.max_tokens, "temperature": 0, "response_format": fmt}
    asyncio.run(load(url, prompts[:2], constrained, 2))  # compile and warm up
    _, _, lengths = asyncio.run(load(url, prompts, constrained, args.concurrency))
    mean = max(1, round(sum(lengths) / len(lengths)))
    free = {"max_tokens": mean, "temperature": 0, "ignore_eos": True}
    asyncio.run(load(url, prompts[:2], free, 2))
    best_c = best_f = 0.0
    for _ in range(args.repeats):  # interleaved: a drift in the machine's load hits both
        tokens, seconds, _ = asyncio.run(load(url, prompts, constrained, args.concurrency))
        best_c = max(best_c, tokens / seconds)
        tokens, seconds, _ = asyncio.run(load(url, prompts, free, args.concurrency))
        best_f = max(best_f, tokens / seconds)
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "mean_answer_tokens": sum(lengths) / len(lengths),
        "structured_tok_s": best_c,
        "free_tok_s": best_f,
        "ratio": best_c / best_f,
        "load_average": list(_load_average()),
    }


def _load_average() -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ()


def _write(r: dict[str, Any], args: argparse.Namespace) -> None:
    label = cpu_label(r["cpu"])
    stem = RESULTS_DIR / f"structured-{r['name']}-{label}"
    cmd = " ".join(["PYTHONPATH=. .venv/bin/python -m bench.bench_structured", *sys.argv[1:]])
    goal = "met" if r["ratio"] >= 0.9 else "unmet"
    text = f"""# Structured output on graphrunner serve: {r["name"]}, {r["runner"]} runner, {r["cpu"]}

`{cmd}`: {r["requests"]} completions at concurrency {r["concurrency"]}, prompts of
{r["prompt_len"]} token ids, greedy; the JSON-schema requests end where their grammar
does ({r["mean_answer_tokens"]:.1f} tokens on average), the free ones run that many tokens
(end token ignored); each figure the best of {args.repeats} runs, the two kinds in turn; server exit status
{r["server_exit"]}; load average {r["load_average"]}.

| requests | output tok/s |
|---|---|
| JSON schema (`response_format`) | {r["structured_tok_s"]:.1f} |
| free | {r["free_tok_s"]:.1f} |
| ratio | {r["ratio"]:.2f}x |

- goal: JSON-schema output tok/s >= 0.9x free at concurrency {r["concurrency"]}: {r["ratio"]:.2f}x ({goal})
- vLLM's ratio beside it: not measured (no vLLM in this environment).

Caveats: both kinds run on one server, whose step carries the bitmask buffer for every row
(all ones on a free row), so what that buffer costs free requests against a server without
it is not in this ratio. The free requests all have one length and start and end together;
the constrained ones end where their grammars do, staggered, which keeps the batch fuller.
"""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(r, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
