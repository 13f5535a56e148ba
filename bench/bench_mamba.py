"""The engine loop over a small random Mamba-1 and a Jamba-style hybrid (two
Mamba, two attention layers), eager against the compiled runner of this
machine (``cpu`` inductor programs, or ``cuda`` graphs), same trace, same run:
the median seconds of serving the whole trace. Run:
``.venv/bin/python -m pytest bench/bench_mamba.py --benchmark-enable``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench.conftest import FACTS, record
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import synthetic_trace
from graphrunner_ref.io.mamba_checkpoint import build_state_space_model
from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.hybrid_config import HybridConfig
from graphrunner_ref.model.mamba import MambaConfig
from graphrunner_ref.model.mamba_mixer import MixerShape

KIND = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 2, 4, 8]
CONTEXT = 96
MIXER = MixerShape(
    hidden_size=64, intermediate_size=128, state_size=16, conv_kernel=4, time_step_rank=4
)
MODELS = {
    "mamba": MambaConfig(vocab_size=256, num_layers=4, mixer=MIXER),
    "hybrid": HybridConfig(
        ModelConfig(256, 64, 128, num_layers=4, num_heads=4, num_kv_heads=2),
        MixerShape(64, 128, 16, 4, 4, bcdt_norm_eps=1e-6),
        attention_layers=(1, 3),
    ),
}


def _serve(model: str, kind: str) -> Callable[[], int]:
    torch.manual_seed(0)
    bundle = build_state_space_model(
        MODELS[model], max_requests=SIZES[-1], max_context_len=CONTEXT, device=KIND
    )
    trace = synthetic_trace(
        num_requests=32,
        vocab_size=256,
        max_context_len=CONTEXT,
        seed=0,
        prompt_len=(4, 32),
        new_tokens=(8, 48),
        mean_gap=2.0,
    )
    runner = create_decode_runner(bundle, kind, capture_sizes=SIZES)
    runner.capture()
    engine = Engine(bundle, runner)
    return lambda: engine.run(trace).stats.decode_tokens


@pytest.mark.parametrize("kind", ["eager", KIND])
@pytest.mark.parametrize("model", list(MODELS))
def bench_mamba_engine(benchmark: object, model: str, kind: str) -> None:
    serve = _serve(model, kind)
    tokens = serve()  # warm
    benchmark.pedantic(serve, rounds=10, iterations=1)  # type: ignore[attr-defined]
    group = f"{model} engine loop ({KIND})"
    FACTS[(group, SIZES[-1])] = {"decode tokens per run": tokens}
    record(benchmark, group, SIZES[-1], kind)
