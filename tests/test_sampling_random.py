"""The counter-based random stream: a pure function of (seed, position,
draw), equal to a Python-int reference of the same hash, uniform, and
independent of the batch around a row."""

from __future__ import annotations

import math

import torch

from graphrunner.sampling import uniform

M32 = 0xFFFFFFFF


def _rotl(a: int, r: int) -> int:
    return ((a << r) | (a >> (32 - r))) & M32


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_uniform(seed: int, position: int, draw: int) -> float:
    """murmur3 over the 32-bit words of (seed, position), state seeded with
    the golden ratio xor draw, in unbounded Python ints."""
    h = 0x9E3779B9 ^ draw
    for value in (seed, position):
        for word in (value & M32, (value >> 32) & M32):
            k = (_rotl((word * 0xCC9E2D51) & M32, 15) * 0x1B873593) & M32
            h = (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32
    return (_fmix(h ^ 16) >> 8) / 2**24


def test_stream_equals_a_python_int_reference_at_the_extremes():
    seeds = [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1]
    positions = [0, 1, 2**31 - 1, 2**40 + 3, -1, -(2**63)]
    cases = [(s, p, d) for s in seeds for p in positions for d in (0, 1, M32)]
    for draw in (0, 1, M32):
        rows = [(s, p) for s, p, d in cases if d == draw]
        got = uniform(torch.tensor([s for s, _ in rows]), torch.tensor([p for _, p in rows]), draw)
        assert got.dtype == torch.float32
        assert got.tolist() == [reference_uniform(s, p, draw) for s, p in rows]


def test_same_counter_same_number_whatever_the_batch_and_row():
    g = torch.Generator().manual_seed(1)
    seed = torch.randint(0, 2**62, (64,), generator=g)
    position = torch.randint(0, 10_000, (64,), generator=g)
    alone = torch.cat([uniform(seed[i : i + 1], position[i : i + 1]) for i in range(64)])
    perm = torch.randperm(64, generator=g)
    assert torch.equal(uniform(seed, position), alone)
    assert torch.equal(uniform(seed[perm], position[perm]), alone[perm])
    padded_seed = torch.cat([seed, torch.zeros(64, dtype=torch.int64)])
    padded_pos = torch.cat([position, torch.zeros(64, dtype=torch.int64)])
    assert torch.equal(uniform(padded_seed, padded_pos)[:64], alone)
    # A generator is neither read nor advanced.
    state = torch.get_rng_state()
    torch.manual_seed(123)
    assert torch.equal(uniform(seed, position), alone)
    torch.set_rng_state(state)


def test_different_seeds_positions_and_draws_give_different_numbers():
    n = 4096
    base = uniform(torch.zeros(n, dtype=torch.int64), torch.arange(n))
    assert base.unique().numel() > n - 5  # 24-bit values: a rare collision at most
    for other in (
        uniform(torch.ones(n, dtype=torch.int64), torch.arange(n)),
        uniform(torch.full((n,), 2**32, dtype=torch.int64), torch.arange(n)),
        uniform(torch.zeros(n, dtype=torch.int64), torch.arange(n) + 2**32),
        uniform(torch.zeros(n, dtype=torch.int64), torch.arange(n), draw=1),
    ):
        assert (other != base).float().mean() > 0.99
        # and uncorrelated with it
        assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1]) < 0.06


def _chi_square_critical(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty: the chi-square quantile ~1e-6 from the top."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_stream_is_uniform_chi_square_and_ks():
    """Fixed seeds: the same numbers every run, so this cannot flake; a
    biased or short-period stream fails by orders of magnitude."""
    n = 200_000
    for seed, step in ((0, 1), (2**40 + 17, 1), (5, 2**32)):
        u = uniform(torch.full((n,), seed, dtype=torch.int64), torch.arange(n) * step)
        assert float(u.min()) >= 0 and float(u.max()) < 1
        bins = 256
        counts = torch.bincount((u * bins).long(), minlength=bins).double()
        expected = n / bins
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_critical(bins - 1), (seed, chi2)
        ks = float(
            (u.sort().values.double() - torch.arange(n, dtype=torch.float64) / n).abs().max()
        )
        assert ks < 1.95 / math.sqrt(n) * 1.5, (seed, ks)
        # consecutive pairs fill the unit square evenly too
        pairs = (u[0::2] * 16).long() * 16 + (u[1::2] * 16).long()
        pair_counts = torch.bincount(pairs, minlength=256).double()
        e = (n // 2) / 256
        assert float(((pair_counts - e) ** 2 / e).sum()) < _chi_square_critical(255)
    # Seeds varied at a fixed position are uniform as well.
    u = uniform(torch.arange(n), torch.full((n,), 9, dtype=torch.int64))
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    assert float(((counts - n / 64) ** 2 / (n / 64)).sum()) < _chi_square_critical(63)
