"""The CPU runner's host time with each of inductor's wrappers, in one run:
its Python wrapper with its size and stride asserts (``python-asserts``,
``inductor_options={"size_asserts": True}``, the default before
``DIRECT_CALL_OPTIONS``), without them (``python``, the default) and its
C++ wrapper (``c++``).

Each size's inductor program is a wrapper calling the generated kernels (and
the opaque ops: the live attention, the compact-weight linears); the Python
wrapper pays the interpreter per call (and per input, for each assert), the
C++ one (``inductor_options=CPP_WRAPPER``: ``cpp_wrapper``, its entry built
apart from the kernels) calls them back to back. Same model, same trace,
tokens compared:

- the embedded default model (a step of a few hundred µs, so the wrapper's
  share shows) and, with ``--quantize fp16``, the same with its projections
  through the float16-weight op and the live attention; a 3-token prompt per
  request, ``--new`` tokens;
- SmolLM2-135M-Instruct (``make demo-real``'s checkpoint) with ``--quantize
  int4`` and ``int4-q8`` at batch 1: the 8 chat prompts one at a time, 32
  tokens each (``--smollm2``; ``--no-smollm2`` skips it).

Decode µs per step: the engine's decode seconds over its steps, median of
``--rounds`` runs, the wrappers' runs interleaved (all captured first, the
order rotated each round); a ratio is against the first of ``--wrappers``;
capture seconds of each size (cold only with an empty inductor cache, as the
command below runs it: the wrappers never share a program).

Run: ``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python -m
bench.bench_cpp_wrapper [--wrappers python-asserts,python] [--out NAME]`` (writes
``bench/results/NAME.md``, ``cpp-wrapper-cpu`` by default). Not collected as a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.bench_real_cpu import round_order
from bench.conftest import RESULTS_DIR, machine
from graphrunner.mechanisms.inductor import CPP_WRAPPER
from graphrunner.testing import torch_threads
from graphrunner_ref import Engine, Request, create_decode_runner, default_model, quantize_model

CMD = (
    "TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python -m bench.bench_cpp_wrapper"
)
#: Per ``--wrappers`` name: the runner's ``inductor_options`` (None: the
#: default) and the wrapper it runs (``InductorCapture.wrapper``).
WRAPPERS: dict[str, tuple[Mapping[str, Any] | None, str]] = {
    "python-asserts": ({"size_asserts": True}, "python"),
    "python": (None, "python"),
    "c++": (CPP_WRAPPER, "c++"),
}


def measure(
    bs: int, fp16: bool, new: int, rounds: int, wrappers: Sequence[str]
) -> list[dict[str, Any]]:
    """The embedded model (``fp16``: its projections float16, the live
    attention) at ``bs``: a row per wrapper."""

    def bundle() -> Any:
        made = default_model(max_requests=bs, max_context_len=new + 8)
        if fp16:
            quantize_model(made.model, "fp16")
            made.model.attn_backend.use("live")
        return made

    trace = [Request(i, (3 + i, 5 + i, 7 + i), new) for i in range(bs)]
    model = "embedded, --quantize fp16, live attention" if fp16 else "embedded"
    rows = interleaved(bundle, bs, trace, rounds, wrappers)
    return [{"bs": bs, "model": model, **row} for row in rows]


def measure_smollm2(mode: str, rounds: int, wrappers: Sequence[str]) -> list[dict[str, Any]]:
    """SmolLM2 ``--quantize mode`` at batch 1 over the 8 chat prompts: a row per wrapper."""
    from bench.bench_context import smollm2_chats
    from graphrunner_ref.io import load_model

    checkpoint, prompts = smollm2_chats()
    new = 32

    def bundle() -> Any:
        made = load_model(checkpoint, max_requests=1, max_context_len=max(map(len, prompts)) + new)
        quantize_model(made.model, mode)
        return made

    trace = [Request(i, tuple(p), new) for i, p in enumerate(prompts)]
    model = f"SmolLM2-135M, --quantize {mode}"
    rows = interleaved(bundle, 1, trace, rounds, wrappers)
    return [{"bs": 1, "model": model, **row} for row in rows]


def interleaved(
    bundle: Callable[[], Any], bs: int, trace: list[Request], rounds: int, wrappers: Sequence[str]
) -> list[dict[str, Any]]:
    """Each of ``wrappers``' runners over its own ``bundle()``, captured at
    ``bs`` (timed), then ``trace`` run on each in turn, ``rounds`` times after
    a warm-up, the order rotated a round (a phase of the machine meets them
    all): wrapper, median µs per step, capture s, tokens."""
    engines = {}
    rows = {}
    for wrapper in wrappers:
        options, runs = WRAPPERS[wrapper]
        made = bundle()
        runner = create_decode_runner(
            made, "cpu", capture_sizes=[bs], show_progress=False, inductor_options=options
        )
        start = time.perf_counter()
        runner.capture()
        rows[wrapper] = {"wrapper": wrapper, "capture_s": time.perf_counter() - start}
        assert getattr(runner.mechanism, "wrapper", None) == runs, "the wrapper asked for runs"
        engines[wrapper] = Engine(made, runner)
        engines[wrapper].run(trace)  # warm-up
    per_step: dict[str, list[float]] = {w: [] for w in wrappers}
    for index in range(rounds):
        for wrapper in round_order(list(wrappers), index):
            result = engines[wrapper].run(trace)
            per_step[wrapper].append(result.stats.decode_seconds / result.stats.steps * 1e6)
            rows[wrapper]["tokens"] = [result.outputs[r.rid] for r in trace]
    for wrapper, row in rows.items():
        row["us_per_step"] = statistics.median(per_step[wrapper])
    return list(rows.values())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,8")
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--wrappers",
        default=",".join(WRAPPERS),
        help=f"comma-separated, of {', '.join(WRAPPERS)}; ratios against the first",
    )
    p.add_argument("--out", default="cpp-wrapper-cpu", help="results file under bench/results/")
    args = p.parse_args(argv)
    wrappers = args.wrappers.split(",")
    unknown = [w for w in wrappers if w not in WRAPPERS]
    if unknown:
        p.error(f"--wrappers {unknown[0]}: expected one of {', '.join(WRAPPERS)}")
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    with torch_threads(1):
        for fp16 in (False, True):
            for bs in (int(s) for s in args.sizes.split(",")):
                rows += pair(measure(bs, fp16, args.new, args.rounds, wrappers))
        for mode in ("int4", "int4-q8") if args.smollm2 else ():
            rows += pair(measure_smollm2(mode, args.rounds, wrappers))
    lines = [
        f"# CPU runner: inductor's wrappers ({', '.join(wrappers)}), interleaved",
        "",
        f"- command: `{CMD} {' '.join(argv if argv is not None else sys.argv[1:])}`",
        *(f"- {k}: {v}" for k, v in machine().items()),
        f"- one torch thread; embedded: bs requests of a 3-token prompt, {args.new} greedy "
        f"tokens each, median of {args.rounds} engine runs; SmolLM2: the 8 chat prompts one "
        f"at a time, 32 tokens each, median of {args.rounds} runs; the wrappers' runs "
        f"interleaved, the order rotated a round; decode µs per step; ratio against "
        f"{wrappers[0]}; capture: seconds to capture the size (inductor "
        f"cache at the start: {_cache_state()})",
        f"- load average before / after: {load:.1f} / {os.getloadavg()[0]:.1f} (a shared machine)",
        "",
        "| model | bs | wrapper | decode µs/step | speed-up | capture s | tokens equal |",
        "|---|---|---|---|---|---|---|",
        *(_line(r) for r in rows),
    ]
    out = RESULTS_DIR / f"{args.out}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"results written to {out}")
    return 0


def pair(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (one per wrapper, the baseline first) with their ratio to
    it and whether their tokens equal its, printed."""
    for row in rows:
        row["ratio"] = rows[0]["us_per_step"] / row["us_per_step"]
        row["tokens_equal"] = row["tokens"] == rows[0]["tokens"]
        print(_line(row), flush=True)
    return rows


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
