"""The transformers bridge: tiny random checkpoints of several architectures,
saved with ``save_pretrained`` and loaded through the bridge, answer as
transformers' own greedy ``generate`` does, through padded replay under the
padding sanitizer (transformers is the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from graphrunner import PaddingViolation
from graphrunner.mechanisms import UncapturableError
from graphrunner_ref import Engine, create_decode_runner
from graphrunner_ref.bridge import build_transformers_bundle, load_transformers
from hf_tiny import TINY_DECODER, hf_greedy, mixed_trace, save_decoders

transformers = pytest.importorskip("transformers")

_SMALL = TINY_DECODER


def _configs() -> dict[str, Any]:
    t = transformers
    return {
        "llama-biases-llama3-rope": t.LlamaConfig(
            **_SMALL,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "qwen2": t.Qwen2Config(**_SMALL),
        "qwen3-qk-norm": t.Qwen3Config(**_SMALL, head_dim=8),
        "mistral": t.MistralConfig(**_SMALL),
        "gemma-tied": t.GemmaConfig(**_SMALL, head_dim=8),
        "gemma2-window-softcap": t.Gemma2Config(
            **_SMALL,
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.5,  # small enough to change the scores
            final_logit_softcapping=2.0,
        ),
        "phi3": t.Phi3Config(**_SMALL, pad_token_id=0),
    }


ARCHS = sorted(_configs())
TRACE = mixed_trace()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each architecture saved once: its directory and transformers' own model."""
    return save_decoders(tmp_path_factory, _configs())


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_replay_equals_transformers_generate(
    arch: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    result = Engine(bundle, runner).run(TRACE)
    assert result.outputs == hf_greedy(reference, TRACE)
    assert runner.stats.padded_rows > 0  # some steps ran padded
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked > 0


@pytest.mark.parametrize("arch", ["qwen2", "gemma2-window-softcap"])
def test_prefill_logits_equal_transformers(arch: str, saved: dict[str, tuple[Path, Any]]) -> None:
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=2, max_context_len=32)
    prompt = torch.tensor([3, 17, 5, 9, 22, 7, 1, 2])  # past gemma2's window of 4
    row = bundle.req_pool.alloc(1)[0]
    slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)))
    logits = bundle.model.forward_extend(row, prompt, slots)
    with torch.no_grad():
        expected = reference(prompt[None]).logits[0, -1].float()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_stray_write_from_the_attention_is_caught(
    saved: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sanitizer guards the bridge's pools: a padded row's K/V written to
    a live slot instead of slot 0 raises (the check can fail)."""
    import graphrunner_ref.bridge.attention as attention

    path, _ = saved["qwen2"]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4], check_padding=True)
    runner.capture()
    real = attention.StepKV

    def stray(kv: Any, req_to_token: Any, rows: Any, lens: Any, slots: Any) -> Any:
        return real(kv, req_to_token, rows, lens, torch.where(slots == 0, 1, slots))

    monkeypatch.setattr(attention, "StepKV", stray)
    import graphrunner_ref.bridge.decoder as decoder

    monkeypatch.setattr(decoder, "StepKV", stray)
    with pytest.raises(PaddingViolation):
        Engine(bundle, runner).run(TRACE[:1])


def test_a_module_that_is_not_a_transformers_model_is_refused() -> None:
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = transformers.LlamaConfig(**_SMALL)
            self.linear = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="not a transformers model"):
        build_transformers_bundle(Plain(), max_requests=2)


def test_the_compiled_cpu_runner_equals_transformers(saved: dict[str, tuple[Path, Any]]) -> None:
    path, reference = saved["qwen2"]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    assert runner.compilations == 1  # one program serves the three sizes
    assert Engine(bundle, runner).run(TRACE).outputs == hf_greedy(reference, TRACE)
    assert runner.stats.eager_fallbacks == 0 and runner.direct_fallbacks == 0


def test_a_module_that_reads_a_tensor_on_the_host_is_refused_at_capture(
    saved: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transformers module with a data-dependent branch cannot be captured:
    the CPU runner refuses it naming the function, its line and the reason,
    and captures nothing (never a silently piecewise or eager run)."""
    path, reference = saved["qwen2"]
    mlp_class = type(reference.model.layers[0].mlp)  # the class the bridge will load
    real = mlp_class.forward

    def branching_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e9:  # a host read of a tensor's value
            return real(self, x) * 0
        return real(self, x)

    monkeypatch.setattr(mlp_class, "forward", branching_forward)
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[2, 4])
    with pytest.raises(UncapturableError, match=r"size 4: .* in branching_forward \(.*test_bridge"):
        runner.capture()
    assert not runner.is_captured


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["qwen2", "gemma2-window-softcap"])
def test_cuda_graphs_equal_transformers(arch: str, saved: dict[str, tuple[Path, Any]]) -> None:
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=4, max_context_len=32, device="cuda")
    runner = create_decode_runner(bundle, "cuda", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    assert Engine(bundle, runner).run(TRACE).outputs == hf_greedy(reference, TRACE)
