"""Multi-turn chats against ``graphrunner serve`` (and ``vllm serve``): the
time to first token by turn number, as a prefix cache should hold it flat.

``--conversations`` chats run at once, each ``--turns`` turns long; every
turn resends the whole history (the system prompt, each earlier question
and answer) plus a new question of ``--question-len`` words, streamed, up to
``--answer-len`` new tokens, greedy. A turn's time to first token is taken
when its first content chunk arrives, as a client measures it. With a
prefix cache, a turn prefills its new question only, so its TTFT stays flat
as the history grows; without one it grows with the history.

Each contender (``bench.bench_vllm_serve``'s servers: one compute thread
each) serves its own run on 127.0.0.1; the table gives the TTFT p50 per turn,
the last turn's over the first's, and the hit rate the server reports
(graphrunner's ``/metrics``; vLLM's ``vllm:prefix_cache_*``).

``PYTHONPATH=. .venv/bin/python -m bench.bench_multiturn --model DIR
[--only LABELS]`` writes ``bench/results/multiturn-<name>.md`` (and
``.json``); ``GRAPHRUNNER_VLLM_PYTHON`` adds vLLM's row.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.bench_vllm_serve import Contender, free_port, serving
from bench.bench_vllm_serve import _contenders as serve_contenders
from bench.conftest import RESULTS_DIR, cpu_name
from bench.vllm_cpu_run import VLLM_PYTHON, vllm_python
from graphrunner_ref.model.cpu_features import kernel_summary

#: Words questions and the system prompt are drawn from.
WORDS = [
    "model",
    "cache",
    "token",
    "graph",
    "batch",
    "prompt",
    "answer",
    "layer",
    "kernel",
    "memory",
    "thread",
    "request",
    "server",
    "client",
    "stream",
    "page",
    "prefix",
    "decode",
    "replay",
    "capture",
    "tensor",
]
#: Seconds one turn may take.
TURN_S = 600.0


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _turn(port: int, messages: list[dict[str, str]], answer_len: int) -> tuple[float, str]:
    """One streamed chat turn: seconds to its first content chunk, and the
    whole answer's text."""
    body = {"model": "m", "messages": messages, "max_tokens": answer_len, "stream": True}
    body |= {"temperature": 0.0}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TURN_S)
    start = time.perf_counter()
    first: float | None = None
    text = []
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"turn answered {response.status}: {response.read()[:500]!r}")
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if not data or data == "[DONE]":
                continue
            choices = json.loads(data).get("choices") or [{}]
            content = choices[0].get("delta", {}).get("content")
            if content:
                first = first if first is not None else time.perf_counter() - start
                text.append(content)
    finally:
        conn.close()
    return (first if first is not None else time.perf_counter() - start), "".join(text)


def _conversation(port: int, seed: int, args: argparse.Namespace, system: str) -> list[float]:
    """One chat of ``args.turns`` turns; each turn's TTFT in seconds."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}]
    ttfts = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": _text(rng, args.question_len)})
        ttft, answer = _turn(port, messages, args.answer_len)
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": answer})
    return ttfts


def _hit_rate(port: int) -> float | None:
    """The prefix cache's hit rate the server reports (None: none reported)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    for queries, hits in (
        ("graphrunner_prefix_cache_queries_total", "graphrunner_prefix_cache_hits_total"),
        ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    ):
        if values.get(queries):
            return values.get(hits, 0.0) / values[queries]
    return None


def run_contender(contender: Contender, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Every conversation against ``contender``: TTFT p50 per turn, the hit rate."""
    port = free_port()
    system = _text(random.Random(1000), args.system_len)
    with serving(contender, port, logs):
        _conversation(port, 999, argparse.Namespace(**{**vars(args), "turns": 1}), "warm up")
        with ThreadPoolExecutor(args.conversations) as pool:
            runs = list(
                pool.map(lambda i: _conversation(port, i, args, system), range(args.conversations))
            )
        rate = _hit_rate(port)
    by_turn = [statistics.median(run[t] for run in runs) * 1e3 for t in range(args.turns)]
    return {"ttft_p50_ms": by_turn, "hit_rate": rate}


def write_results(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / f"multiturn-{args.name}"
    cpu = cpu_name()
    turns = " | ".join(f"turn {t + 1}" for t in range(args.turns))
    lines = [
        f"# Multi-turn chats: time to first token by turn ({args.name})",
        "",
        f"- cpu: {cpu}, {os.cpu_count()} cores; each server on one compute thread",
        f"- graphrunner's kernel paths here: {kernel_summary(['int4-q8', 'int4-bf16'])}",
        f"- command: `PYTHONPATH=. .venv/bin/python -m bench.bench_multiturn --model {args.model} "
        f"--name {args.name}"
        + (f" --only '{args.only}'" if getattr(args, "only", "") else "")
        + "`",
        f"- {args.conversations} conversations at once, {args.turns} turns each; a system "
        f"prompt of {args.system_len} words, questions of {args.question_len} words, answers "
        f"up to {args.answer_len} tokens, greedy; every turn resends the history",
        "",
        f"| server | {turns} | last / first | hit rate |",
        "|---|" + "---|" * (args.turns + 2),
    ]
    for label, row in rows.items():
        ttft = row["ttft_p50_ms"]
        rate = "—" if row["hit_rate"] is None else f"{row['hit_rate']:.0%}"
        cells = " | ".join(f"{v:,.0f}" for v in ttft)
        lines.append(f"| {label} | {cells} | {ttft[-1] / ttft[0]:.2f}x | {rate} |")
    lines += ["", "TTFT p50 in ms over the conversations, by turn number."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint directory with a chat template")
    p.add_argument("--name", default="smollm2")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=200, help="words of the system prompt")
    p.add_argument("--question-len", type=int, default=40, help="words of each question")
    p.add_argument("--answer-len", type=int, default=32, help="new tokens of each answer")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=8, help="the servers' batch rows")
    p.add_argument("--only", default="", help="comma-separated: contenders whose label has one")
    args = p.parse_args(argv)
    python = vllm_python()
    if python is None:
        print(f"{VLLM_PYTHON} names no python with vLLM: graphrunner only", file=sys.stderr)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for contender in serve_contenders(args, python or sys.executable):
            if contender.label.startswith("vLLM") and python is None:
                continue
            if args.only and not any(part in contender.label for part in args.only.split(",")):
                continue
            print(f"{contender.label}: starting", file=sys.stderr, flush=True)
            rows[contender.label] = run_contender(contender, args, Path(tmp))
            print(f"  {rows[contender.label]}", file=sys.stderr, flush=True)
    write_results(args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
