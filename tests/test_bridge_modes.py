"""Everything the bridge runs also runs in every serving mode, as a user runs
it: ``generate --model DIR --model-impl transformers`` with ``--quantize``,
``--temperature`` / ``--seed``, ``--overlap``, ``--steps-per-launch`` and a
chunked prefill, continuous arrivals (``--arrive-every``) and the
sanitizer (``--check-padding``), on decoders of six families: Qwen2 (dense),
Mixtral and Qwen2-MoE (mixture of experts, the latter with a gated shared
expert), Gemma2 (a sliding window of 4 that binds, soft-capping), Phi3 (a
fused QKV projection) and Starcoder2 (a sliding window of 4, biases,
LayerNorm). Greedy modes give transformers' tokens (``--quantize fp16``: the
same tokens as the float32 run is not promised, so it must run and answer
every prompt); seeded sampling gives a request the same tokens alone and in
a batch. The compiled CPU runner, padded and sanitized, on the two
sliding-window ones. One torch thread: on a busy 2-core machine more only
spin."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner.testing import torch_threads
from graphrunner_ref.engine.workload import Request
from hf_tiny import hf_greedy, save_decoders, tiny_config

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2, 9, 10, 3]]
NEW = 6
COMMON = ["--model-impl", "transformers", "--runner", "eager", "--capture-sizes", "1,2,4"]


_TOP2 = {"num_experts_per_tok": 2}
#: The decoders, by name: transformers config arguments over the tiny shape.
DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", {}),
    "mixtral": ("mixtral", {"num_local_experts": 4, **_TOP2}),
    "qwen2_moe": (
        "qwen2_moe",
        {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
        | _TOP2,
    ),
    "gemma2": ("gemma2", {"sliding_window": 4}),
    "phi3": ("phi3", {}),
    "starcoder2": ("starcoder2", {"sliding_window": 4}),
}
#: Every greedy mode one by one (the others: the modes combined, fewer runs).
EVERY_MODE = {"qwen2", "mixtral"}
#: Seeded sampling: a dense decoder and the mixtures of experts.
SAMPLED = ["qwen2", "mixtral", "qwen2_moe"]
#: On the compiled CPU runner too: a sliding window with soft-capping (live-width attention).
CPU_DECODERS = ["gemma2"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    configs = {name: tiny_config(kind, **extra) for name, (kind, extra) in DECODERS.items()}
    return save_decoders(tmp_path_factory, configs)


@pytest.fixture(params=sorted(DECODERS))
def decoder(request: pytest.FixtureRequest, saved: dict[str, tuple[Path, Any]]) -> tuple[Path, Any]:
    """A decoder of each family: the checkpoint and transformers' model."""
    return saved[request.param]


@pytest.fixture(params=SAMPLED)
def sampled(request: pytest.FixtureRequest, saved: dict[str, tuple[Path, Any]]) -> tuple[Path, Any]:
    """The decoders seeded sampling runs on."""
    return saved[request.param]


def _generate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path, prompts: Any, *extra: str
) -> list[list[int]]:
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    argv = ["generate", "--model", str(model), "--prompts", str(file), "--max-new-tokens", str(NEW)]
    assert cli.main([*argv, "--json", *COMMON, *extra]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [r["token_ids"] for r in sorted(records, key=lambda r: r["index"])]


#: Each greedy mode alone.
MODES: dict[str, list[str]] = {
    "plain": [],
    "overlap": ["--overlap"],
    "multistep": ["--steps-per-launch", "3"],
    "chunked": ["--max-num-batched-tokens", "3"],
    "sanitized": ["--check-padding"],
    "arrivals": ["--check-padding", "--arrive-every", "1"],
}
#: The modes together, as few runs as the options allow (the other decoders).
COMBINED: dict[str, list[str]] = {
    "overlap-chunked-arrivals-sanitized": [
        "--overlap", "--max-num-batched-tokens", "3", "--arrive-every", "1", "--check-padding",
    ],
    "multistep-sanitized": ["--steps-per-launch", "3", "--check-padding"],
}  # fmt: skip


def _greedy_cases() -> list[Any]:
    return [
        pytest.param(name, mode, id=f"{name}-{label}")
        for name in sorted(DECODERS)
        for label, mode in (MODES if name in EVERY_MODE else COMBINED).items()
    ]


@pytest.mark.parametrize(("name", "mode"), _greedy_cases())
def test_a_greedy_mode_gives_transformers_tokens(
    name: str,
    mode: list[str],
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, reference = saved[name]
    requests = [Request(i, tuple(p), NEW) for i, p in enumerate(PROMPTS)]
    expected = hf_greedy(reference, requests)
    got = _generate(capsys, tmp_path, path, PROMPTS, "--ignore-eos", *mode)
    assert got == [expected[i] for i in range(len(PROMPTS))]


def test_quantized_weights_answer_every_prompt(
    decoder: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = decoder
    got = _generate(capsys, tmp_path, path, PROMPTS, "--ignore-eos", "--quantize", "fp16")
    assert [len(t) for t in got] == [NEW] * len(PROMPTS)


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch(
    sampled: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = sampled
    lines = [{"prompt": p, "temperature": 0.9, "seed": 100 + i} for i, p in enumerate(PROMPTS)]
    together = _generate(capsys, tmp_path, path, lines, "--ignore-eos")
    alone = _generate(capsys, tmp_path, path, lines[2:], "--ignore-eos")
    assert alone[0] == together[2]
    greedy = _generate(capsys, tmp_path, path, PROMPTS[2:], "--ignore-eos")
    assert alone[0] != greedy[0]  # it did sample


@pytest.mark.parametrize("name", CPU_DECODERS)
def test_the_cpu_runner_gives_transformers_tokens(
    name: str,
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The compiled CPU runner, one captured size (every step padded to 4),
    the sanitizer on, prompts arriving one a step."""
    path, reference = saved[name]
    requests = [Request(i, tuple(p), NEW) for i, p in enumerate(PROMPTS)]
    expected = hf_greedy(reference, requests)
    mode = ["--runner", "cpu", "--capture-sizes", "4", "--check-padding", "--arrive-every", "1"]
    got = _generate(capsys, tmp_path, path, PROMPTS, "--ignore-eos", *mode)
    assert got == [expected[i] for i in range(len(PROMPTS))]
