"""The CPU runner's host time with inductor's C++ wrapper against its Python
wrapper, in one run.

Each size's inductor program is a wrapper calling the generated kernels (and
the opaque ops: the live attention, the float16-weight linear); the Python
wrapper pays the interpreter per call, ``inductor_options={"cpp_wrapper":
True}`` compiles the wrapper to C++ too. Same model, same trace, tokens
compared. The embedded default model (a step of a few hundred µs, so the
wrapper's share shows) and, with ``--quantize fp16``, the same with its
projections through the float16-weight op and the live attention.

Decode µs per step: the engine's decode seconds over its steps, median of
``--rounds`` runs of ``--new`` tokens per request; capture seconds of each
size (cold only with an empty inductor cache, as the command below runs it).

Run: ``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python -m
bench.bench_cpp_wrapper`` (writes
``bench/results/cpp-wrapper-cpu.md``). Not collected as a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.conftest import RESULTS_DIR, machine
from graphrunner.testing import torch_threads
from graphrunner_ref import Engine, Request, create_decode_runner, default_model, quantize_model

CMD = (
    "TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python -m bench.bench_cpp_wrapper"
)
WRAPPERS = {"python": {}, "c++": {"cpp_wrapper": True}}


def measure(bs: int, fp16: bool, wrapper: str, new: int, rounds: int) -> dict[str, Any]:
    bundle = default_model(max_requests=bs, max_context_len=new + 8)
    if fp16:
        quantize_model(bundle.model, "fp16")
        bundle.model.attn_backend.use("live")
    runner = create_decode_runner(
        bundle, "cpu", capture_sizes=[bs], show_progress=False, inductor_options=WRAPPERS[wrapper]
    )
    start = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - start
    engine = Engine(bundle, runner)
    trace = [Request(i, (3 + i, 5 + i, 7 + i), new) for i in range(bs)]
    result = engine.run(trace)  # warm-up
    per_step = []
    for _ in range(rounds):
        result = engine.run(trace)
        per_step.append(result.stats.decode_seconds / result.stats.steps * 1e6)
    return {
        "bs": bs,
        "model": "embedded, --quantize fp16, live attention" if fp16 else "embedded",
        "wrapper": wrapper,
        "us_per_step": statistics.median(per_step),
        "capture_s": capture_s,
        "tokens": [result.outputs[i] for i in range(bs)],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,8")
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    rows = []
    load = os.getloadavg()[0]
    with torch_threads(1):
        for fp16 in (False, True):
            for bs in (int(s) for s in args.sizes.split(",")):
                pair = [measure(bs, fp16, w, args.new, args.rounds) for w in WRAPPERS]
                base = pair[0]
                for row in pair:
                    row["ratio"] = base["us_per_step"] / row["us_per_step"]
                    row["tokens_equal"] = row["tokens"] == base["tokens"]
                    print(_line(row), flush=True)
                rows += pair
    lines = [
        "# CPU runner: inductor's C++ wrapper against its Python wrapper",
        "",
        f"- command: `{CMD}`",
        *(f"- {k}: {v}" for k, v in machine().items()),
        f"- one torch thread; bs requests of a 3-token prompt, {args.new} greedy tokens each; "
        f"decode µs per step, median of {args.rounds} engine runs; capture: seconds to "
        f"capture the size (inductor cache at the start: {_cache_state()})",
        f"- load average before / after: {load:.1f} / {os.getloadavg()[0]:.1f} (a shared machine)",
        "",
        "| model | bs | wrapper | decode µs/step | speed-up | capture s | tokens equal |",
        "|---|---|---|---|---|---|---|",
        *(_line(r) for r in rows),
    ]
    out = RESULTS_DIR / "cpp-wrapper-cpu.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"results written to {out}")
    return 0


def _cache_state() -> str:
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return f"{cache}, empty at the start" if cache else "the default one (captures may be warm)"


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['model']} | {r['bs']} | {r['wrapper']} | {r['us_per_step']:.1f} | "
        f"{r['ratio']:.2f}x | {r['capture_s']:.1f} | {r['tokens_equal']} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
