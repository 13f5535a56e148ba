"""The C++ rotary + KV write (``graphrunner_attention::rope_store``,
:func:`~graphrunner_ref.model.attention_cpu.cpp_rope_store`): equal bit for
bit to the model's torch ops (``kernels/rope_store.py``'s ``reference``),
into a float32 or a float16 cache, writing only the rows' own KV slots, a padded row only slot 0; refusing a bad
row or operand by name before writing anything; taken by a float32 CPU
model's attention (a rotary that rotates otherwise keeps the torch ops), and
called in place from a compiled program."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from graphrunner_ref.model.attention_cpu import (
    cpp_attention_status,
    cpp_rope_store,
    cpp_rope_store_runs,
)
from graphrunner_ref.model.kernels.rope_store import reference
from graphrunner_ref.model.layers import RotaryEmbedding

SENTINEL = -3.0
ROWS, SLOTS, POSITIONS = 6, 16, 96
#: (query heads, KV heads, head_dim): SmolLM2's, grouped with a half of 8s
#: and a tail, one KV head, a half below one vector, and 2.
SHAPES = [(9, 3, 64), (4, 2, 20), (2, 1, 8), (3, 3, 12), (1, 1, 2)]
LOC = [3, 9, 4, 15, 0, 0]  # the last two rows padded: slot 0, position 0
POS = [1, 7, 95, 40, 0, 0]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    why = cpp_attention_status()
    if why is not None:
        pytest.skip(f"the C++ kernels cannot run here: {why}")


def _world(
    heads: int, kv_heads: int, dim: int, seed: int = 0, kv_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(dim, POSITIONS, 10000.0)
    width = (heads + 2 * kv_heads) * dim
    return {
        # wide values: the products' roundings differ from a fused multiply-add's
        "qkv": torch.randn(ROWS, width, generator=gen) * 100,
        "positions": torch.tensor(POS),
        "out_loc": torch.tensor(LOC),
        "cos": rotary.cos,
        "sin": rotary.sin,
        "k_cache": torch.full((SLOTS, kv_heads, dim), SENTINEL, dtype=kv_dtype),
        "v_cache": torch.full((SLOTS, kv_heads, dim), SENTINEL, dtype=kv_dtype),
    }


def _run(fn: object, w: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    w = {k: v.clone() for k, v in w.items()}
    q = fn(**w, heads=heads)  # type: ignore[operator]
    return {"q": q, "k": w["k_cache"], "v": w["v_cache"]}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
def test_it_equals_the_models_torch_ops_bit_for_bit(
    heads: int, kv_heads: int, dim: int, kv_dtype: torch.dtype
) -> None:
    """A float16 cache: each key and value rounded as ``.to(torch.float16)`` rounds."""
    world = _world(heads, kv_heads, dim, kv_dtype=kv_dtype)
    got, want = _run(cpp_rope_store, world, heads), _run(reference, world, heads)
    assert torch.equal(got["q"], want["q"])
    live = torch.tensor(LOC[:4])
    assert torch.equal(got["k"][live], want["k"][live])
    assert torch.equal(got["v"][live], want["v"][live])
    for slot in range(SLOTS):  # every other slot keeps what it held
        untouched = slot not in LOC
        assert bool((got["k"][slot] == SENTINEL).all()) == untouched, slot
        assert bool((got["v"][slot] == SENTINEL).all()) == untouched, slot


def test_a_rows_values_are_the_same_alone_and_in_a_batch() -> None:
    heads, kv_heads, dim = SHAPES[0]
    world = _world(heads, kv_heads, dim, seed=1)
    batch = _run(cpp_rope_store, world, heads)
    for m in range(4):
        one = {**world, **{k: world[k][m : m + 1] for k in ("qkv", "positions", "out_loc")}}
        alone = _run(cpp_rope_store, one, heads)
        assert torch.equal(alone["q"][0], batch["q"][m]), m
        assert torch.equal(alone["k"][LOC[m]], batch["k"][LOC[m]]), m


def test_a_padded_row_never_reaches_a_live_row() -> None:
    heads, kv_heads, dim = SHAPES[0]
    clean = _world(heads, kv_heads, dim)
    poisoned = {**clean, "qkv": clean["qkv"].clone()}
    poisoned["qkv"][4:] = float("nan")
    got, want = _run(cpp_rope_store, poisoned, heads), _run(cpp_rope_store, clean, heads)
    assert torch.equal(got["q"][:4], want["q"][:4])
    live = torch.tensor(LOC[:4])
    assert torch.equal(got["k"][live], want["k"][live])
    assert torch.equal(got["v"][live], want["v"][live])
    assert got["k"][0].isnan().all() and got["v"][0].isnan().all()  # the sink took them


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("positions", 96, r"positions\[5\] = 96 out of range \[0, 96\)"),
        ("positions", -1, r"positions\[5\] = -1 out of range \[0, 96\)"),
        ("out_loc", 16, r"out_loc\[5\] = 16 out of range \[0, 16\)"),
    ],
)
def test_an_out_of_range_row_is_refused_by_name_before_any_write(
    field: str, value: int, message: str
) -> None:
    world = _world(2, 1, 8)
    world[field][5] = value
    k, v = world["k_cache"].clone(), world["v_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        cpp_rope_store(**{**world, "k_cache": k, "v_cache": v}, heads=2)
    assert (k == SENTINEL).all() and (v == SENTINEL).all()  # rows 0-4 were not written either


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"heads": 3}, r"qkv must be float32 CPU \[M, 40\] \(\(H \+ 2 H_kv\) D for H = 3"),
        ({"k_cache": torch.zeros(SLOTS, 1, 8, dtype=torch.float64)}, r"float32 or float16.*Double"),
        ({"k_cache": torch.zeros(SLOTS, 1, 7)}, r"k_cache must be .*D even"),
        ({"v_cache": torch.zeros(SLOTS, 2, 8)}, r"v_cache must be contiguous Float \[16, 1, 8\]"),
        ({"v_cache": torch.zeros(SLOTS, 1, 8).half()}, r"v_cache must be contiguous Float .* Half"),
        ({"sin": torch.zeros(POSITIONS, 6)}, r"cos and sin must be float32 CPU \[positions, 8\]"),
        ({"out_loc": torch.tensor([1, 2])}, r"positions and out_loc must be int64 CPU \[6\]"),
        ({"positions": torch.tensor(POS, dtype=torch.int32)}, r"must be int64"),
    ],
)
def test_a_bad_operand_is_refused_by_name(change: dict[str, object], message: str) -> None:
    world: dict[str, object] = {**_world(2, 1, 8), "heads": 2, **change}
    with pytest.raises(RuntimeError, match=message):
        cpp_rope_store(**world)  # type: ignore[arg-type]


def test_it_runs_for_float32_rows_into_a_float32_or_float16_cache_only() -> None:
    world = _world(2, 1, 8)
    qkv, cache = world["qkv"], world["k_cache"]
    assert cpp_rope_store_runs(qkv, cache) and cpp_rope_store_runs(qkv, cache.half())
    assert not cpp_rope_store_runs(qkv.bfloat16(), cache.bfloat16())
    assert not cpp_rope_store_runs(qkv, cache.bfloat16())
    assert not cpp_rope_store_runs(qkv.half(), cache.half())


def test_compiled_it_is_called_in_place_on_the_caches() -> None:
    heads, kv_heads, dim = SHAPES[0]
    world = _world(heads, kv_heads, dim)
    want = _run(reference, world, heads)
    k, v = world["k_cache"].clone(), world["v_cache"].clone()
    args = (world["qkv"], world["positions"], world["out_loc"], world["cos"], world["sin"])

    def step(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return cpp_rope_store(*args, k_cache, v_cache, heads) * 2.0

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    q, code = run_and_get_code(compiled, k, v)
    assert torch.equal(q, want["q"] * 2.0)
    assert torch.equal(k, want["k"]) and torch.equal(v, want["v"])
    text = "\n".join(code)
    assert "graphrunner_attention.rope_store" in text
    assert "clone" not in text and "copy_" not in text  # the caches passed straight in


def _greedy_and_caches(monkeypatch: pytest.MonkeyPatch, fused: bool) -> tuple[object, list]:
    from conftest import eager_greedy
    from graphrunner_ref.model import default_model

    monkeypatch.setattr(RotaryEmbedding, "table_rotation", fused)
    bundle = default_model(max_requests=4, max_context_len=32)
    tokens = eager_greedy(bundle)
    kv = bundle.kv_cache
    return tokens, [t.clone() for t in (*kv.k_buffers, *kv.v_buffers)]


def test_a_float32_cpu_model_takes_it_with_the_same_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import graphrunner_ref.model.attention as attention

    calls: list[int] = []
    monkeypatch.setattr(
        attention, "cpp_rope_store", lambda *a: calls.append(1) or cpp_rope_store(*a)
    )
    fused_tokens, fused_caches = _greedy_and_caches(monkeypatch, True)
    assert calls  # every layer of every step and prompt took the op
    calls.clear()
    torch_tokens, torch_caches = _greedy_and_caches(monkeypatch, False)
    assert not calls  # a rotary that says it rotates otherwise keeps the torch ops
    assert fused_tokens == torch_tokens
    for fused, plain in zip(fused_caches, torch_caches, strict=True):
        assert torch.equal(fused, plain)  # every key and value written, bit for bit
