"""The AMX-BF16 prompt attention (``graphrunner_attention::prompt_bf16``, what
:func:`~graphrunner_ref.model.attention_cpu.cpp_prompt_attention` runs for
bfloat16 queries): one request's prompt chunk over its slots, token ``i`` of
``n`` reading slots ``0 .. L - n + i``, bfloat16 out.

The oracle is the same attention in float64 over the queries and the cache
as bfloat16 holds them (a float16 or float32 cache rounded to bfloat16, as
the kernel and torch's fused attention read it): the kernel must meet it
within bfloat16's rounding (its probabilities and its output are bfloat16)
at every block remainder (16 tokens a block), key tail (16 keys a score
tile, 32 a value product, 64 a span) and head size; a token's output must
not move with the keys and values after its own; bad inputs are refused by
name. The tests skip where the CPU has no AMX-BF16 (or the OS withholds its
tiles).
"""

from __future__ import annotations

import re

import pytest
import torch

from graphrunner_ref.model.attention_cpu import (
    BF16_PROMPT_FEATURES,
    cpp_prompt_attention,
    cpp_prompt_runs,
    prompt_paths,
)
from graphrunner_ref.model.attention_torch import torch_prompt_attention
from graphrunner_ref.model.cpu_features import cpu_features
from tests.attention_oracle import prompt_oracle

SLOTS = 400

#: (n, L, H, H_kv, D): whole prompts and chunks after a prefix; n at and
#: around 16-token blocks; L below, at and past 16, 32, 64 and a span's tail.
CASES = [
    (1, 1, 9, 3, 64),
    (15, 15, 4, 4, 64),
    (16, 16, 9, 3, 64),
    (17, 40, 8, 2, 64),
    (33, 33, 9, 3, 64),
    (64, 64, 2, 1, 64),
    (48, 300, 9, 3, 64),
    (5, 129, 4, 2, 128),
    (40, 97, 6, 3, 128),
]


def _skip_without_kernel() -> None:
    probe = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    if not cpp_prompt_runs(probe, torch.zeros(1, 1, 64, dtype=torch.bfloat16)):
        pytest.skip("the AMX-BF16 prompt attention does not run here (it needs AMX-BF16)")


def _case(
    n: int, length: int, heads: int, kv_heads: int, dim: int, seed: int, cache: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=gen).bfloat16()
    k = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(cache)
    v = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(cache)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:length] + 1  # slot 0 the sink
    return q, k, v, slots


@pytest.mark.parametrize(("n", "length", "heads", "kv_heads", "dim"), CASES)
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float16, torch.float32])
def test_it_meets_the_float64_attention_within_bfloat16(
    n: int, length: int, heads: int, kv_heads: int, dim: int, cache: torch.dtype
) -> None:
    _skip_without_kernel()
    q, k, v, slots = _case(n, length, heads, kv_heads, dim, seed=n * 31 + length, cache=cache)
    scale = dim**-0.5
    got = cpp_prompt_attention(q, k, v, slots, scale)
    want = prompt_oracle(q, k.bfloat16(), v.bfloat16(), slots, scale)
    assert got.shape == (n, heads * dim) and got.dtype == torch.bfloat16
    # bfloat16's output rounding (2^-8 relative) and its probabilities' (a
    # sum of many, each off by at most 2^-9 relative).
    torch.testing.assert_close(got.double(), want, atol=3e-3, rtol=8e-3)
    # No further from the oracle than torch's own bfloat16 attention, give or take an ulp.
    twin = torch_prompt_attention(q, k.bfloat16(), v.bfloat16(), slots, scale)
    worst = (twin.double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 * worst + 2e-3


@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float32])
def test_a_score_far_above_the_first_spans_rescales_the_output(cache: torch.dtype) -> None:
    """Keys whose scores rise far past a token's first 64 (the reference the
    kernel keeps until a score passes it by e^8) still meet the oracle: the
    reference raised, the output so far and the sum rescaled, the span taken
    again."""
    _skip_without_kernel()
    n, length = 40, 300
    q, k, v, slots = _case(n, length, 6, 2, 64, seed=9, cache=cache)
    for i, boost in ((70, 6.0), (150, 12.0), (260, 25.0)):  # each later one higher still
        k[slots[i]] = (q[-1, 0].float() * boost / q[-1, 0].float().norm()).to(cache)
    got = cpp_prompt_attention(q, k, v, slots, 0.5)
    want = prompt_oracle(q, k.bfloat16(), v.bfloat16(), slots, 0.5)
    torch.testing.assert_close(got.double(), want, atol=3e-3, rtol=8e-3)


def test_a_token_never_reads_the_keys_after_its_own() -> None:
    """NaN keys after token i's last leave token i's output the same bit for
    bit (a masked score is -inf whatever the key)."""
    _skip_without_kernel()
    n, length = 40, 100
    q, k, v, slots = _case(n, length, 6, 2, 64, seed=5, cache=torch.bfloat16)
    clean = cpp_prompt_attention(q, k, v, slots, 0.125)
    assert bool(clean.isfinite().all())
    for i in range(0, n - 1, 3):
        later = slots[length - n + i + 1 :]
        k2 = k.clone()
        k2[later] = float("nan")
        got = cpp_prompt_attention(q, k2, v, slots, 0.125)
        assert torch.equal(got[: i + 1], clean[: i + 1]), i
        assert not bool(got[i + 1 :].isfinite().all()), i  # the poison is read where it should be


def test_a_token_never_weighs_the_values_after_its_own() -> None:
    """Values after token i's last that are not finite leave token i's output
    finite, alike whatever they hold (NaN or infinity), and within bfloat16
    of the clean output (their chunk weighed token by token, each to its own
    last key)."""
    _skip_without_kernel()
    n, length = 40, 100
    q, k, v, slots = _case(n, length, 6, 2, 64, seed=6, cache=torch.bfloat16)
    clean = cpp_prompt_attention(q, k, v, slots, 0.125)
    for i in range(0, n - 1, 3):
        later = slots[length - n + i + 1 :]
        outs = []
        for poison in (float("nan"), float("inf")):
            v2 = v.clone()
            v2[later] = poison
            outs.append(cpp_prompt_attention(q, k, v2, slots, 0.125))
        assert torch.equal(outs[0][: i + 1], outs[1][: i + 1]), i
        assert bool(outs[0][: i + 1].isfinite().all()), i
        torch.testing.assert_close(outs[0][: i + 1], clean[: i + 1], atol=3e-3, rtol=8e-3)
        assert not bool(outs[0][i + 1 :].isfinite().all()), i


def test_bad_inputs_are_refused_by_name() -> None:
    _skip_without_kernel()
    q, k, v, slots = _case(4, 10, 4, 2, 64, seed=1, cache=torch.bfloat16)
    prompt = torch.ops.graphrunner_attention.prompt_bf16
    bad = [
        ((q, k, v, slots[:3], 1.0), "4 query tokens over 3 slots"),
        ((q, k, v, torch.tensor([1, 2, SLOTS, 4, 5]), 1.0), f"slots[2] = {SLOTS} out of range"),
        ((q, k, v, slots.int(), 1.0), "slots must be int64"),
        ((q.float(), k, v, slots, 1.0), "q must be a bfloat16 CPU tensor"),
        ((q[..., :32], k[..., :32], v[..., :32], slots, 1.0), "D a multiple of 64"),
        ((torch.zeros(4, 3, 64, dtype=torch.bfloat16), k, v, slots, 1.0), "H a multiple of H_kv"),
        ((q, k, v.half(), slots, 1.0), "k_buf and v_buf must be contiguous"),
        ((q, k.to(torch.int8), v.to(torch.int8), slots, 1.0), "k_buf and v_buf must be contiguous"),
    ]
    for args, named in bad:
        with pytest.raises(RuntimeError, match=re.escape(named)):
            prompt(*args)


def test_it_runs_only_where_it_can() -> None:
    bf16 = torch.bfloat16
    assert not cpp_prompt_runs(torch.zeros(2, 4, 32, dtype=bf16), torch.zeros(1, 2, 32, dtype=bf16))
    assert not cpp_prompt_runs(torch.zeros(2, 4, 64, dtype=torch.float16), torch.zeros(1, 2, 64))
    int8 = torch.zeros(1, 2, 64, dtype=torch.int8)
    assert not cpp_prompt_runs(torch.zeros(2, 4, 64, dtype=bf16), int8, (torch.ones(1, 2),) * 2)
    # The results files' line says which ran.
    runs = cpp_prompt_runs(torch.zeros(2, 4, 64, dtype=bf16), torch.zeros(1, 2, 64, dtype=bf16))
    assert ("bfloat16 queries: C++ amx-bf16 tiles" in prompt_paths()) == runs


@pytest.mark.parametrize("hidden", BF16_PROMPT_FEATURES)
def test_hiding_a_feature_it_uses_leaves_it_to_torch(
    hidden: str, fresh_features: pytest.MonkeyPatch
) -> None:
    """``GRAPHRUNNER_CPU_DISABLE`` naming any feature the kernel's code uses
    (the AVX-512 ones as much as AMX's) turns it off: bfloat16 queries go to
    torch's fused attention, and the results files say so."""
    _skip_without_kernel()
    fresh_features.setenv("GRAPHRUNNER_CPU_DISABLE", hidden)
    cpu_features.cache_clear()  # read again under the hidden feature
    bf16 = torch.bfloat16
    assert not cpp_prompt_runs(torch.zeros(2, 4, 64, dtype=bf16), torch.zeros(1, 2, 64, dtype=bf16))
    assert "bfloat16 queries: torch's fused attention" in prompt_paths()
