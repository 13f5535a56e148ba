"""Several decode steps per launch: engine tokens/s and host time per token at
N = 1, 2, 4, 8 (``Engine(steps_per_launch=N)``), against N = 1 in the same run.

For each batch size, ``bs`` greedy requests (a 4-token prompt, ``--new``
tokens each) arrive together and run to their budget through the engine;
every N runs the same trace (its tokens are checked equal to N = 1's). The
N values are timed round-robin (one run each per round), so drift on a shared
machine hits them alike; medians over the rounds.

- tokens/s: decode tokens / the run's wall time (its prefills included: the
  same bs short prompts for every N);
- launch ms/token: seconds inside ``runner.replay`` per decode token (on the
  CPU the whole step: populate, the compiled program, the read of outputs);
- host µs/token: the rest of the run per decode token: the engine's host
  work outside the launch (scheduling, reservation, read back, retire) and
  the prefills;
- launches and syncs per token from the engine's stats.

``--overlap`` adds, for every N, the same engine with overlap scheduling
(``Engine(overlap=True, steps_per_launch=N)``: launch i+1 prepared while
launch i runs, one read back per launch), timed in the same rounds and
compared with plain N = 1. On the CPU the program runs on the host thread
itself, so overlap has nothing to hide there; its rows show its cost.

On the CPU: the compiled CPU runner (inductor), one torch thread, the
embedded default model. On a GPU: the CUDA runner, by default over the 1.1B
shape in bfloat16 at batch 1 (``--shape``, ``--sizes``), its graphs over the
eager forward with the Triton attention (``--compile`` puts inductor's
program inside them: minutes of compilation for N = 8's unrolled steps).
Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_multistep`` (writes
``bench/results/multistep-cpu.md`` and ``.json``; on a CUDA machine
``multistep-<device>.md``). Not collected as a test or a pytest benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.conftest import RESULTS_DIR, machine
from graphrunner import FutureMap
from graphrunner.testing import torch_threads
from graphrunner_ref import Engine, Request, create_decode_runner, default_model
from graphrunner_ref.engine.results import EngineResult
from graphrunner_ref.model import shape_1b_config

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_multistep"
STEPS = (1, 2, 4, 8)


def trace(bs: int, new: int) -> list[Request]:
    return [Request(i, (3 + i, 5 + i, 7 + i, 11 + i), new) for i in range(bs)]


#: ``--shape`` -> (model config (None: the embedded default), dtype).
SHAPES: dict[str, tuple[Any, torch.dtype]] = {
    "default": (None, torch.float32),
    "1.1b": (shape_1b_config(), torch.bfloat16),
}


#: ``--shape`` as the results file names it.
MODELS = {"default": "the embedded default", "1.1b": "the 1.1B shape, random weights, bfloat16"}


def _engine(
    bs: int,
    n: int,
    overlap: bool,
    *,
    new: int,
    kind: str,
    device: str,
    shape: str = "default",
    options: dict[str, Any] | None = None,
) -> Engine:
    config, dtype = SHAPES[shape]
    bundle = default_model(
        max_requests=bs, max_context_len=new + 8, device=device, config=config, dtype=dtype
    )
    futures = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device) if overlap else None
    runner = create_decode_runner(
        bundle, kind, capture_sizes=[bs], steps_per_launch=n, future_map=futures, **(options or {})
    )
    runner.capture()
    return Engine(bundle, runner, steps_per_launch=n, overlap=overlap)


def measure(
    bs: int,
    steps: Sequence[int],
    *,
    new: int,
    rounds: int,
    kind: str,
    device: str,
    overlap: bool = False,
    shape: str = "default",
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Median tokens/s and host time per token of every N (and with
    ``overlap``, every N overlapped) at batch size ``bs``."""
    keys = [(n, False) for n in steps] + ([(n, True) for n in steps] if overlap else [])
    t0 = time.perf_counter()
    engines = {
        k: _engine(bs, *k, new=new, kind=kind, device=device, shape=shape, options=options)
        for k in keys
    }
    print(f"bs {bs}: built and captured in {time.perf_counter() - t0:.1f} s", flush=True)
    requests = trace(bs, new)
    runs: dict[tuple[int, bool], list[tuple[float, EngineResult]]] = {k: [] for k in keys}
    for k, engine in engines.items():  # warm-up, and the tokens every N must emit
        runs[k].append((0.0, engine.run(requests)))
    reference = runs[keys[0]][0][1].outputs
    for _ in range(rounds):
        for k, engine in engines.items():
            start = time.perf_counter()
            result = engine.run(requests)
            runs[k].append((time.perf_counter() - start, result))
    rows, base = [], 0.0
    for n, overlapped in keys:
        timed = runs[(n, overlapped)][1:]
        wall = statistics.median(w for w, _ in timed)
        launch = statistics.median(r.stats.decode_seconds for _, r in timed)
        stats = timed[0][1].stats
        tokens = stats.decode_tokens
        tps = tokens / wall
        base = base or tps
        row = {
            "bs": bs,
            "steps_per_launch": n,
            "overlap": overlapped,
            "tokens_per_s": tps,
            "ratio_vs_1": tps / base,
            "launch_ms_per_token": launch / tokens * 1e3,
            "host_us_per_token": (wall - launch) / tokens * 1e6,
            "launches_per_token": stats.launches_per_token,
            "syncs_per_token": stats.syncs_per_token,
            "decode_tokens": tokens,
            "tokens_equal_n1": all(r.outputs == reference for _, r in runs[(n, overlapped)]),
        }
        rows.append(row)
        print(_line(row), flush=True)
    return rows


COLUMNS = (
    "| bs | N | overlap | tokens/s | vs N=1 | launch ms/token | host µs/token | launches/token | "
    "syncs/token | tokens = N=1 |"
)


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['bs']} | {r['steps_per_launch']} | {'yes' if r.get('overlap') else 'no'} | "
        f"{r['tokens_per_s']:.0f} | "
        f"{r['ratio_vs_1']:.2f}x | {r['launch_ms_per_token']:.3f} | "
        f"{r['host_us_per_token']:.1f} | {r['launches_per_token']:.3f} | "
        f"{r['syncs_per_token']:.3f} | {r['tokens_equal_n1']} |"
    )


def write(result: dict[str, Any], slug: str) -> str:
    out = RESULTS_DIR / f"multistep-{slug}.md"
    lines = [
        "# several decode steps per launch: engine tokens/s against N = 1",
        "",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- command: `{result['command']}`",
        f"- mechanism: {result['mechanism']}"
        f"{' over the compiled forward' if result.get('compile') else ''}; torch threads "
        f"{result['threads']}; model: {MODELS[result.get('shape', 'default')]}; "
        f"bs greedy requests of a 4-token prompt and {result['new']} new tokens "
        "each, arriving together",
        f"- medians of {result['rounds']} engine runs per N, the N values round-robin; "
        "tokens/s over the run's wall time (prefills included); launch: time inside "
        "runner.replay; host: the rest of the run",
        f"- load average at the start: {result['load_before']}, at the end: "
        f"{result['load_after']} (a shared machine)",
        "",
        COLUMNS,
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_line(r) for r in result["rows"]),
    ]
    RESULTS_DIR.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return str(out)


def main(argv: Sequence[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="1" if cuda else "1,8", help="batch sizes (each captured exactly)"
    )
    parser.add_argument(
        "--steps", default="1,4,8" if cuda else ",".join(map(str, STEPS)), help="N values (1 first)"
    )
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1.1b" if cuda else "default")
    parser.add_argument(
        "--compile", action="store_true", help="CUDA: inductor's program inside the graphs"
    )
    parser.add_argument("--new", type=int, default=96, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument(
        "--overlap", action="store_true", help="also time every N with overlap scheduling"
    )
    args = parser.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    kind, device = ("cuda", "cuda") if cuda else ("cpu", "cpu")
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    print(COLUMNS)
    with torch_threads(args.threads), torch.no_grad():
        for bs in (int(s) for s in args.sizes.split(",")):
            rows += measure(
                bs,
                steps,
                new=args.new,
                rounds=args.rounds,
                kind=kind,
                device=device,
                overlap=args.overlap,
                shape=args.shape,
                options={"compile": True} if cuda and args.compile else None,
            )
    info = machine()
    slug = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-") if cuda else "cpu"
    result = {
        "machine": info,
        "command": CMD + (f" {' '.join(sys.argv[1:])}" if argv is None and sys.argv[1:] else ""),
        "mechanism": "cuda (CUDA graphs)" if cuda else "cpu (inductor-compiled program)",
        "threads": args.threads,
        "shape": args.shape,
        "compile": bool(cuda and args.compile),
        "new": args.new,
        "rounds": args.rounds,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    print(f"results written to {write(result, slug)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
