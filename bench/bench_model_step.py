"""One decode step of the embedded Llama model: eager forward vs the CPU runner
(and on a GPU the CUDA runner, with and without a compiled forward inside its
graphs), measured in the same run.

Graphs are captured at 1, 4, 8 and 16; the batches of 3, 7 and 13 rows replay
padded (to 4, 8, 16) and are compared with the eager forward of those 3, 7, 13
rows, so their ratio includes everything padding costs.

The ratio table (``vs eager``) is printed at the end of the run by
``bench/conftest.py`` and written to ``bench/results/``. Run:
``.venv/bin/python -m pytest bench/bench_model_step.py --benchmark-enable``.
"""

from __future__ import annotations

import pytest
import torch

from bench.conftest import CAPTURES, FACTS, record
from graphrunner import GraphRunner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner_ref.engine.loop import create_decode_runner
from graphrunner_ref.model import ModelBundle, default_model

SIZES = [1, 4, 8, 16]
BATCHES = [1, 3, 4, 7, 8, 13, 16]  # 3, 7, 13 replay padded
#: Mechanism label -> (runner kind, mechanism options).
MECHANISMS = {"cpu": ("cpu", {}), "cuda": ("cuda", {}), "cuda+compile": ("cuda", {"compile": True})}
KINDS = ["cpu"] + (["cuda", "cuda+compile"] if torch.cuda.is_available() else [])
PROMPT_LENS = [24 + 7 * i for i in range(max(SIZES))]  # 24..129 cached tokens, context 256


@pytest.fixture(scope="module", params=KINDS)
def captured(request: pytest.FixtureRequest) -> tuple[ModelBundle, GraphRunner]:
    kind, options = MECHANISMS[request.param]
    bundle = default_model(max_requests=max(SIZES), device="cuda" if kind == "cuda" else "cpu")
    runner = create_decode_runner(bundle, kind, capture_sizes=SIZES, **options)
    CAPTURES[runner.mechanism.label] = runner.capture()
    return bundle, runner


def _batch(bundle: ModelBundle, bs: int) -> DecodeBatch:
    """``bs`` prefilled requests of different lengths, prepared for one decode step."""
    bundle.req_pool.clear()
    bundle.kv_alloc.clear()
    gen = torch.Generator().manual_seed(bs)
    reqs, firsts = [], []
    for n in PROMPT_LENS[:bs]:
        req = bundle.req_pool.alloc(1)[0]
        prompt = torch.randint(256, (n,), generator=gen).to(bundle.device)
        slots = torch.tensor(bundle.kv_alloc.alloc(n), device=bundle.device)
        reqs.append(req)
        firsts.append(bundle.model.forward_extend(req, prompt, slots).argmax())
    batch = DecodeBatch.from_requests(
        reqs,
        PROMPT_LENS[:bs],
        torch.stack(firsts),
        device=bundle.device,
        max_context_len=bundle.max_context_len,
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("bs", BATCHES)
@pytest.mark.parametrize("path", ["eager", "runner"])
def bench_model_step(
    benchmark: object, captured: tuple[ModelBundle, GraphRunner], bs: int, path: str
) -> None:
    """One decode step of the same batch: the model's eager forward, or the runner's replay."""
    bundle, runner = captured
    batch = _batch(bundle, bs)
    forward = bundle.model.forward_decode if path == "eager" else runner.replay

    def step() -> None:
        with torch.no_grad():
            forward(batch)
        _sync(bundle.device)

    benchmark(step)  # type: ignore[operator]
    label = "eager" if path == "eager" else runner.mechanism.label
    group = f"model step ({runner.mechanism.label})"
    FACTS[(group, bs)] = {"graph_bs": runner.graph_size_for(bs)}
    record(benchmark, group, bs, label)
