"""The engine loop with and without overlap scheduling on the embedded model,
same runner kind, same trace, measured in the same run: the median seconds
of serving the whole trace and the ratio against the plain loop. Run:
``.venv/bin/python -m pytest bench/bench_overlap.py --benchmark-enable``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench.conftest import BASELINES, FACTS, record
from graphrunner.core.future_map import FutureMap
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import synthetic_trace
from graphrunner_ref.model import default_model

KIND = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 2, 4, 8]
GROUP = f"engine loop overlap ({KIND})"


def _serve(variant: str) -> Callable[[], int]:
    bundle = default_model(max_requests=SIZES[-1], max_context_len=96, device=KIND)
    trace = synthetic_trace(
        num_requests=48,
        vocab_size=256,
        max_context_len=96,
        seed=0,
        prompt_len=(4, 32),
        new_tokens=(8, 48),
        mean_gap=2.0,
    )
    future = None
    if variant == "overlap":
        future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    runner = create_decode_runner(bundle, KIND, capture_sizes=SIZES, future_map=future)
    runner.capture()
    engine = Engine(bundle, runner) if future is None else Engine(bundle, runner, overlap=True)
    return lambda: engine.run(trace).stats.decode_tokens


@pytest.mark.parametrize("variant", ["plain", "overlap"])
def bench_engine_overlap(benchmark: object, variant: str) -> None:
    serve = _serve(variant)
    tokens = serve()  # warm
    benchmark.pedantic(serve, rounds=15, iterations=1)  # type: ignore[attr-defined]
    BASELINES[GROUP] = "plain"
    FACTS[(GROUP, SIZES[-1])] = {"decode tokens per run": tokens}
    record(benchmark, GROUP, SIZES[-1], variant)
