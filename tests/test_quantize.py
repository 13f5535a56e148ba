"""Compact weights (``quantize_model``, ``--quantize``): int8 per output
channel and float16 weights with float32 activations.

The oracle is transformers: a tiny ``LlamaForCausalLM`` whose projection
and LM head weights are replaced by the values the compact linears multiply
by (int8 times scale, or the float16 rounding) must give, with its own
float32 ``F.linear``, the greedy tokens graphrunner serves through padded
replay of the quantized model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_oracle import TRACE
from torch import nn

from graphrunner_ref import default_model
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.io import load_model
from graphrunner_ref.model.fp16_linear import Fp16WeightLinear
from graphrunner_ref.model.int8_linear import Int8Linear, quantize_per_channel
from graphrunner_ref.model.quantize import check_quantization, quantize_model
from hf_tiny import hf_greedy, save_tiny_llama

transformers = pytest.importorskip("transformers")

MODES = ["int8", "fp16"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _stored(weight: torch.Tensor, mode: str) -> torch.Tensor:
    """The float32 values ``mode`` multiplies by in place of ``weight``."""
    if mode == "fp16":
        return weight.half().float()
    q, scales = quantize_per_channel(weight)
    return q.float() * scales[:, None]


def test_per_channel_int8_is_within_half_a_scale_of_every_weight() -> None:
    w = torch.randn(48, 40, generator=torch.Generator().manual_seed(0)) * torch.rand(48, 1)
    w[5] = 0.0
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert scales[5] == 1 and not q[5].any()
    assert bool(((w - q.float() * scales[:, None]).abs() <= scales[:, None] / 2 + 1e-7).all())
    live = torch.arange(48) != 5
    assert bool((q[live].abs().amax(dim=1) == 127).all())  # each row's peak uses the range
    for bad in (torch.randn(4), torch.tensor([[1.0, float("nan")]]), torch.ones(2, 2).long()):
        with pytest.raises(ValueError, match="quantize_per_channel"):
            quantize_per_channel(bad)


@pytest.mark.parametrize("mode", MODES)
def test_compact_linear_multiplies_by_its_stored_weights(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 64, generator=gen) * 0.1, torch.randn(2, 3, 64, generator=gen)
    linear = Int8Linear(w, torch.float32) if mode == "int8" else Fp16WeightLinear(w)
    assert torch.equal(linear.dequantized(), _stored(w, mode))
    out = linear(x)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ _stored(w, mode).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_other_rows_never_reach_a_live_row(mode: str) -> None:
    """A padded row holding NaN, inf or huge values leaves the live rows bit-equal."""
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(80, 48, generator=gen), torch.randn(8, 48, generator=gen)
    linear = Int8Linear(w, torch.float32) if mode == "int8" else Fp16WeightLinear(w)
    poisoned = x.clone()
    poisoned[3], poisoned[4], poisoned[5:] = float("nan"), float("inf"), 3e38
    assert torch.equal(linear(poisoned)[:3], linear(x)[:3])


def test_fp16_weights_outside_float16_are_refused() -> None:
    with pytest.raises(ValueError, match="within float16's range"):
        Fp16WeightLinear(torch.full((4, 4), 1e6))


def test_quantize_model_replaces_every_projection_and_the_head() -> None:
    for mode, kind in (("int8", Int8Linear), ("fp16", Fp16WeightLinear)):
        model = quantize_model(default_model(max_requests=2).model, mode)
        assert model.quantization == mode and isinstance(model.head_proj, kind)
        assert not any(isinstance(m, nn.Linear) for m in model.model.layers.modules())
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.qkv_proj, kind) and not hasattr(attn, "qkv_weight")
        assert isinstance(model.model.embed_tokens, nn.Embedding)  # a lookup stays float


def test_quantize_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="supported for Llama models.*Linear"):
        quantize_model(nn.Linear(2, 2), "int8")
    with pytest.raises(ValueError, match="expected one of int8, fp16, int4"):
        check_quantization("int2", torch.float32, "cpu")
    with pytest.raises(ValueError, match="runs on the CPU; the model is on cuda"):
        check_quantization("int8", torch.float32, "cuda")
    twice = quantize_model(default_model(max_requests=1).model, "fp16")
    with pytest.raises(ValueError, match="already quantized \\('fp16'\\)"):
        quantize_model(twice, "int8")
    bf16 = default_model(max_requests=1, dtype=torch.bfloat16).model
    with pytest.raises(ValueError, match="quantize='fp16'.*torch.bfloat16"):
        quantize_model(bf16, "fp16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    path = tmp_path_factory.mktemp("quantize")
    return path, save_tiny_llama(path)


def _stored_copy(hf: nn.Module, mode: str) -> nn.Module:
    """A copy of ``hf`` whose projections and LM head hold ``mode``'s stored values."""
    import copy

    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.split(".")[-1] in (*PROJECTIONS, "lm_head"):
                module.weight.copy_(_stored(module.weight, mode))
    return model


@pytest.mark.parametrize("mode", MODES)
def test_quantized_prefill_logits_equal_transformers_with_the_same_weights(
    tiny: tuple[Path, nn.Module], mode: str
) -> None:
    path, hf = tiny
    bundle = load_model(path, max_requests=1, max_context_len=64)
    quantize_model(bundle.model, mode)
    prompt = list(TRACE[5].prompt)
    slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)))
    got = bundle.model.forward_extend(1, torch.tensor(prompt), slots)
    with torch.no_grad():
        want = _stored_copy(hf, mode)(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("mode", "kind"), [("int8", "eager"), ("fp16", "eager"), ("fp16", "cpu"), ("int8", "cpu")]
)
def test_quantized_tokens_equal_transformers_with_the_same_weights(
    tiny: tuple[Path, nn.Module], mode: str, kind: str
) -> None:
    path, hf = tiny
    bundle = load_model(path, max_requests=8, max_context_len=64, page_size=4)
    quantize_model(bundle.model, mode)
    runner = create_decode_runner(bundle, kind, capture_sizes=[1, 4, 8], check_padding=True)
    runner.capture()
    result = Engine(bundle, runner, check=True).run(TRACE)
    expected = hf_greedy(_stored_copy(hf, mode), TRACE)
    for req in TRACE:
        assert result.outputs[req.rid] == expected[req.rid], f"request {req.rid} ({mode}, {kind})"
    stats = result.stats
    assert stats.mismatches == 0 and stats.checked_steps == stats.steps
    assert stats.padded_rows > 0
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size
