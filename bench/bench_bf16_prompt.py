"""int4 x bfloat16 over a prompt chunk: the chunk path against tiles of 8 rows.

``graphrunner_int4::linear_bf16`` (int4-q8's q/k/v projection where the CPU
has AVX-512 BF16, and ``--quantize int4-bf16``'s every projection) takes a
chunk of more than 8 rows down its chunk path: each output's bfloat16
weights made once for every 96 rows and, with the rows, widened to float32,
the same sums run as FMAs 4 rows by 4 outputs a pass. At 8 rows or fewer
it takes the tile path, which makes a weight's table again for every tile
of 8 rows and sums with ``vdpbf16ps``. Both give the same bits (checked here, and in
``tests/test_int4_bf16.py``); this bench times one call over all ``rows``
against the same rows fed 8 at a time, at SmolLM2-135M's shapes, one
thread, interleaved rounds, medians, and prints the ratio.

``PYTHONPATH=. .venv/bin/python -m bench.bench_bf16_prompt`` writes
``bench/results/bf16-prompt-<cpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from bench.bench_gemm_peak import cpu_slug
from bench.conftest import RESULTS_DIR, command, machine, write_results
from graphrunner_ref.model.cpu_features import cpu_features, kernel_note, kernel_path
from graphrunner_ref.model.int4_bf16 import Int4Bf16Linear

#: SmolLM2-135M's projections (out, in): q/k/v stacked, output, gate/up, down.
SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536)}
#: A tile's rows: at this many or fewer the op takes its tile path.
TILE_ROWS = 8


def _median_ms(fn: Callable[[], object], rounds: list[float]) -> None:
    start = time.perf_counter()
    fn()
    rounds.append((time.perf_counter() - start) * 1e3)


def measure(out: int, inp: int, rows: int, rounds: int) -> dict[str, float]:
    """Median ms of one call over ``rows`` rows and of the rows 8 at a time,
    after checking the two give the same bits."""
    gen = torch.Generator().manual_seed(out * 7 + inp)
    linear = Int4Bf16Linear(torch.randn(out, inp, generator=gen) * 0.05, kernel=True)
    x = torch.randn(rows, inp, generator=gen)

    def chunk() -> torch.Tensor:
        return linear(x)

    def tiles() -> torch.Tensor:
        return torch.cat([linear(x[r : r + TILE_ROWS]) for r in range(0, rows, TILE_ROWS)])

    if not torch.equal(chunk(), tiles()):
        raise AssertionError(f"the chunk and tile paths differ at {out} x {inp}, {rows} rows")
    times: dict[str, list[float]] = {"chunk": [], "tiles": []}
    for _ in range(rounds):
        _median_ms(chunk, times["chunk"])
        _median_ms(tiles, times["tiles"])
    return {name: statistics.median(ms) for name, ms in times.items()}


def report(rows_out: list[dict[str, object]], argv: Sequence[str] | None) -> str:
    facts = machine()
    lines = ["# int4 x bfloat16 over a prompt chunk: the chunk path against tiles of 8", ""]
    lines += [f"- {key}: {value}" for key, value in facts.items()]
    lines += [f"- features: {cpu_features().describe()}",
              f"- path: {kernel_note('int4-bf16')}",
              f"- command: `{command('bench_bf16_prompt', argv)}`",
              "- one thread; medians of interleaved rounds; outputs equal bit for bit", "",
              "| shape | out x in | rows | tiles of 8 ms | chunk path ms | chunk GFLOP/s "
              "| tiles / chunk |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows_out:
        lines.append(
            f"| {row['shape']} | {row['out']} x {row['in']} | {row['rows']} "
            f"| {row['tiles_ms']:.3f} | {row['chunk_ms']:.3f} | {row['chunk_gflops']:.1f} "
            f"| **{row['ratio']:.2f}x** |"
        )
    lines += ["", "Tiles of 8: the op called once for each 8 rows (then one `torch.cat`), "
              "each call taking the tile path; the calls' own cost rides in that column."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 512],
                        help="chunk sizes (more than 8 rows: the chunk path)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per case")
    parser.add_argument("--out", default=None, help="results name (default bf16-prompt-<cpu>)")
    args = parser.parse_args(argv)
    if any(rows <= TILE_ROWS for rows in args.rows):
        parser.error(f"--rows {args.rows}: expected chunks of more than {TILE_ROWS} rows")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if kernel_path("int4-bf16") is None:
        print(f"no int4-bf16 kernel here: {kernel_note('int4-bf16')}")
        return 1
    torch.set_num_threads(1)
    results: list[dict[str, object]] = []
    for shape, (out, inp) in SHAPES.items():
        for rows in args.rows:
            ms = measure(out, inp, rows, args.rounds)
            ratio = ms["tiles"] / ms["chunk"]
            gflops = 2 * rows * out * inp / ms["chunk"] / 1e6
            print(f"{shape} {rows} rows: tiles {ms['tiles']:.3f} ms, chunk {ms['chunk']:.3f} ms"
                  f" ({gflops:.1f} GFLOP/s): {ratio:.2f}x", flush=True)  # fmt: skip
            results.append({"shape": shape, "out": out, "in": inp, "rows": rows,
                            "tiles_ms": ms["tiles"], "chunk_ms": ms["chunk"],
                            "chunk_gflops": gflops, "ratio": ratio})  # fmt: skip
    name = args.out or f"bf16-prompt-{cpu_slug(cpu_features())}"
    write_results(RESULTS_DIR, name, report(results, argv), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
