"""A CPU step whose live rows are all greedy computes only the argmax.

The filtered draw sorts every row's vocabulary (SmolLM2 at batch 8: 48 ms a
step against the argmax's 0.5 ms). On the CPU :func:`graphrunner.sampling.sample`
skips it when no live row samples: ``torch.cond`` in the compiled program, a
plain ``if`` eagerly. Padded rows (pad temperature 1) must not turn it back
on. Seen through the profiler: the sort runs exactly when a live row samples,
and the tokens are the eager forward's either way.
"""

from __future__ import annotations

import pytest
import torch
from test_padded_sampling import batch_of, eager_rows

from graphrunner.phases.sampled import with_sampling
from graphrunner.sampling import SamplingParams, sample, sampling_tensors
from graphrunner_ref import create_decode_runner, default_model

GREEDY = SamplingParams()
HOT = SamplingParams(temperature=0.9, top_p=0.9)


def _sorts(fn: object) -> tuple[int, object]:
    """How many ``aten::sort`` calls ``fn()`` made, and what it returned."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()  # type: ignore[operator]
    return sum(e.name == "aten::sort" for e in prof.events()), out


@pytest.mark.parametrize("kind", ["eager", "cpu"])
@pytest.mark.parametrize(
    ("params", "sorted_expected"),
    [((GREEDY, GREEDY), False), ((GREEDY, HOT), True)],
    ids=["greedy", "one-samples"],
)
def test_the_draw_runs_only_when_a_live_row_samples(
    kind: str, params: tuple[SamplingParams, ...], sorted_expected: bool
) -> None:
    bundle = default_model(max_requests=8, max_context_len=64)
    runner = create_decode_runner(bundle, kind, capture_sizes=[3], sampling=True)
    runner.capture()
    batch, _ = batch_of(bundle, len(params), seed=3)  # 2 live rows, 1 padded
    rows = sampling_tensors(list(params), [11, 12], "cpu")
    expected = eager_rows(bundle, batch, rows)
    sorts, out = _sorts(lambda: runner.replay(with_sampling(batch, rows)))
    assert (sorts > 0) == sorted_expected, f"{kind}: {sorts} sorts for {params}"
    assert isinstance(out, dict)
    for i, want in enumerate(expected):
        assert int(out["tokens"][i]) == int(want["tokens"][0]), f"{kind}: row {i}"


def test_rows_not_live_do_not_make_a_greedy_batch_draw() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0.0, 0.0, 1.0])  # the last row padded, at temperature 1
    top_k, top_p, min_p = torch.tensor([0, 0, 1]), torch.ones(3), torch.zeros(3)
    seed, position = torch.tensor([1, 2, 0]), torch.tensor([4, 5, 0])
    args = (logits, temperature, top_k, top_p, min_p, seed, position)
    live = torch.tensor([True, True, False])
    sorts, tokens = _sorts(lambda: sample(*args, live=live))
    assert sorts == 0
    assert torch.equal(tokens, logits.argmax(-1))  # type: ignore[arg-type]
    sorts, tokens = _sorts(lambda: sample(*args))  # every row live: the last one draws
    assert sorts == 1
    assert torch.equal(tokens[:2], logits[:2].argmax(-1))  # type: ignore[index]
