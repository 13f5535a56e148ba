"""Prefill through the captured token-batch step, SmolLM2-135M, CPU, one thread.

Three measurements, each ratio taken in the same run:

* **Time to first token** of one prompt of 128, 512 and 2,048 tokens: the
  token-batch step replayed by the CPU runner (its inductor program, sizes
  equal to the lengths, so no padding), today's eager prefill
  (``forward_extend``) and transformers' forward of the same checkpoint;
  the best of ``--repeats`` runs each. Goals (issue 50): >= 1.0x
  transformers at every length, >= 1.2x the eager prefill from 512 tokens.
* **Padded**: the same prompts one token short of the size (the step pads
  one token and requests to 8), against the unpadded replay.
* **Throughput**: the demo's trace (the embedded model, 32 tokens a step)
  and SmolLM2's 8 chat prompts (the default 2,048-token budget) served end
  to end (wall time of the run after capture, every token counted) with the
  prompt chunks through the token runner against each chunk eagerly, as
  before. Goal: no lower than before.
* **Capture**: cold (an empty inductor cache) capture of the decode sizes
  alone against the decode sizes plus the engine's token sizes for a
  2,048-token budget. Goal: at most 1.5x.

    PYTHONPATH=. .venv/bin/python -m bench.bench_token_batch [--skip-capture]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.bench_prefill import best_of
from bench.conftest import machine
from graphrunner import create_runner
from graphrunner.phases import token_batch_inputs, token_batch_phase
from graphrunner.util.atomic import write_atomically

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_token_batch"
RESULTS = Path(__file__).parent / "results"
LENGTHS = (128, 512, 2048)
REQUESTS = 8
DECODE_SIZES = [1, 2, 4, 8]
BUDGET = 2048


def _prompt_inputs(bundle: Any, row: int, slots: list[int], ids: torch.Tensor) -> Any:
    n = len(slots)
    bundle.req_pool.write(row, 0, slots)
    return token_batch_inputs(
        input_ids=ids, out_cache_loc=slots, req_pool_indices=[row], seq_lens=[n], extend_lens=[n]
    )


def ttft(bundle: Any, hf: Any, repeats: int) -> list[dict[str, Any]]:
    model = bundle.model
    phase = token_batch_phase(model.forward_token_batch, max_requests=REQUESTS)
    sizes = sorted({*LENGTHS, *(n - 1 for n in LENGTHS)})
    runner = create_runner(phase, kind="cpu", capture_sizes=list(LENGTHS), show_progress=False)
    runner.capture()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        ids = torch.randint(3, bundle.config.vocab_size, (n,), generator=gen)
        row = bundle.req_pool.alloc(1)[0]
        slots = bundle.kv_alloc.alloc(n)
        inputs = _prompt_inputs(bundle, row, slots, ids)
        loc = torch.tensor(slots)
        captured = best_of(lambda inputs=inputs: runner.replay(inputs), repeats)
        eager = best_of(
            lambda ids=ids, row=row, loc=loc: model.forward_extend(row, ids, loc), repeats
        )
        with torch.no_grad():
            theirs = best_of(lambda ids=ids: hf(ids[None]).logits[0, -1], repeats)
        got = runner.replay(inputs)[0]
        want = model.forward_extend(row, ids, loc)
        agree = bool(got.argmax() == want.argmax())
        bundle.kv_alloc.free(slots)
        bundle.req_pool.free([row])
        rows.append(
            {"tokens": n, "padded_to": runner.graph_size_for(n), "captured_s": captured,
             "eager_s": eager, "transformers_s": theirs, "same_argmax": agree}
        )  # fmt: skip
        print(
            f"{n} tokens (size {runner.graph_size_for(n)}): captured {captured:.3f} s, "
            f"eager {eager:.3f} s ({eager / captured:.2f}x), transformers {theirs:.3f} s "
            f"({theirs / captured:.2f}x)",
            flush=True,
        )
    return rows


def _served(config: Any, bundle: Any, trace: Any) -> tuple[float, int]:
    """Wall seconds of one served run after its captures, and its tokens."""
    from graphrunner_ref.engine import serving

    start = [0.0]

    def on_capture(runner: Any, report: Any) -> None:
        start[0] = time.perf_counter()  # the last capture ends here

    outcome = serving.serve(config, bundle, trace, on_capture=on_capture)
    seconds = time.perf_counter() - start[0]
    tokens = sum(len(t) for t in outcome.result.outputs.values())
    return seconds, tokens


def throughput() -> list[dict[str, Any]]:
    import dataclasses

    from bench.bench_context import smollm2_chats
    from graphrunner_ref.engine import serving
    from graphrunner_ref.engine.config import EngineConfig
    from graphrunner_ref.engine.workload import Request, synthetic_trace

    checkpoint, chats = smollm2_chats()
    demo = EngineConfig(runner="cpu", capture_sizes=(1, 2, 4, 8, 12, 16), max_num_batched_tokens=32)
    real = EngineConfig(model=None, checkpoint=checkpoint, runner="cpu", capture_sizes=(1, 2, 4, 8))
    cases = []
    bundle = serving.build(demo, 16, 128)
    demo_trace = synthetic_trace(
        num_requests=300, vocab_size=bundle.config.vocab_size, max_context_len=128,
        seed=0, prompt_len=(4, 48), new_tokens=(8, 64), mean_gap=4.0,
    )  # fmt: skip
    cases.append(("demo trace (embedded model, 32 tokens a step)", demo, bundle, demo_trace))
    real_bundle = serving.build(real, 8, 512)
    chat_trace = [Request(i, tuple(p), 64) for i, p in enumerate(chats)]
    cases.append(("SmolLM2, 8 chat prompts at once", real, real_bundle, chat_trace))
    rows = []
    for name, config, b, trace in cases:
        timed = {}
        for tokens in (False, True):
            seconds, count = _served(dataclasses.replace(config, token_batches=tokens), b, trace)
            timed[tokens] = count / seconds
        rows.append(
            {"case": name, "eager_chunks_tps": timed[False], "token_runner_tps": timed[True]}
        )
        print(
            f"{name}: token runner {timed[True]:.1f} tok/s, eager chunks {timed[False]:.1f} "
            f"tok/s ({timed[True] / timed[False]:.2f}x)",
            flush=True,
        )
    return rows


def capture_cost(checkpoint: Path) -> dict[str, float]:
    """Cold captures in a child process each (an empty inductor cache)."""
    import subprocess
    import sys

    out = {}
    for what in ("decode", "decode+tokens"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": "."}
            code = (
                "import sys, time, torch; torch.set_num_threads(1);"
                "from bench.bench_token_batch import _capture_child;"
                f"print(_capture_child({str(checkpoint)!r}, {what!r}))"
            )
            done = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            out[what] = float(done.stdout.strip().splitlines()[-1])
            print(f"cold capture, {what}: {out[what]:.1f} s", flush=True)
    return out


def _capture_child(checkpoint: str, what: str) -> float:
    from graphrunner_ref.engine.bundle import create_token_runner
    from graphrunner_ref.engine.loop import create_decode_runner
    from graphrunner_ref.io import load_model

    bundle = load_model(Path(checkpoint), max_requests=REQUESTS, max_context_len=BUDGET + 64)
    start = time.perf_counter()
    create_decode_runner(bundle, "cpu", capture_sizes=DECODE_SIZES).capture()
    if what == "decode+tokens":
        create_token_runner(bundle, "cpu", BUDGET).capture()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-capture", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from bench.bench_context import smollm2_chats
    from graphrunner_ref.io import load_model

    checkpoint, _ = smollm2_chats()
    bundle = load_model(checkpoint, max_requests=REQUESTS, max_context_len=max(LENGTHS))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rows = ttft(bundle, hf, args.repeats)
    served = [] if args.skip_throughput else throughput()
    capture = {} if args.skip_capture else capture_cost(checkpoint)
    _write(rows, served, capture)


def _write(
    rows: list[dict[str, Any]], served: list[dict[str, Any]], capture: dict[str, float]
) -> None:
    info = {
        **machine(),
        "path": "CPU runner (inductor program, symbolic token axis), float32, 1 thread",
        "command": CMD,
    }
    lines = [
        "# Prefill through the captured token-batch step, SmolLM2-135M",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "| prompt tokens | padded to | captured s | eager s | captured / eager "
        "| transformers s | captured / transformers | same argmax |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['padded_to']} | {r['captured_s']:.3f} | {r['eager_s']:.3f} | "
            f"{r['eager_s'] / r['captured_s']:.2f}x | {r['transformers_s']:.3f} | "
            f"{r['transformers_s'] / r['captured_s']:.2f}x | {r['same_argmax']} |"
        )
    if served:
        lines += [
            "",
            "| served | token runner tok/s | eager chunks tok/s | ratio |",
            "|---|---|---|---|",
        ]
        for r in served:
            lines.append(
                f"| {r['case']} | {r['token_runner_tps']:.1f} | {r['eager_chunks_tps']:.1f} | "
                f"{r['token_runner_tps'] / r['eager_chunks_tps']:.2f}x |"
            )
    if capture:
        both, alone = capture["decode+tokens"], capture["decode"]
        lines += [
            "",
            f"Cold capture: decode sizes {DECODE_SIZES} {alone:.1f} s; plus the token sizes "
            f"for a {BUDGET}-token budget {both:.1f} s ({both / alone:.2f}x).",
        ]
    write_atomically(RESULTS / "token-batch-smollm2-cpu.md", "\n".join(lines) + "\n")
    payload = {**info, "rows": rows, "served": served, "capture_s": capture}
    write_atomically(RESULTS / "token-batch-smollm2-cpu.json", json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
