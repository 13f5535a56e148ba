"""A counter-based random stream: the uniform a request draws is a hash of
(its seed, its position, the draw index), nothing else.

No torch Generator is read or advanced, nothing depends on the batch, the
row, the padded size or what ran before, so a request draws the same numbers
on every runner and device. The hash uses int64 tensor ops only and keeps
every intermediate below ``2**49`` (32-bit words, 32x32-bit products split in
16-bit halves), so no op ever overflows and eager, inductor (CPU) and CUDA
compute the same bits. It allocates no state and never syncs: it captures in
a CUDA graph and compiles.

The mix is murmur3's: each 32-bit word of (seed, position, draw) is folded
into the state with murmur3's block step, then ``fmix32`` finalises.
"""

from __future__ import annotations

import torch

__all__ = ["uniform"]

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
_C1 = 0xCC9E2D51  # murmur3 block constants
_C2 = 0x1B873593
_F1 = 0x85EBCA6B  # fmix32 constants
_F2 = 0xC2B2AE35
_SALT = 0x9E3779B9  # the initial state: the golden ratio's 32 bits


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for ``a`` in ``[0, 2**32)`` without int64 overflow."""
    high = ((a >> 16) * c) & _M16  # only its low 16 bits survive the shift below
    return ((a & _M16) * c + (high << 16)) & _M32


def _rotl32(a: torch.Tensor, r: int) -> torch.Tensor:
    return ((a << r) & _M32) | (a >> (32 - r))


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _F1)
    h = h ^ (h >> 13)
    h = _mul32(h, _F2)
    return h ^ (h >> 16)


def _absorb(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(word, _C1), 15), _C2)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def uniform(seed: torch.Tensor, position: torch.Tensor, draw: int = 0) -> torch.Tensor:
    """Uniform numbers in ``[0, 1)``, one per row, from (seed, position, draw).

    Args:
        seed: int64 ``[n]``, each row's seed (its 64 bits are all used).
        position: int64 ``[n]``, the row's position (token index); any int64.
        draw: which number of the (seed, position) pair, an int in
            ``[0, 2**32)``: distinct draws are independent (e.g. 0 for the
            token, 1 for a speculative residual).

    Returns: float32 ``[n]`` on ``seed``'s device, multiples of ``2**-24`` in
    ``[0, 1 - 2**-24]``, identical on every device and mechanism.
    """
    if isinstance(draw, bool) or not isinstance(draw, int) or not 0 <= draw <= _M32:
        raise ValueError(f"draw={draw!r}; expected an int in [0, 2**32)")
    if seed.dtype != torch.int64 or position.dtype != torch.int64:
        raise TypeError(f"seed and position must be int64, got {seed.dtype} and {position.dtype}")
    words = (
        seed & _M32,
        (seed >> 32) & _M32,  # arithmetic shift: masked, any int64 maps to 32 bits
        position & _M32,
        (position >> 32) & _M32,
    )
    h = torch.full_like(seed, _SALT ^ draw)
    for word in words:
        h = _absorb(h, word)
    h = _fmix32(h ^ 16)  # murmur3 folds in the length in bytes
    return (h >> 8).to(torch.float32) * (2.0**-24)
