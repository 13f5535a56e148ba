"""The Triton rotary + KV write (``kernels/rope_store.py``): equal to the
model's torch ops (``RotaryEmbedding``, ``KVCache.set_kv``), writing only the
rows' own KV slots, a padded row only slot 0; interpreted on the CPU, compiled
on a GPU, and lowered for Hopper with no GPU present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphrunner_ref.model.kernels.rope_store import reference, rope_store
from graphrunner_ref.model.layers import RotaryEmbedding
from graphrunner_ref.model.small_batch import rope_store_op
from hopper import compile_for_hopper

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -3.0
#: (query heads, KV heads, head_dim): grouped, one KV head, a head_dim whose half is no power of 2.
SHAPES = [(4, 2, 16), (2, 1, 8), (3, 3, 12)]


def _world(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows, slots = 5, 12
    rotary = RotaryEmbedding(head_dim, 64, 10000.0)
    width = (heads + 2 * kv_heads) * head_dim
    return {
        "qkv": torch.randn(rows, width, generator=gen).to(DEVICE, dtype),
        "positions": torch.tensor([0, 7, 63, 1, 0], device=DEVICE),
        "out_loc": torch.tensor([3, 9, 4, 11, 0], device=DEVICE),  # the last row padded
        "cos": rotary.cos.to(DEVICE),
        "sin": rotary.sin.to(DEVICE),
        "k_cache": torch.full((slots, kv_heads, head_dim), SENTINEL, device=DEVICE, dtype=dtype),
        "v_cache": torch.full((slots, kv_heads, head_dim), SENTINEL, device=DEVICE, dtype=dtype),
    }


def _run(fn: object, w: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    w = {k: v.clone() for k, v in w.items()}
    q = fn(**w, heads=heads)  # type: ignore[operator]
    return {"q": q, "k": w["k_cache"], "v": w["v_cache"]}


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_kernel_equals_the_models_torch_ops(heads: int, kv_heads: int, head_dim: int) -> None:
    world = _world(heads, kv_heads, head_dim, torch.float32)
    got, want = _run(rope_store, world, heads), _run(reference, world, heads)
    for name in ("q", "k", "v"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)
    written = {3, 9, 4, 11, 0}
    for slot in range(12):  # every other slot keeps what it held
        assert (got["k"][slot] == SENTINEL).all() == (slot not in written), slot
        assert (got["v"][slot] == SENTINEL).all() == (slot not in written), slot


def test_the_model_attention_through_the_reference_equals_rotary_embedding() -> None:
    """The reference is the model's own arithmetic: RotaryEmbedding's q and k."""
    heads, kv_heads, d = SHAPES[0]
    w = _world(heads, kv_heads, d, torch.float32)
    got = _run(reference, w, heads)
    rotary = RotaryEmbedding(d, 64, 10000.0).to(DEVICE)
    q, k, v = w["qkv"].split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_rot, k_rot = rotary(w["positions"], q.reshape(5, heads, d), k.reshape(5, kv_heads, d))
    assert torch.equal(got["q"], q_rot.reshape(5, -1))
    assert torch.equal(got["k"][w["out_loc"][:4]], k_rot[:4])
    assert torch.equal(got["v"][w["out_loc"][:4]], v.reshape(5, kv_heads, d)[:4])


def test_bfloat16_within_a_rounding_of_the_reference() -> None:
    heads, kv_heads, d = SHAPES[0]
    world = _world(heads, kv_heads, d, torch.bfloat16, seed=1)
    got, want = _run(rope_store, world, heads), _run(reference, world, heads)
    # Three roundings (two products, their sum): to nearest on a GPU, truncated
    # by Triton's interpreter; a sum that cancels makes a small output's
    # relative error large, so the bound scales with the inputs' largest.
    rel = 2**-7 if DEVICE == "cuda" else 2**-5
    scale = world["qkv"].float().abs().max().item()
    for name in ("q", "k", "v"):
        g, r = got[name].float(), want[name].float()
        torch.testing.assert_close(g, r, rtol=rel, atol=rel * scale, msg=name)
    assert torch.equal(got["v"], want["v"])  # values are only copied


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN
def test_a_padded_row_never_reaches_a_live_row() -> None:
    heads, kv_heads, d = SHAPES[0]
    clean = _world(heads, kv_heads, d, torch.float32)
    poisoned = {**clean, "qkv": clean["qkv"].clone()}
    poisoned["qkv"][4] = float("nan")  # the padded row (position 0, slot 0)
    got, want = _run(rope_store, poisoned, heads), _run(rope_store, clean, heads)
    assert torch.equal(got["q"][:4], want["q"][:4])
    live = clean["out_loc"][:4]
    assert torch.equal(got["k"][live], want["k"][live])
    assert torch.equal(got["v"][live], want["v"][live])
    assert got["k"][0].isnan().all() and got["q"][4].isnan().all()  # the sink took it


def test_the_op_is_registered_with_a_fake_and_writes_the_caches() -> None:
    heads, kv_heads, d = SHAPES[0]
    w = _world(heads, kv_heads, d, torch.float32)
    args = (w["qkv"], w["positions"], w["out_loc"], w["cos"], w["sin"], w["k_cache"])
    torch.library.opcheck(
        rope_store_op, (*args, w["v_cache"], heads), test_utils=("test_schema", "test_faketensor")
    )
    want = _run(reference, w, heads)
    k, v = w["k_cache"].clone(), w["v_cache"].clone()
    q = rope_store_op(*args[:5], k, v, heads)
    torch.testing.assert_close(q, want["q"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want["k"], rtol=1e-6, atol=1e-6)
    assert torch.equal(v, want["v"])


def test_bad_operands_are_refused_naming_their_shapes() -> None:
    world = _world(4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"rope_store: qkv \(5, 128\) torch.float32, 3 query"):
        rope_store(**world, heads=3)
    bad = {**world, "k_cache": world["k_cache"].double()}
    with pytest.raises(ValueError, match=r"cache \(12, 2, 16\) torch.float64"):
        rope_store(**bad, heads=4)
    bad = {**world, "v_cache": world["v_cache"][:, :1]}
    with pytest.raises(ValueError, match=r"v_cache \(12, 1, 16\)"):
        rope_store(**bad, heads=4)
    bad = {**world, "out_loc": world["out_loc"][:3]}
    with pytest.raises(ValueError, match=r"out_loc \(3,\)"):
        rope_store(**bad, heads=4)


_COMPILE_ROPE = """
    import graphrunner_ref.model.kernels.rope_store as r

    types = ["*bf16", "*i64", "*fp32", "*fp32", "*i64", "*bf16", "*bf16", "*bf16"] + ["i32"] * 7
    for pdl in (False, True):  # the 1.1B shape: 32 query, 4 KV heads of 64
        consts = dict(HEADS=32, KV_HEADS=4, HALF=32, BLOCK=32, PDL=pdl)
        ptx = compile(r._rope_store_kernel, types, consts, "ptx")
        assert programmatic(ptx) == pdl and ("griddepcontrol" in ptx) == pdl
    print("compiled")
"""


def test_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    compile_for_hopper(_COMPILE_ROPE, tmp_path)
