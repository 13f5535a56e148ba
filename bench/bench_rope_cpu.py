"""What the rotary embedding and the KV write cost a CPU decode step, to
decide whether a fused CPU kernel for them would pay (issue 53, item 5).

SmolLM2-135M's shapes (30 layers, 9 query and 3 KV heads of 64, rope theta
100000): two functions compiled by inductor, one thread, each doing 30
layers' worth of work on a stand-in projection output, one with the rotation
of q and k and the write of k and v into per-layer caches
(:class:`~graphrunner_ref.model.layers.RotaryEmbedding`, ``cache[loc] = k``),
one without; the difference is their cost. Medians of 21 rounds of 100
calls, the two interleaved.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_rope_cpu`` (writes
``bench/results/rope-kv-cpu.md``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench.conftest import RESULTS_DIR
from graphrunner_ref.model.cpu_features import cpu_features
from graphrunner_ref.model.layers import RotaryEmbedding

HEADS, KV_HEADS, DIM, LAYERS, SLOTS = 9, 3, 64, 30, 4096
CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_rope_cpu"


def programs() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    rotary = RotaryEmbedding(DIM, 8192, 100000.0)
    k_caches = [torch.zeros(SLOTS, KV_HEADS, DIM) for _ in range(LAYERS)]
    v_caches = [torch.zeros(SLOTS, KV_HEADS, DIM) for _ in range(LAYERS)]
    width = HEADS * DIM

    def with_rope(x: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        n, out = x.shape[0], x[:, :width]
        for i in range(LAYERS):
            q, k, v = (x * (1.0 + i)).split([width, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
            q, k = rotary(pos, q.view(n, HEADS, DIM), k.view(n, KV_HEADS, DIM))
            k_caches[i][loc] = k
            v_caches[i][loc] = v.view(n, KV_HEADS, DIM)
            out = out + q.reshape(n, width)
        return out

    def without(x: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        out = x[:, :width]
        for i in range(LAYERS):
            out = out + (x * (1.0 + i))[:, :width]
        return out

    return {
        name: torch.compile(fn, fullgraph=True, dynamic=False)
        for name, fn in (("rotary + KV write", with_rope), ("neither", without))
    }


def measure(rows: int) -> dict[str, float]:
    """Median µs per call of each program at ``rows`` rows."""
    x = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM)
    pos, loc = torch.arange(rows) + 37, torch.arange(rows) + 5
    fns = programs()
    for fn in fns.values():
        for _ in range(10):
            fn(x, pos, loc)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(21):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(100):
                fn(x, pos, loc)
            times[name].append((time.perf_counter() - start) / 100 * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    lines = [
        "# Rotary embedding + KV write of a SmolLM2 decode step on the CPU",
        "",
        f"`{CMD}`: 30 layers' rotation of q/k and write of k/v, compiled by inductor, "
        "against the same program without them; median µs per call of 21 interleaved "
        "rounds, one thread.",
        "",
        f"- CPU: {cpu_features().describe()}",
        f"- torch: {torch.__version__}",
        "",
        "| rows | rotary + KV write (µs) | neither (µs) | their cost a step (µs) |",
        "|---|---|---|---|",
    ]
    for rows in (1, 8):
        t = measure(rows)
        cost = t["rotary + KV write"] - t["neither"]
        lines.append(f"| {rows} | {t['rotary + KV write']:.0f} | {t['neither']:.0f} | {cost:.0f} |")
        print(lines[-1])
    out = RESULTS_DIR / "rope-kv-cpu.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
