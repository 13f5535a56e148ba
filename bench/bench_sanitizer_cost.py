"""What each sanitizer check costs: one padded decode step of the embedded
model on the CPU runner (6 live requests in the graph of 8), replayed plain,
under the sanitizer with its write and value checks only
(``check_reads=False``), and with the read check too (the default: a second
launch with the sinks, the unowned rows and the padded inputs changed), in
one run; the captured-state identity check runs in both sanitized variants.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_sanitizer_cost`` (writes
``bench/results/sanitizer-cost-cpu.md``).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from bench.bench_gpu_model import filled_batch
from bench.conftest import RESULTS_DIR, machine
from graphrunner import PaddingSanitizer
from graphrunner_ref import create_decode_runner
from graphrunner_ref.model import default_model

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_sanitizer_cost"
LIVE, GRAPH, CONTEXT, REPEATS = 6, 8, 64, 50


def _median_us(step: object, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    torch.set_num_threads(1)
    bundle = default_model(max_requests=GRAPH, max_context_len=256)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[GRAPH])
    runner.capture()
    sanitizer = PaddingSanitizer.for_pools(
        bundle.req_pool,
        bundle.kv_cache,
        kv_allocator=bundle.kv_alloc,
        vocab_size=bundle.config.vocab_size,
    )
    variants = {
        "plain replay": None,
        "sanitizer, writes and values": False,
        "sanitizer, + read isolation": True,
    }
    rows = []
    for name, reads in variants.items():
        batch = filled_batch(bundle, LIVE, CONTEXT)
        if reads is None:
            runner.sanitizer = None
        else:
            sanitizer.check_reads = reads
            runner.sanitizer = sanitizer
        rows.append((name, _median_us(functools.partial(runner.replay, batch))))
    base = rows[0][1]
    lines = [
        "# What each sanitizer check costs (CPU runner, embedded model)",
        "",
        f"Machine: {machine()}; one torch thread. Command: `{CMD}`.",
        f"{LIVE} live requests of {CONTEXT} cached tokens in the graph of {GRAPH}; "
        f"median of {REPEATS} replays.",
        "",
        "| replay | µs | vs plain |",
        "|---|---|---|",
        *(f"| {name} | {us:,.0f} | {us / base:.1f}x |" for name, us in rows),
        "",
    ]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "sanitizer-cost-cpu.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
