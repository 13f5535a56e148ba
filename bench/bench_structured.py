"""Structured output's cost on ``graphrunner serve`` (and ``vllm serve``
beside it): output tokens/s of JSON-schema requests against free requests, at
one concurrency, in one run.

It starts ``graphrunner serve MODEL --port 0 SERVE_ARGS``, warms both kinds
up, then, ``--repeats`` times in turn, sends ``--requests`` completions
(token-id prompts of ``--prompt-len`` tokens, ``--concurrency`` in flight)
constrained by a JSON
schema (``response_format`` ``json_schema``: an object of an enum, a bounded
integer, a boolean and a short array of bounded integers; greedy, so each
answer ends where its grammar does), then as many free requests (the end
token ignored) of the constrained answers' mean length, and reports each
kind's output tokens/s (the best of ``--repeats``) and their ratio. Every
JSON answer is parsed and checked against the schema (:func:`valid`), the
whole text and, counted apart, the text from its first ``{`` (vLLM 0.32 puts
the decoded text of some token-id prompts before their answers). The
issue's goal: the constrained requests at >= 0.9x the free ones.

When ``GRAPHRUNNER_VLLM_PYTHON`` names vLLM's environment, ``vllm serve``
(``bench.bench_vllm_serve``'s contender: bfloat16, one compute thread, on
127.0.0.1) then serves the same checkpoint and gets the same requests, after
graphrunner's server has stopped, and its own ratio goes beside
graphrunner's. vLLM loads a checkpoint directory, so ``--model`` is then one.

The embedded model has no tokenizer, which a grammar needs: ``--model
tiny`` builds the tests' tiny trained-tokenizer Llama (vocabulary 320) in a
temporary directory; any checkpoint with a tokenizer (a GGUF) works too.

``PYTHONPATH=. [GRAPHRUNNER_VLLM_PYTHON=...] .venv/bin/python -m
bench.bench_structured --model PATH --name NAME`` writes
``bench/results/structured-<name>-<cpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.bench_vllm_serve import _contenders as serve_contenders
from bench.bench_vllm_serve import free_port, serving
from bench.conftest import RESULTS_DIR, cpu_name
from bench.serve_load import start_server
from bench.vllm_cpu_run import VLLM_PYTHON, vllm_python, vllm_system
from graphrunner_ref.model.cpu_features import cpu_features

ROOT = Path(__file__).resolve().parents[1]
#: The row label of graphrunner's server.
GRAPHRUNNER = "graphrunner"
#: What ``vllm serve`` is given beyond ``bench.bench_vllm_serve``'s contender:
#: JSON grammars without free whitespace, as graphrunner compiles them. vLLM's
#: xgrammar backend takes this per server only; without it, greedy SmolLM2
#: fills its answers with newlines between the tokens and runs out of
#: ``--max-tokens`` (no answer parsed in a first run).
VLLM_NO_FREE_WHITESPACE = (
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)

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


def valid(value: Any, schema: dict[str, Any]) -> bool:
    """``value`` against the keywords of JSON Schema that :data:`SCHEMA` and
    the serve tests' schemas use (``jsonschema`` is not a dependency)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", ()))
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(valid(v, props[k]) for k, v in value.items() if k in props)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
            and all(valid(v, schema["items"]) for v in value)
        )
    if kind in ("integer", "number"):
        types = int if kind == "integer" else (int, float)
        return (
            isinstance(value, types)
            and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        )
    if kind == "string":
        return (
            isinstance(value, str) and re.fullmatch(schema.get("pattern", ".*"), value) is not None
        )
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def parses_and_validates(text: str) -> bool:
    """Whether ``text`` is one JSON value that :data:`SCHEMA` accepts."""
    try:
        return valid(json.loads(text), SCHEMA)
    except json.JSONDecodeError:
        return False


def cpu_label(name: str) -> str:
    """A short label for a results file name (``xeon``, ``epyc``, ...)."""
    for word in ("xeon", "epyc", "ryzen", "core"):
        if word in name.lower():
            return word
    return "cpu"


@dataclass(frozen=True, slots=True)
class Load:
    """One load run: output tokens, seconds, and each answer's text, token
    count and finish reason."""

    tokens: int
    seconds: float
    texts: list[str]
    counts: list[int]
    finishes: list[str]


async def load(
    url: str, model: str, prompts: list[list[int]], fields: dict[str, Any], concurrency: int
) -> Load:
    """Every prompt as one completion of ``model`` with ``fields``,
    ``concurrency`` in flight."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    texts: list[str] = []
    counts: list[int] = []
    finishes: list[str] = []
    extra = {k: v for k, v in fields.items() if k != "max_tokens"}

    async def one(prompt: list[int]) -> None:
        async with gate:
            answer = await client.completions.create(
                model=model, prompt=prompt, max_tokens=fields["max_tokens"], extra_body=extra
            )
            assert answer.usage is not None
            texts.append(answer.choices[0].text)
            counts.append(answer.usage.completion_tokens)
            finishes.append(answer.choices[0].finish_reason)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    await client.close()
    return Load(sum(counts), seconds, texts, counts, finishes)


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
    python = vllm_python()
    servers: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp)) if args.model == "tiny" else args.model
        serve_args = [
            "--runner", args.runner, "--max-bs", str(max(8, args.concurrency)),
            "--max-context-len", str(args.context), "--threads", str(args.threads), "--quiet",
            "--served-model-name", "bench",
        ]  # fmt: skip
        proc, url = start_server(model, serve_args)
        try:
            ours = _measure(url, "bench", args)
        finally:
            proc.terminate()
            status = proc.wait(120)
        servers[GRAPHRUNNER] = ours | {"server_exit": status}
        print(f"{GRAPHRUNNER}: {json.dumps(servers[GRAPHRUNNER])}", file=sys.stderr, flush=True)
        if python is not None:
            servers |= _measure_vllm(python, model, args, Path(tmp))
    result: dict[str, Any] = {"model": args.model, "name": name, "runner": args.runner}
    result |= {"cpu": cpu_name(), "cores": os.cpu_count(), "servers": servers}
    if python is not None:
        result["vllm"] = vllm_system()
    _write(result, args)
    return 0


def _measure_vllm(
    python: str, model: str, args: argparse.Namespace, logs: Path
) -> dict[str, dict[str, Any]]:
    """``bench.bench_vllm_serve``'s vLLM contender on ``model``, measured as
    graphrunner's server was: its row, by its label."""
    ns = argparse.Namespace(model=model, context=args.context, concurrency=args.concurrency)
    vllm = next(c for c in serve_contenders(ns, python) if c.label.startswith("vLLM"))
    extra = (a.replace("{", "{{").replace("}", "}}") for a in VLLM_NO_FREE_WHITESPACE)
    vllm = replace(vllm, command=(*vllm.command, *extra))  # a command is a format string
    port = free_port()
    print(f"{vllm.label}: starting", file=sys.stderr, flush=True)
    with serving(vllm, port, logs):
        return {vllm.label: _measure(f"http://127.0.0.1:{port}", "m", args)}


def _measure(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 300) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    constrained = {"max_tokens": args.max_tokens, "temperature": 0, "response_format": fmt}
    before = _load_average()

    def run(fields: dict[str, Any], some: list[list[int]], concurrency: int) -> Load:
        return asyncio.run(load(url, model, some, fields, concurrency))

    answers = [run(constrained, prompts[:2], 2)]  # compile and warm up
    first = run(constrained, prompts, args.concurrency)
    answers.append(first)
    mean = max(1, round(sum(first.counts) / len(first.counts)))
    free = {"max_tokens": mean, "temperature": 0, "ignore_eos": True}
    run(free, prompts[:2], 2)
    best_c = best_f = 0.0
    for _ in range(args.repeats):  # interleaved: a drift in the machine's load hits both
        timed = run(constrained, prompts, args.concurrency)
        answers.append(timed)
        best_c = max(best_c, timed.tokens / timed.seconds)
        timed = run(free, prompts, args.concurrency)
        best_f = max(best_f, timed.tokens / timed.seconds)
    texts = [t for a in answers for t in a.texts]
    invalid = [t for t in texts if not parses_and_validates(t)]
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "mean_answer_tokens": sum(first.counts) / len(first.counts),
        "json_answers": len(texts),
        "json_valid": sum(map(parses_and_validates, texts)),
        "json_valid_from_first_brace": sum(parses_and_validates(t[t.find("{") :]) for t in texts),
        "json_cut_at_max_tokens": sum(f == "length" for a in answers for f in a.finishes),
        "json_invalid_examples": list(dict.fromkeys(invalid))[:3],
        "json_example": first.texts[0],
        "structured_tok_s": best_c,
        "free_tok_s": best_f,
        "ratio": best_c / best_f,
        "load_average": [list(before), list(_load_average())],
    }


def _load_average() -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ()


def _command(with_vllm: bool) -> str:
    env = f"{VLLM_PYTHON}={os.environ.get(VLLM_PYTHON)} " if with_vllm else ""
    return " ".join(
        [f"PYTHONPATH=. {env}.venv/bin/python -m bench.bench_structured", *sys.argv[1:]]
    )


def _write(r: dict[str, Any], args: argparse.Namespace) -> None:
    label = cpu_label(r["cpu"])
    stem = RESULTS_DIR / f"structured-{r['name']}-{label}"
    servers: dict[str, dict[str, Any]] = r["servers"]
    ours = servers[GRAPHRUNNER]
    goal = "met" if ours["ratio"] >= 0.9 else "unmet"
    vllm = next(((k, v) for k, v in servers.items() if k != GRAPHRUNNER), None)
    rows = "\n".join(
        f"| {who} | {s['free_tok_s']:.1f} | {s['structured_tok_s']:.1f} | {s['ratio']:.2f}x | "
        f"{s['mean_answer_tokens']:.1f} | {s['json_valid']}/{s['json_answers']} "
        f"({s['json_valid_from_first_brace']}) | "
        f"{s['json_cut_at_max_tokens']} | "
        f"{s['load_average'][0]} → {s['load_average'][1]} |"
        for who, s in servers.items()
    )
    beside = (
        f"{vllm[1]['ratio']:.2f}x ({vllm[0]}, {r['vllm']}), measured in this run"
        if vllm
        else f"not measured ({VLLM_PYTHON} unset)"
    )
    invalid = "".join(
        f"- {who}'s answers that failed the schema check (up to 3): "
        + ", ".join(f"`{json.dumps(t)[:160]}`" for t in s["json_invalid_examples"])
        + "\n"
        for who, s in servers.items()
        if s["json_invalid_examples"]
    )
    vllm_note = (
        "; vLLM: its CPU build, bfloat16 (oneDNN), started as `bench.bench_vllm_serve` starts it "
        f"plus `{' '.join(VLLM_NO_FREE_WHITESPACE)}` (no free whitespace in JSON, as graphrunner)"
    )
    text = f"""# Structured output on graphrunner serve: {r["name"]}, {r["runner"]} runner, {r["cpu"]}

- command: `{_command(vllm is not None)}`
- cpu: {r["cpu"]}, {r["cores"]} cores; features {cpu_features().describe()}
- kernel paths: graphrunner float32 (its default `--dtype`, no `--quantize`): torch's matmuls,
  no graphrunner C++ kernel{vllm_note if vllm else ""};
  each server on one compute thread, on 127.0.0.1, one after the other
- {args.requests} completions at concurrency {args.concurrency}, prompts of {args.prompt_len}
  token ids, greedy; the JSON-schema requests (`response_format` `json_schema`, up to
  {args.max_tokens} tokens) end where their grammar does, the free ones run the server's mean
  JSON answer length (end token ignored); each figure the best of {args.repeats} runs, the two
  kinds in turn; every JSON answer (warm-up and timed) parsed and checked against the schema

| server | free tok/s | JSON tok/s | JSON ÷ free | mean JSON answer tokens | JSON answers valid (from the first `{{`) | cut at max tokens | load average before → after |
|---|---|---|---|---|---|---|---|
{rows}

- goal: graphrunner's JSON-schema output tok/s >= 0.9x free at concurrency {args.concurrency}: {ours["ratio"]:.2f}x ({goal})
- vLLM's ratio beside it: {beside}.
- graphrunner's server exit status: {ours["server_exit"]}
{invalid}
Caveats: both kinds run on one server, whose step carries the bitmask buffer for every row
(all ones on a free row), so what that buffer costs free requests against a server without
it is not in this ratio. The free requests all have one length and start and end together;
the constrained ones end where their grammars do, staggered, which keeps the batch fuller.
vLLM fills a bitmask for constrained rows only, so its free requests carry none. Its JSON has
no spaces after `,` and `:` (graphrunner's has one), so its answers are a few tokens shorter.
The two servers' ratios are each within one server; their tok/s are not a like-for-like
comparison (graphrunner float32 torch matmuls, vLLM bfloat16). The machine may be shared:
the load averages say how busy it was.
"""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(r, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
