"""Capture sizes from traffic: the exact optimiser's time, and the padding of
the default and optimal lists on two traces (facts in the table, per-size
fractions in ``bench/results/padding-per-size.png``):

- the demo's synthetic trace served by the engine on the embedded model
  (eager runner, sizes up to 16), its histogram read off the runner;
- traffic decaying as exp(-b/24) over 1..256, 36 graphs (the issue's figure).
"""

from __future__ import annotations

import math

import pytest

from bench.conftest import FACTS, PADDING, record
from bench.plots import PaddingPanel
from graphrunner.sizing.plan import expected_waste, optimal_capture_sizes
from graphrunner.sizing.sizes import default_capture_sizes
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import synthetic_trace
from graphrunner_ref.model import default_model

GROUP = "size optimiser"
DEMO_MAX_BS, DEMO_GRAPHS = 16, 4


def _engine_counts() -> dict[int, int]:
    """The batch sizes the engine served on the demo's trace (300 steps)."""
    bundle = default_model(max_requests=DEMO_MAX_BS)
    runner = create_decode_runner(bundle, "eager", max_bs=DEMO_MAX_BS)
    runner.capture()
    trace = synthetic_trace(
        num_requests=300,
        vocab_size=bundle.config.vocab_size,
        max_context_len=bundle.max_context_len,
        prompt_len=(4, 48),
        new_tokens=(8, 64),
        mean_gap=4.0,
    )
    Engine(bundle, runner).run(trace, max_steps=300)
    return runner.batch_sizes.counts()


def _decaying() -> dict[int, int]:
    return {b: round(10**6 * math.exp(-b / 24)) for b in range(1, 257)}


TRACES = {
    "demo trace (engine, embedded model)": (_engine_counts, DEMO_MAX_BS, DEMO_GRAPHS),
    "exp(-b/24) traffic": (_decaying, 256, 36),
}


@pytest.mark.parametrize("name", sorted(TRACES))
def bench_optimal_sizes(benchmark: object, name: str) -> None:
    make, max_bs, graphs = TRACES[name]
    counts = make()
    plan = benchmark(lambda: optimal_capture_sizes(counts, graphs, max_bs=max_bs))  # type: ignore[operator]
    default = default_capture_sizes(max_bs)
    FACTS[(GROUP, max_bs)] = {
        "trace": name,
        "distinct sizes": len(counts),
        f"default ({len(default)} graphs)": f"{expected_waste(default, counts).fraction:.2%}",
        f"optimum ({len(plan.sizes)} graphs)": f"{plan.waste.fraction:.2%}",
    }
    record(benchmark, GROUP, max_bs, "dp")
    lists = {f"default, {len(default)} graphs": default, f"optimum, {graphs} graphs": plan.sizes}
    if len(default) != graphs:  # the default's own count, for a like-for-like line
        same = optimal_capture_sizes(counts, len(default), max_bs=max_bs)
        lists[f"optimum, {len(default)} graphs"] = same.sizes
    title = f"{name}, sizes up to {max_bs}"
    PADDING[name] = PaddingPanel(title, counts, lists)
