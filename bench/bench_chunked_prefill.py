"""The stall a long prompt puts on running requests, chunked against not.

Eight chat requests decode on SmolLM2-135M (the checkpoint ``make demo-real``
fetches; ``--model embedded`` for the embedded random model) through the CPU
runner, one thread; at engine step 10 a 2,048-token prompt arrives. For each
token budget (``max_num_batched_tokens``; none: the prompt is prefilled whole
in one step, as before chunked prefill) the running requests' inter-token
latencies are timed (wall clock between a request's successive tokens): the
median over the run and the p99 of the gaps that end during the long
prompt's prefill, from its arrival to its first token (the steps after it,
decoding a 2,048-token row, are the decode attention's cost, not the stall). Goal (issue 50): p99 <= 3x the median with
chunking. Every run's tokens must equal the unchunked run's. With a budget
the prompt chunks run as the engine runs them: one captured token batch a
step (the CPU runner, captured at the budget).

    PYTHONPATH=. .venv/bin/python -m bench.bench_chunked_prefill [--model embedded]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.conftest import machine
from graphrunner.util.atomic import write_atomically
from graphrunner_ref.engine.bundle import create_token_runner
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import default_model
from graphrunner_ref.model.default import default_config

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_chunked_prefill"
RESULTS = Path(__file__).parent / "results"
BATCH = 8
LONG = 2048
ARRIVAL = 10
BUDGETS: list[int | None] = [None, 512, 128, 32]


def _model(name: str) -> tuple[Any, list[tuple[int, ...]]]:
    context = LONG + 64
    if name == "embedded":
        config = dataclasses.replace(default_config(), max_position_embeddings=context)
        bundle = default_model(max_requests=2 * BATCH, max_context_len=context, config=config)
        gen = torch.Generator().manual_seed(0)
        return bundle, [tuple(torch.randint(3, 250, (20,), generator=gen).tolist())] * BATCH
    from bench.bench_context import smollm2_chats
    from graphrunner_ref.io import load_model

    checkpoint, prompts = smollm2_chats()
    bundle = load_model(checkpoint, max_requests=2 * BATCH, max_context_len=context)
    return bundle, [tuple(p) for p in prompts]


def _trace(prompts: list[tuple[int, ...]], vocab: int, new: int) -> list[Request]:
    gen = torch.Generator().manual_seed(1)
    long = tuple(torch.randint(3, vocab, (LONG,), generator=gen).tolist())
    running = [Request(i, p, new) for i, p in enumerate(prompts)]
    return [*running, Request(BATCH, long, 4, arrival_step=ARRIVAL)]


def run(bundle: Any, trace: list[Request], budget: int | None) -> dict[str, Any]:
    """One run: each token's wall time per request, and the tokens."""
    sizes = [BATCH, 2 * BATCH]  # room for the long prompt beside the running eight
    runner = create_decode_runner(bundle, "cpu", capture_sizes=sizes, show_progress=False)
    runner.capture()
    times: dict[int, list[float]] = {r.rid: [] for r in trace}

    def on_token(rid: int, token: int) -> None:
        times[rid].append(time.perf_counter())

    # Chunks run as the engine runs them: one captured token batch a step.
    tokens = None
    if budget is not None:
        tokens = create_token_runner(bundle, "cpu", budget, capture_sizes=[budget])
        tokens.capture()
    engine = Engine(
        bundle, runner, on_token=on_token, max_num_batched_tokens=budget, token_runner=tokens
    )
    arrival = [0.0]
    step = engine.schedule.run

    def timed_step(run_: Any, plan: Any) -> Any:
        if run_.clock == ARRIVAL and not arrival[0]:
            arrival[0] = time.perf_counter()
        return step(run_, plan)

    engine.schedule.run = timed_step  # type: ignore[method-assign]
    start = time.perf_counter()
    result = engine.run(trace)
    wall = time.perf_counter() - start
    first_long = times[BATCH][0]
    gaps, stalled = [], []
    for rid in range(BATCH):
        stamps = times[rid]
        for a, b in zip(stamps, stamps[1:], strict=False):
            gaps.append(b - a)
            if arrival[0] < b <= first_long:  # a gap of the long prompt's prefill
                stalled.append(b - a)
    median = statistics.median(gaps)
    p99 = sorted(stalled)[max(0, int(0.99 * len(stalled)) - 1)] if stalled else 0.0
    return {
        "budget": budget,
        "median_itl_ms": median * 1e3,
        "p99_itl_during_prefill_ms": p99 * 1e3,
        "p99_over_median": p99 / median,
        "ttft_long_s": first_long - arrival[0],
        "prefill_chunks": result.stats.prefill_chunks,
        "wall_s": wall,
        "outputs": {str(k): v for k, v in result.outputs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "embedded"], default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    reference = None
    for budget in BUDGETS:
        bundle, prompts = _model(args.model)
        trace = _trace(prompts, bundle.config.vocab_size, args.new_tokens)
        row = run(bundle, trace, budget)
        reference = reference or row["outputs"]
        row["same_tokens_as_unchunked"] = row["outputs"] == reference
        rows.append(row)
        print(
            f"budget {budget}: median ITL {row['median_itl_ms']:.1f} ms, p99 during prefill "
            f"{row['p99_itl_during_prefill_ms']:.1f} ms ({row['p99_over_median']:.2f}x), "
            f"TTFT of the long prompt {row['ttft_long_s']:.2f} s"
        )
    _write(args.model, rows)


def _write(model: str, rows: list[dict[str, Any]]) -> None:
    info = {**machine(), "path": "cpu runner, float32, 1 thread", "command": CMD}
    name = f"chunked-prefill-stall-{model}-cpu"
    lines = [
        f"# Chunked prefill: the stall of a {LONG}-token prompt on {BATCH} running requests",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        f"{model}, {BATCH} requests decoding, a {LONG}-token prompt arriving at step {ARRIVAL}. "
        "ITL: wall time between a running request's successive tokens; p99 over the gaps "
        "that end during the long prompt's prefill; median over the whole run.",
        "",
        "| max_num_batched_tokens | median ITL ms | p99 ITL during prefill ms | p99 / median "
        "| long prompt TTFT s | prefill chunks | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget'] or 'none (whole prompt)'} | {r['median_itl_ms']:.1f} | "
            f"{r['p99_itl_during_prefill_ms']:.1f} | {r['p99_over_median']:.2f}x | "
            f"{r['ttft_long_s']:.2f} | {r['prefill_chunks']} | {r['same_tokens_as_unchunked']} |"
        )
    chunked = [r for r in rows if r["budget"]]
    best = min(chunked, key=lambda r: r["p99_over_median"])
    verdict = "met" if best["p99_over_median"] <= 3 else "NOT met"
    lines += [
        "",
        f"Goal p99 <= 3x median with chunking: **{verdict}** (best: budget {best['budget']}, "
        f"{best['p99_over_median']:.2f}x; unchunked {rows[0]['p99_over_median']:.2f}x).",
    ]
    write_atomically(RESULTS / f"{name}.md", "\n".join(lines) + "\n")
    slim = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    write_atomically(RESULTS / f"{name}.json", json.dumps({**info, "rows": slim}, indent=1))


if __name__ == "__main__":
    main()
