"""``--prefill-bf16``: a 4-bit mode's prompt chunks multiply the same weights
widened to bfloat16, its decode steps the 4-bit kernels as before. The
wrapper's two paths against their references (bit for bit: the 4-bit
linear below :data:`PROMPT_ROWS`, bfloat16 ``F.linear`` of the dequantized
weight from it; that within bfloat16 of float32), the codes a GGUF file
sets reaching the widened copy, a Llama's prefill close to its 4-bit one,
``generate`` with ``--check`` (captured decode equal to eager), and the
refusals by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.serving import build
from graphrunner_ref.model import cpu_features as features_module
from graphrunner_ref.model.int4_linear import quantize_int4
from graphrunner_ref.model.int4_q8 import Int4Q8Linear
from graphrunner_ref.model.prompt_bf16 import (
    PROMPT_ROWS,
    PromptBf16Linear,
    bf16_matmul_units,
    slow_bf16_note,
    widen_prompts,
)

ROOT = Path(__file__).resolve().parents[1]


def _linear(out: int = 48, inp: int = 64) -> tuple[PromptBf16Linear, Int4Q8Linear]:
    torch.manual_seed(0)
    inner = Int4Q8Linear(torch.randn(out, inp) * 0.1)
    return PromptBf16Linear(inner), inner


def test_decode_rows_go_to_the_4bit_linear_bit_for_bit() -> None:
    wrapped, inner = _linear()
    for rows in (1, 8, PROMPT_ROWS - 1):
        x = torch.randn(rows, 64)
        assert torch.equal(wrapped(x), inner(x))


def test_prompt_rows_multiply_the_same_weights_in_bfloat16() -> None:
    wrapped, inner = _linear()
    weight = inner.dequantized()
    assert torch.equal(wrapped.prompt_weight, weight.to(torch.bfloat16))
    for rows in (PROMPT_ROWS, 100):
        x = torch.randn(rows, 64)
        out = wrapped(x)
        assert out.dtype == torch.float32 and out.shape == (rows, 48)
        expected = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
        assert torch.equal(out, expected)
        torch.testing.assert_close(out, F.linear(x, weight), rtol=3e-2, atol=3e-2)


def test_codes_set_later_reach_the_widened_weight() -> None:
    wrapped, inner = _linear()
    codes = quantize_int4(torch.randn(16, 64))
    wrapped.set_rows(8, codes)
    assert torch.equal(wrapped.prompt_weight, inner.dequantized().to(torch.bfloat16))
    assert torch.equal(inner.packed[8:24], codes.packed)


def _llama(prefill_bf16: bool) -> object:
    config = EngineConfig(runner="eager", quantize="int4-q8", prefill_bf16=prefill_bf16, quiet=True)
    return build(config, max_requests=2, context=96)


@pytest.mark.skipif(not bf16_matmul_units(), reason="needs AMX-BF16 or AVX-512 BF16")
def test_a_llama_prefill_is_close_to_its_4bit_one_and_every_projection_widened() -> None:
    plain, widened = _llama(False), _llama(True)
    layers = widened.model.model.layers  # type: ignore[attr-defined]
    for layer in layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            assert isinstance(linear, PromptBf16Linear)
        assert isinstance(layer.mlp.gate_up_proj, PromptBf16Linear)
        assert isinstance(layer.mlp.down_proj, PromptBf16Linear)
    ids = torch.randint(3, 256, (60,))
    logits = []
    for bundle in (plain, widened):
        row = bundle.req_pool.alloc(1)[0]  # type: ignore[attr-defined]
        slots = torch.tensor(bundle.kv_alloc.alloc(60))  # type: ignore[attr-defined]
        logits.append(bundle.model.forward_extend(row, ids, slots))  # type: ignore[attr-defined]
    assert not torch.equal(logits[0], logits[1])  # the prompt really took the other path
    torch.testing.assert_close(logits[1], logits[0], rtol=0.1, atol=0.1)
    with pytest.raises(ValueError, match="widened already"):
        widen_prompts(widened.model)  # type: ignore[attr-defined]


@pytest.mark.skipif(not bf16_matmul_units(), reason="needs AMX-BF16 or AVX-512 BF16")
def test_a_prompt_chunk_attends_in_bfloat16_and_a_decode_step_does_not() -> None:
    widened = _llama(True)
    model: Any = widened.model  # type: ignore[attr-defined]
    attentions = [layer.self_attn for layer in model.model.layers]
    assert {a.prompt_bf16_rows for a in attentions} == {PROMPT_ROWS}
    ids = torch.randint(3, 256, (60,))

    def prefill() -> torch.Tensor:
        row = widened.req_pool.alloc(1)[0]  # type: ignore[attr-defined]
        slots = torch.tensor(widened.kv_alloc.alloc(60))  # type: ignore[attr-defined]
        return model.forward_extend(row, ids, slots)

    bf16 = prefill()
    for a in attentions:
        a.prompt_bf16_rows = None  # the projections alone in bfloat16
    fp32 = prefill()
    assert not torch.equal(bf16, fp32)  # the attention really took the other path
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.05)
    for a in attentions:
        a.prompt_bf16_rows = 1  # even a one-row call: a decode step stays float32
    q = torch.randn(4, attentions[0].num_heads * attentions[0].head_dim)
    meta = SimpleNamespace(decode=True)
    seen: list[torch.dtype] = []
    attentions[0]._attend = lambda q, kv, meta: seen.append(q.dtype) or q  # type: ignore[method-assign]
    attentions[0].attend_rotated(q, None, meta)
    assert seen == [torch.float32]


def _generate(*flags: str, prompts: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "graphrunner", "generate", "--prompts", str(prompts)]
    command += ["--max-new-tokens", "4", "--quiet", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not bf16_matmul_units(), reason="needs AMX-BF16 or AVX-512 BF16")
def test_generate_with_prefill_bf16_checks_its_captured_steps(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(list(range(5, 45))) + "\n" + json.dumps([7, 8, 9]) + "\n")
    done = _generate(
        "--runner", "cpu", "--quantize", "int4-q8", "--prefill-bf16", "--check", prompts=prompts
    )
    assert done.returncode == 0, done.stderr
    assert "mismatches: 0" in done.stderr


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ((), "--prefill-bf16 with --quantize None"),
        (("--quantize", "int8"), "--prefill-bf16 with --quantize int8"),
    ],
)
def test_prefill_bf16_without_a_4bit_mode_is_refused_by_name(
    tmp_path: Path, flags: tuple[str, ...], words: str
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[1, 2, 3]\n")
    done = _generate("--runner", "eager", "--prefill-bf16", *flags, prompts=prompts)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "expected --quantize one of int4" in done.stderr


@pytest.mark.parametrize(
    ("flags", "noted"),
    [
        ({"avx2", "avx512f", "avx512_bf16"}, True),  # AVX-512 BF16 alone: said
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, False),  # AMX-BF16
        ({"avx2", "avx512f"}, False),  # no bfloat16 units: refused, not noted
    ],
)
def test_prefill_bf16_says_where_the_cpu_has_no_amx(
    fresh_features: pytest.MonkeyPatch, flags: set[str], noted: bool
) -> None:
    fresh_features.setattr(features_module, "_cpuinfo", lambda: ("Test Xeon", flags))
    fresh_features.setattr(features_module, "amx_permitted", lambda: True)
    features_module.cpu_features.cache_clear()
    note = slow_bf16_note()
    assert (note is not None) == noted
    if note is not None:
        assert "without AMX" in note and "prefill-vllm-" in note
        assert (ROOT / note.rsplit("(", 1)[1].rstrip(")")).is_file()  # the file it cites


@pytest.mark.skipif(not bf16_matmul_units(), reason="needs AMX-BF16 or AVX-512 BF16")
def test_a_build_with_prefill_bf16_prints_the_note_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = EngineConfig(runner="eager", quantize="int4-q8", prefill_bf16=True)
    build(config, max_requests=1, context=32)
    note, err = slow_bf16_note(), capsys.readouterr().err
    assert note in err if note is not None else "without AMX" not in err
