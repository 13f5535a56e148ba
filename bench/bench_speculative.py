"""Speculative vs plain greedy decoding on the embedded model, same runner
kind, same trace, measured in the same run: the self draft (every draft
accepted: the upper bound) and random MTP and EAGLE heads (next to nothing
accepted: the cost of drafting), K = 2 and 4. Each variant serves the whole
trace; the table gives the median seconds of a run and its ratio against
plain greedy, the facts the acceptance rate per variant. Run:
``.venv/bin/python -m pytest bench/bench_speculative.py --benchmark-enable``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench.conftest import BASELINES, FACTS, record
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.spec_factory import speculative_engine
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import default_model

KIND = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 2, 4]
VARIANTS = ["plain", "mtp self", "mtp random", "eagle random"]


def _trace() -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    lens = [5, 12, 8, 20, 3, 16, 9, 11]
    return [
        Request(i, tuple(torch.randint(0, 256, (n,), generator=gen).tolist()), 24)
        for i, n in enumerate(lens)
    ]


def _runner(variant: str, k: int) -> Callable[[], tuple[int, float]]:
    """A function serving the trace once; returns tokens emitted and the acceptance rate."""
    bundle = default_model(max_requests=SIZES[-1], max_context_len=64, device=KIND)
    trace = _trace()
    if variant == "plain":
        runner = create_decode_runner(bundle, KIND, capture_sizes=SIZES)
        runner.capture()

        def plain() -> tuple[int, float]:
            stats = Engine(bundle, runner).run(trace).stats
            return stats.decode_tokens, 0.0

        return plain
    method, draft = variant.split()
    engine = speculative_engine(bundle, KIND, method=method, draft=draft, k=k, capture_sizes=SIZES)

    def speculative() -> tuple[int, float]:
        stats = engine.run(trace).stats
        return stats.decode_tokens, stats.acceptance_rate

    return speculative


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [2, 4])
def bench_speculative(benchmark: object, k: int, variant: str) -> None:
    run = _runner(variant, k)
    tokens, acceptance = run()  # warm: every size's program has run once
    benchmark.pedantic(run, rounds=5, iterations=1)  # type: ignore[attr-defined]
    group = f"speculative K={k} ({KIND})"
    BASELINES[group] = "plain"
    facts = FACTS.setdefault((group, SIZES[-1]), {})
    facts[f"{variant} acceptance"] = round(acceptance, 3)
    facts["tokens per run"] = tokens
    record(benchmark, group, SIZES[-1], variant)
