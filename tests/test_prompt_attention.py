"""The C++ prompt attention (``graphrunner_attention::prompt`` and ``prompt_q8``,
:func:`~graphrunner_ref.model.attention_cpu.cpp_prompt_attention`): one
request's prompt chunk over its slots, token ``i`` of ``n`` reading slots
``0 .. L - n + i``.

The oracle is the same attention in float64 over the same slots read by
:func:`~graphrunner_ref.model.attention_torch.read_kv` (an int8 cache
dequantized), which the kernel and its torch twin
(:func:`~graphrunner_ref.model.attention_torch.torch_prompt_attention`) must
meet within float32 rounding, at every
pass remainder (6 query rows a pass), key tail (64 keys a score pass, 16 a
transposed block) and head size; a token's output must not move when the
keys after its own are poisoned; bad inputs are refused by name.
"""

from __future__ import annotations

import re

import pytest
import torch

from graphrunner.pools import Int8KVCache
from graphrunner_ref.model.attention_cpu import cpp_prompt_attention, cpp_prompt_runs
from graphrunner_ref.model.attention_torch import torch_prompt_attention
from tests.attention_oracle import prompt_oracle

SLOTS = 300

#: (n, L, H, H_kv, D): whole prompts and chunks after a prefix; rows (n * H / H_kv)
#: at each remainder of 6; L below, at and past 16 and 64; head sizes 16 to 128.
CASES = [
    (1, 1, 9, 3, 64),
    (7, 7, 4, 4, 16),
    (5, 21, 8, 2, 32),
    (32, 95, 9, 3, 64),
    (13, 77, 8, 2, 128),
    (64, 64, 2, 1, 48),
    (3, 130, 6, 3, 80),
]


def _skip_without_kernel() -> None:
    probe = torch.zeros(1, 1, 16)
    if not cpp_prompt_runs(probe, torch.zeros(1, 1, 16)):
        pytest.skip("the C++ prompt attention does not run here (it needs AVX-512 and a build)")


def _case(
    n: int, length: int, heads: int, kv_heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(SLOTS, kv_heads, dim, generator=gen)
    v = torch.randn(SLOTS, kv_heads, dim, generator=gen)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:length] + 1  # slot 0 the sink
    return q, k, v, slots


@pytest.mark.parametrize(("n", "length", "heads", "kv_heads", "dim"), CASES)
@pytest.mark.parametrize("cache", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_each_path_meets_the_float64_attention(
    n: int, length: int, heads: int, kv_heads: int, dim: int, cache: torch.dtype, path: str
) -> None:
    """The kernel, and its torch twin (what runs where the kernel does not)."""
    if path == "kernel":
        _skip_without_kernel()
    q, k, v, slots = _case(n, length, heads, kv_heads, dim, seed=n * 31 + length)
    scale = dim**-0.5
    scales = None
    if cache == torch.int8:
        (k, k_scale), (v, v_scale) = Int8KVCache.quantize(k), Int8KVCache.quantize(v)
        scales = (k_scale, v_scale)
    else:
        k, v = k.to(cache), v.to(cache)
    attend = cpp_prompt_attention if path == "kernel" else torch_prompt_attention
    assert cpp_prompt_runs(q, k, scales) or path == "torch"
    got = attend(q, k, v, slots, scale, scales)
    want = prompt_oracle(q, k, v, slots, scale, scales)
    assert got.shape == (n, heads * dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_a_token_never_reads_the_keys_after_its_own() -> None:
    """Poisoning the K and V of every slot after token i's last leaves token
    i's output the same bit for bit (its pass reads no value past its keys)."""
    _skip_without_kernel()
    n, length = 11, 40
    q, k, v, slots = _case(n, length, 6, 2, 32, seed=5)
    clean = cpp_prompt_attention(q, k, v, slots, 0.2)
    assert bool(clean.isfinite().all())
    for i in range(n - 1):
        later = slots[length - n + i + 1 :]
        k2, v2 = k.clone(), v.clone()
        k2[later], v2[later] = float("nan"), float("inf")
        got = cpp_prompt_attention(q, k2, v2, slots, 0.2)
        assert torch.equal(got[: i + 1], clean[: i + 1]), i
        assert not bool(got[i + 1 :].isfinite().all()), i  # the poison is read where it should be


def test_bad_inputs_are_refused_by_name() -> None:
    _skip_without_kernel()
    q, k, v, slots = _case(4, 10, 4, 2, 16, seed=1)
    prompt = torch.ops.graphrunner_attention.prompt
    bad = [
        ((q, k, v, slots[:3], 1.0), "4 query tokens over 3 slots"),
        ((q, k, v, torch.tensor([1, 2, SLOTS, 4, 5]), 1.0), f"slots[2] = {SLOTS} out of range"),
        ((q, k, v, slots.int(), 1.0), "slots must be int64"),
        ((q.double(), k, v, slots, 1.0), "q must be a float32 CPU tensor"),
        ((torch.zeros(4, 3, 16), k, v, slots, 1.0), "expected H a multiple of H_kv"),
        ((q, k, v.half(), slots, 1.0), "k_buf and v_buf must be contiguous"),
    ]
    for args, named in bad:
        with pytest.raises(RuntimeError, match=re.escape(named)):
            prompt(*args)


def test_it_runs_only_where_it_can() -> None:
    q = torch.zeros(2, 4, 24)  # a head size not a multiple of 16
    assert not cpp_prompt_runs(q, torch.zeros(1, 2, 24))
    q = torch.zeros(2, 4, 32)
    assert not cpp_prompt_runs(q.double(), torch.zeros(1, 2, 32))
    assert not cpp_prompt_runs(q, torch.zeros(1, 2, 32, dtype=torch.int8))  # int8 without scales
    assert not cpp_prompt_runs(q, torch.zeros(1, 2, 32), (torch.ones(1, 2), torch.ones(1, 2)))
