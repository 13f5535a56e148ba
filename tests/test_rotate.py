"""``layers.rotate`` (roll and a signed sin, one elementwise expression) equals
the textbook ``x * cos + rotate_half(x) * sin`` bit for bit, in every dtype
the models run, eagerly and compiled."""

from __future__ import annotations

import pytest
import torch

from graphrunner_ref.model.layers import rotate


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _inputs(dtype: torch.dtype, n: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n * 100 + heads * 10 + dim)
    x = torch.randn(n, heads, dim, generator=gen).to(dtype)
    angles = torch.rand(n, 1, dim, generator=gen) * 6.3
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "heads", "dim"), [(1, 9, 64), (5, 3, 128), (3, 2, 8)])
def test_rotate_equals_rotate_half_bit_for_bit(
    dtype: torch.dtype, n: int, heads: int, dim: int
) -> None:
    x, cos, sin = _inputs(dtype, n, heads, dim)
    assert torch.equal(rotate(x, cos, sin), _rotate_half(x, cos, sin))


def test_rotate_compiled_equals_rotate_half() -> None:
    x, cos, sin = _inputs(torch.float32, 4, 3, 64)
    compiled = torch.compile(rotate, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, cos, sin), _rotate_half(x, cos, sin))
