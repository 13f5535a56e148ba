"""Decode step time, TP = 1 vs TP = 2 on the CPU (gloo), measured in the same run,
and the collectives' share of a TP = 2 step.

Each variant runs in its own spawned processes with one torch thread per rank
(TP = 2 uses both of a 2-core machine's cores, TP = 1 one of them): the CPU
runner (one inductor program per size) replays one prepared decode batch.
The collectives' share is estimated in the same ranks: the step's collectives
(an all-reduce of ``[bs, hidden]`` per embedding and per attention and MLP
block, an all-gather of the ``[bs, vocab / 2]`` logits) timed alone, eager,
against the step's median.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.tp_cpu`` (writes
``bench/results/tp-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from bench.conftest import RESULTS_DIR, machine
from graphrunner import GraphRunner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner_ref.engine.launch import join_group, run_ranks
from graphrunner_ref.engine.loop import create_decode_runner
from graphrunner_ref.model import ModelBundle, ModelConfig, default_model
from graphrunner_ref.model.parallel import SINGLE, TensorParallel

SIZES = [1, 8]
ROUNDS = 200
#: The embedded default model (hidden 64: the collectives dominate), and a
#: wider one whose matmuls are worth splitting.
MODELS: dict[str, ModelConfig | None] = {
    "default (hidden 64)": None,
    "wide (hidden 1024)": ModelConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=4,
        num_heads=16,
        num_kv_heads=4,
        max_position_embeddings=256,
    ),
}


def _median_us(fn: Callable[[], object], tp: TensorParallel) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(ROUNDS):
        if tp.world > 1:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _batch(bundle: ModelBundle, bs: int) -> DecodeBatch:
    gen = torch.Generator().manual_seed(bs)
    reqs, lens = [], [24 + 7 * i for i in range(bs)]
    for n in lens:
        req = bundle.req_pool.alloc(1)[0]
        prompt = torch.randint(256, (n,), generator=gen)
        bundle.model.forward_extend(req, prompt, torch.tensor(bundle.kv_alloc.alloc(n)))
        reqs.append(req)
    batch = DecodeBatch.from_requests(
        reqs, lens, torch.ones(bs, dtype=torch.int64), device="cpu", max_context_len=256
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return batch


def _sizes(bundle: ModelBundle, runner: GraphRunner, bs: int, tp: TensorParallel) -> list[float]:
    """``[step µs, collectives µs]`` of a batch of ``bs`` rows."""
    bundle.req_pool.clear()
    bundle.kv_alloc.clear()
    batch = _batch(bundle, bs)
    step = _median_us(lambda: runner.replay(batch), tp)
    if tp.world == 1:
        return [step, 0.0]
    cfg = bundle.config
    hidden = torch.randn(bs, cfg.hidden_size)
    logits = torch.randn(bs, cfg.vocab_size // tp.world)

    def collectives() -> None:
        for _ in range(2 * cfg.num_layers + 1):
            tp.all_reduce(hidden)
        tp.all_gather(logits)

    return [step, _median_us(collectives, tp)]


def _measure(tp: TensorParallel) -> dict[str, dict[int, list[float]]]:
    """Per model, per size: ``[step µs, collectives µs]``."""
    found: dict[str, dict[int, list[float]]] = {}
    for name, config in MODELS.items():
        bundle = default_model(max_requests=max(SIZES), max_context_len=256, tp=tp, config=config)
        runner = create_decode_runner(bundle, "cpu", capture_sizes=SIZES)
        runner.capture()
        found[name] = {bs: _sizes(bundle, runner, bs, tp) for bs in SIZES}
    return found


def _rank(rank: int, world: int, store: Path, out: Path) -> None:
    if world == 1:
        torch.set_num_threads(1)
        out.write_text(json.dumps(_measure(SINGLE)))
        return
    join_group(rank, world, store)
    try:
        found = _measure(TensorParallel(rank, world))
        if rank == 0:
            out.write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def main() -> None:
    results: dict[int, dict[str, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            out = Path(tmp) / f"tp{world}.json"
            run_ranks(_rank, world, world, Path(tmp) / f"store{world}", out, timeout_s=1200.0)
            results[world] = json.loads(out.read_text())
    info = machine()
    lines = ["# decode step, TP = 1 vs TP = 2 (cpu, gloo)", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        "- one torch thread per rank; CPU runner (inductor), one prepared batch replayed",
        f"- median of {ROUNDS} steps; collectives: the step's all-reduces and "
        "all-gather timed alone (eager)",
        "- gloo over localhost: each collective is a round trip between processes "
        "through the kernel; on a 2-core machine (shared with other jobs) it "
        "dominates a small model's step. TP on the CPU tests the sharded path; it "
        "is not a speed-up here",
        "",
        "| model | bs | TP = 1 (µs) | TP = 2 (µs) | TP = 2 vs TP = 1 | collectives (µs) | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in MODELS:
        for bs in SIZES:
            one = results[1][name][str(bs)][0]
            two, coll = results[2][name][str(bs)]
            lines.append(
                f"| {name} | {bs} | {one:.1f} | {two:.1f} | {one / two:.2f}x | "
                f"{coll:.1f} | {coll / two:.0%} |"
            )
    text = "\n".join(lines) + "\n"
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "tp-cpu.md").write_text(text)
    (RESULTS_DIR / "tp-cpu.json").write_text(json.dumps({"machine": info, **results}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
