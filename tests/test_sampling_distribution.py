"""Drawn frequencies against probabilities computed independently (by
transformers' warpers), for each filter alone and combined, eager and
compiled: chi-square on >= 10,000 draws per case, fixed seeds, so a run
cannot flake and a wrong filter fails by orders of magnitude."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from test_sampling_sample import hf_probs, random_mix

from graphrunner.sampling import filtered_probs, sample, uniform

I64 = torch.int64
LOGITS = torch.tensor([2.0, 1.6, 0.7, 0.3, 0.2, 0.1, -0.3, -1.0])
#: (temperature, top_k, top_p, min_p) per case, each filter alone then combined.
#: Top-p and min-p each keep a prefix of the sorted tokens and min-p's
#: threshold is relative, so the combined case can show only one of them
#: binding; it is top-p here, over what top-k kept (the order shows).
CASES = {
    "plain": (1.0, 0, 1.0, 0.0),
    "temperature": (0.6, 0, 1.0, 0.0),
    "top_k": (1.0, 4, 1.0, 0.0),
    "top_p": (1.0, 0, 0.7, 0.0),
    "min_p": (1.0, 0, 1.0, 0.15),
    "combined": (1.5, 6, 0.9, 0.1),
    "greedy": (0.0, 0, 0.5, 0.2),
}
DRAWS = 20_000


def _batch() -> tuple[torch.Tensor, ...]:
    """Every case's DRAWS rows in one batch: the same logits, the case's
    parameters and seed, positions 0..DRAWS-1 (independent draws)."""
    params = torch.tensor(list(CASES.values())).repeat_interleave(DRAWS, dim=0)
    n = params.shape[0]
    seed = (torch.arange(len(CASES)) * 1_000_003 + 42).repeat_interleave(DRAWS)
    position = torch.arange(DRAWS).repeat(len(CASES))
    return (
        LOGITS.expand(n, -1).contiguous(),
        params[:, 0].contiguous(),
        params[:, 1].to(I64),
        params[:, 2].contiguous(),
        params[:, 3].contiguous(),
        seed,
        position,
    )


def _step(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seed, position = args[-2:]
    return sample(*args), uniform(seed, position, 1)


def chi_square_critical(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty: the chi-square quantile ~1e-6 from the top."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, where: str) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    n = tokens.numel()
    support = probs > 0
    assert (counts[~support] == 0).all(), f"{where}: drew filtered tokens {counts}"
    if int(support.sum()) == 1:
        return
    expected = probs[support].double() * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    critical = chi_square_critical(int(support.sum()) - 1)
    assert chi2 < critical, f"{where}: chi2 {chi2:.1f} >= {critical:.1f}; {counts / n} vs {probs}"


@pytest.fixture(scope="module")
def drawn() -> Iterator[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(tokens, draw-1 uniforms) of the batch, eager and compiled (one compile)."""
    batch = _batch()
    # fullgraph: a graph break (a branch on data, a sync) fails the compile.
    compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] = torch.compile(
        _step, dynamic=False, fullgraph=True
    )
    yield {"eager": _step(*batch), "compile": compiled(*batch)}


@pytest.mark.parametrize("mechanism", ["eager", "compile"])
def test_frequencies_follow_each_filter_alone_and_combined(drawn, mechanism):
    tokens, _ = drawn[mechanism]
    for i, (name, params) in enumerate(CASES.items()):
        probs = hf_probs(LOGITS, *params)
        assert_follows(tokens[i * DRAWS : (i + 1) * DRAWS], probs, f"{mechanism} {name}")


def test_compiled_stream_and_tokens_equal_eager(drawn):
    eager_tokens, eager_u = drawn["eager"]
    tokens, u = drawn["compile"]
    assert torch.equal(u, eager_u)  # integer ops only: the same bits
    assert torch.equal(tokens, eager_tokens)


def test_the_cases_are_distinguishable():
    """Each filter changes the distribution of this logits row, and in the
    combined case the temperature, top-k, top-p and their order all show
    (top-p over what top-k kept keeps fewer than top-p then top-k)."""
    dists = [hf_probs(LOGITS, *params) for params in CASES.values()]
    for i in range(len(dists)):
        for j in range(i):
            assert (dists[i] - dists[j]).abs().max() > 0.05
    t, k, p, m = CASES["combined"]
    combined = dists[list(CASES).index("combined")]
    p_first = hf_probs(hf_probs(LOGITS / t, 1.0, 0, p, 0.0).log(), 1.0, k, 1.0, m)
    for other in (p_first, hf_probs(LOGITS, 1.0, k, p, m), hf_probs(LOGITS, t, 0, p, m)):
        assert (other - combined).abs().max() > 0.05
    assert (hf_probs(LOGITS, t, k, 1.0, m) - combined).abs().max() > 0.05


def test_compiled_sampler_matches_eager_on_a_larger_bf16_mix():
    logits, t, k, p, m = random_mix(64, 1000, 9)
    logits = logits.to(torch.bfloat16)
    seed, position = torch.arange(64) * 31, torch.arange(64) + 1000
    compiled = torch.compile(filtered_probs, dynamic=False)
    assert torch.allclose(compiled(logits, t, k, p, m), filtered_probs(logits, t, k, p, m))
    eager = sample(logits, t, k, p, m, seed, position)
    assert torch.equal(
        torch.compile(sample, dynamic=False)(logits, t, k, p, m, seed, position), eager
    )


@pytest.mark.cuda
def test_cuda_stream_equals_cpu_and_the_sampler_captures_in_a_cuda_graph():
    batch = [x.cuda() for x in _batch()]
    _, cpu_u = _step(*_batch())
    eager_tokens, u = _step(*batch)
    assert torch.equal(u.cpu(), cpu_u)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _step(*batch)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out_tokens, out_u = _step(*batch)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_tokens, eager_tokens) and torch.equal(out_u, u)
    for i, (name, params) in enumerate(CASES.items()):
        probs = hf_probs(LOGITS, *params)
        assert_follows(out_tokens[i * DRAWS : (i + 1) * DRAWS].cpu(), probs, f"cuda graph {name}")
