"""The 8-bit KV cache (``--kv-dtype int8``) against the float16 one at long
contexts on the CPU, in one run, one torch thread.

Two measurements, each cache's timings interleaved round by round (the order
rotated a round), medians, and the median of the per-round ratios (float16's
time over int8's: above 1, int8 is faster):

* ``step``: decode steps of a SmolLM2-135M-shaped Llama (random float32
  weights, 30 layers, 3 KV heads of 64) at batch 8, every row holding
  ``--contexts`` tokens (their KV drawn at random and written through the
  cache's ``set_kv``: no prefill), the model's eager ``forward_decode`` (the
  C++ rotary + KV write and decode attention a layer), ``--steps`` a round;
* ``attention``: the decode attention op alone at the same shape, a call a
  layer, each layer over its own KV (each row's slots in order, or scattered
  over the pool), and the KV bytes it reads a second beside a one-thread
  read of a 512 MB tensor (``torch.sum``), this CPU's stream.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_kv_int8 [--contexts 1024,4096]
[--rounds 5] [--steps 4] [--out NAME]`` (writes ``bench/results/NAME.md``
and ``.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.bench_real_cpu import cpu_flags, decode_path_note, round_order, save_results
from bench.conftest import command, machine
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.pools import Int8KVCache
from graphrunner.testing import torch_threads
from graphrunner_ref.model import ModelBundle, ModelConfig, default_model
from graphrunner_ref.model.attention_cpu import (
    cpp_attention_status,
    cpp_decode_attention,
    cpp_decode_attention_q8,
)

BATCH = 8
CACHES = {"float16": torch.float16, "int8": torch.int8}


def smollm2_shape(layers: int, context: int) -> ModelConfig:
    """SmolLM2-135M's shape (``layers`` of its 30) with room for ``context``."""
    return ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=layers,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=context,
    )


def filled(config: ModelConfig, kv_dtype: torch.dtype, context: int, room: int) -> ModelBundle:
    """The model over pools for BATCH rows of ``room`` tokens, each row's
    first ``context`` slots written with random K/V (the same draws whatever
    the cache's dtype)."""
    bundle = default_model(
        max_requests=BATCH, max_context_len=room, config=config, kv_dtype=kv_dtype
    )
    gen = torch.Generator().manual_seed(0)
    shape = (BATCH * context, config.num_kv_heads, config.head_dim)
    loc = []
    for _ in range(BATCH):
        req = bundle.req_pool.alloc(1)[0]
        slots = bundle.kv_alloc.alloc(context)
        bundle.req_pool.req_to_token[req, :context] = torch.tensor(slots, dtype=torch.int32)
        loc += slots
    where = torch.tensor(loc)
    for layer in range(config.num_layers):
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        bundle.kv_cache.set_kv(layer, where, k, v)
    return bundle


def step_seconds(bundle: ModelBundle, context: int, steps: int) -> Callable[[], float]:
    """A round: the next ``steps`` decode steps of the BATCH rows (from
    ``context`` tokens; each round goes on where the last one stopped),
    seconds a step."""
    batch = DecodeBatch.from_requests(
        list(range(1, BATCH + 1)), [context] * BATCH, torch.arange(BATCH), device="cpu",
        max_context_len=bundle.max_context_len,
    )  # fmt: skip
    tokens = torch.arange(BATCH)

    def run() -> float:
        nonlocal tokens
        begin = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                batch.prepare_decode(bundle.req_pool, bundle.kv_alloc, tokens)
                tokens = bundle.model.forward_decode(batch).argmax(-1)  # type: ignore[arg-type]
        return (time.perf_counter() - begin) / steps

    return run


#: How each row's slots lie in the pool: in order (a prompt prefilled into
#: fresh slots), or scattered at random (a pool long in use).
LAYOUTS = ("contiguous", "scattered")


def attention_operands(
    kv_dtype: torch.dtype, context: int, layers: int, layout: str
) -> tuple[Callable[[], object], int]:
    """A step's decode attentions, one a layer over its own KV, BATCH rows of
    ``context`` slots laid out as ``layout`` (SmolLM2's 3 KV heads, 3 queries
    each, 64): the layers' caches together outgrow the CPU's caches, as a
    model's do. Returns the call and the KV bytes it reads (values and int8's
    scales)."""
    gen = torch.Generator().manual_seed(0)
    slots = BATCH * context + 1
    q = torch.randn(BATCH, 3, 3, 64, generator=gen)
    table = torch.zeros(BATCH + 1, context, dtype=torch.int32)
    order = torch.arange(BATCH * context)
    if layout == "scattered":
        order = torch.randperm(BATCH * context, generator=gen)
    table[1:] = (order + 1).view(BATCH, context)
    rows = (table, torch.arange(1, BATCH + 1), torch.full((BATCH,), context), 0.125)
    caches = []
    for _ in range(layers):
        k, v = torch.randn(slots, 3, 64, generator=gen), torch.randn(slots, 3, 64, generator=gen)
        if kv_dtype == torch.int8:
            (kq, ks), (vq, vs) = Int8KVCache.quantize(k), Int8KVCache.quantize(v)
            caches.append((kq, vq, ks, vs))
        else:
            caches.append((k.to(kv_dtype), v.to(kv_dtype)))
    live = BATCH * context * 3 * layers
    if kv_dtype == torch.int8:
        return (lambda: [cpp_decode_attention_q8(q, *c, *rows) for c in caches]), live * 2 * 68
    return (lambda: [cpp_decode_attention(q, *c, *rows) for c in caches]), live * 2 * 64 * 2


def stream_gbs() -> float:
    """GB/s of one thread summing a 512 MB float32 tensor (the best of 5)."""
    x = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - begin)
    return x.numel() * 4 / best / 1e9


def interleaved(rounds: int, fns: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each function's value in each round, the order rotated a round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in round_order(list(fns), r):
            times[name].append(fns[name]())
    return times


def summary(times: dict[str, list[float]]) -> dict[str, Any]:
    ratios = [a / b for a, b in zip(times["float16"], times["int8"], strict=True)]
    return {
        **{f"{n}_ms": statistics.median(t) * 1e3 for n, t in times.items()},
        "ratio": statistics.median(ratios),
        "rounds": times,
    }


def timed(fn: Callable[[], object], calls: int) -> Callable[[], float]:
    def run() -> float:
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - begin) / calls

    return run


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,4096", help="tokens a row (1024,4096)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    p.add_argument("--steps", type=int, default=4, help="decode steps a round (4)")
    p.add_argument("--layers", type=int, default=30, help="of SmolLM2's 30 (30)")
    p.add_argument("--out", default="kv-int8-cpu", help="results name under bench/results/")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if min(contexts) < 1 or args.rounds < 1 or args.steps < 1 or args.layers < 1:
        p.error("--contexts, --rounds, --steps and --layers: expected whole numbers >= 1")
    why = cpp_attention_status()
    if why is not None:
        print(f"the C++ attention cannot run here: {why}")
        return 0
    rows = []
    load = os.getloadavg()[0]
    with torch_threads(1):
        stream = stream_gbs()
        print(f"stream: {stream:.1f} GB/s (one thread)", flush=True)
        for context in contexts:
            row: dict[str, Any] = {"context": context}
            for layout in LAYOUTS:
                ops = {
                    n: attention_operands(d, context, args.layers, layout)
                    for n, d in CACHES.items()
                }
                calls = {n: timed(f, max(1, 8192 // context)) for n, (f, _) in ops.items()}
                attn = summary(interleaved(args.rounds * 2, calls))
                for n, (_, nbytes) in ops.items():
                    attn[f"{n}_gbs"] = nbytes / (attn[f"{n}_ms"] / 1e3) / 1e9
                row[layout] = attn
                del ops, calls
                print(
                    f"context {context}, attention, {layout}: float16 {attn['float16_ms']:.1f} ms "
                    f"({attn['float16_gbs']:.1f} GB/s), int8 {attn['int8_ms']:.1f} ms "
                    f"({attn['int8_gbs']:.1f} GB/s), {attn['ratio']:.2f}x",
                    flush=True,
                )
            room = context + args.rounds * args.steps
            config = smollm2_shape(args.layers, room)
            bundles = {n: filled(config, d, context, room) for n, d in CACHES.items()}
            steps = {n: step_seconds(b, context, args.steps) for n, b in bundles.items()}
            row["step"] = step = summary(interleaved(args.rounds, steps))
            del bundles, steps
            rows.append(row)
            print(
                f"context {context}, step: float16 {step['float16_ms']:.1f} ms, int8 "
                f"{step['int8_ms']:.1f} ms, {step['ratio']:.2f}x",
                flush=True,
            )
    result = {
        "command": command("bench_kv_int8", argv),
        "machine": {**machine(), "cpu flags": cpu_flags(), "load average at start": f"{load:.2f}"},
        "kernel path": decode_path_note(),
        "stream_gbs": stream,
        "layers": args.layers,
        "steps": args.steps,
        "rows": rows,
    }
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    """The results file: the run's facts, then per context each cache's
    median step and attention times, the ratios and the attention's GB/s."""
    lines = [
        "# The int8 KV cache against the float16 one, batch 8, one thread",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- attention kernel path: {result['kernel path']} (decode and decode_q8 alike)",
        f"- one-thread stream (sum of 512 MB): {result['stream_gbs']:.1f} GB/s",
        f"- step: SmolLM2-135M's shape, {result['layers']} layers, random float32 weights, "
        f"eager `forward_decode`, {result['steps']} steps a round; attention: the C++ op "
        "alone, a call a layer over that layer's KV; medians of interleaved rounds; ratio: the median of the "
        "per-round float16 / int8 times",
        "",
        "| context | step float16 ms | step int8 ms | step float16 / int8 | KV slots | "
        "attention float16 ms (KV GB/s) | attention int8 ms (KV GB/s) | attention "
        "float16 / int8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        s = r["step"]
        for i, layout in enumerate(LAYOUTS):
            a = r[layout]
            step = (
                f"{s['float16_ms']:.1f} | {s['int8_ms']:.1f} | **{s['ratio']:.2f}x**"
                if i == 0
                else " | | "
            )
            lines.append(
                f"| {r['context'] if i == 0 else ''} | {step} | {layout} | "
                f"{a['float16_ms']:.2f} ({a['float16_gbs']:.1f}) | "
                f"{a['int8_ms']:.2f} ({a['int8_gbs']:.1f}) | **{a['ratio']:.2f}x** |"
            )
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
