"""A step's prompt chunks trimmed to a captured token size where padding
them up would compute more than it defers (``scheduler.fit_captured``), and
an engine whose steps are trimmed so gives the tokens of one that is not."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphrunner_ref.engine.bundle import create_token_runner
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.scheduler import fit_captured
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import default_model

SIZES = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def _total(chunks: list[Any]) -> int:
    return sum(end - start for _, start, end in chunks)


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        ([1056], [(0, 1024)]),  # 2,048 padded would compute 992 tokens of nothing
        ([1500], [(0, 1024)]),  # 548 wasted against 476 deferred
        ([1900], [(0, 1900)]),  # 148 wasted against 876 deferred: run it padded
        ([1024], [(0, 1024)]),  # a captured size
        ([3000], [(0, 3000)]),  # above the largest: eager, unpadded
        ([3], [(0, 3)]),  # below the smallest
        ([10], [(0, 10)]),  # 6 padded tokens: not worth a step
        ([600, 300, 200], [(0, 600), (0, 300), (0, 124)]),  # 1,100 to 1,024: the last cut
        ([1000, 30, 20], [(0, 1000), (0, 24)]),  # 1,050 to 1,024: the last dropped
    ],
)
def test_a_step_just_above_a_size_is_trimmed_to_it(
    lengths: list[int], expected: list[tuple[int, int]]
) -> None:
    chunks: list[Any] = [(f"r{i}", 0, n) for i, n in enumerate(lengths)]
    fitted = fit_captured(chunks, SIZES)
    assert [(s, e) for _, s, e in fitted] == expected
    assert [r for r, _, _ in fitted] == [r for r, _, _ in chunks[: len(fitted)]]


def test_chunks_resume_where_a_trimmed_one_stopped() -> None:
    chunks: list[Any] = [("a", 100, 1156)]  # a prompt's second chunk
    assert fit_captured(chunks, SIZES) == [("a", 100, 1124)]
    assert fit_captured([("a", 0, 300)], SIZES) == [("a", 0, 256)]  # 212 saved
    assert fit_captured([("a", 0, 300)], SIZES, min_saving=300) == [("a", 0, 300)]
    assert _total(fit_captured([("a", 1124, 1156)], SIZES)) == 32


def _run(trace: list[Request], tokens: bool, trim: bool) -> tuple[dict[int, list[int]], int]:
    """The trace's tokens, and the padded tokens its token batches computed."""
    bundle = default_model(max_requests=4, max_context_len=128)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    token_runner = None
    if tokens:
        token_runner = create_token_runner(bundle, "eager", 48, capture_sizes=[16, 32, 64])
        token_runner.capture()
    engine = Engine(bundle, runner, max_num_batched_tokens=48, token_runner=token_runner)
    engine.scheduler.min_trim = 1  # any saving, at these small sizes
    if not trim:
        engine.scheduler.token_sizes = ()
    result = engine.run(trace)
    padded = 0 if token_runner is None else token_runner.stats.padded_rows
    return result.outputs, padded


def test_trimmed_steps_give_the_tokens_of_eager_chunks_and_pad_less() -> None:
    """Prompts of 20 to 45 tokens, a budget of 48 and token sizes 16, 32,
    64: steps of 33 to 47 chunk tokens are trimmed to 32. The answers equal
    an engine's whose chunks run eagerly, and one's whose steps are padded
    up untrimmed, which pads more."""
    gen = torch.Generator().manual_seed(7)
    trace = [
        Request(i, tuple(torch.randint(3, 250, (n,), generator=gen).tolist()), 6, arrival_step=i)
        for i, n in enumerate((20, 45, 33, 38, 27))
    ]
    eager, _ = _run(trace, tokens=False, trim=False)
    trimmed, less = _run(trace, tokens=True, trim=True)
    padded, more = _run(trace, tokens=True, trim=False)
    assert trimmed == eager == padded
    assert less < more, (less, more)
