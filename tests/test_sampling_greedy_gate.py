"""A CPU step whose live rows are all greedy computes only the argmax.

The filtered draw sorts every row's vocabulary (SmolLM2 at batch 8: 48 ms a
step against the argmax's 0.5 ms). On the CPU :func:`graphrunner.sampling.sample`
skips it when no live row samples: ``torch.cond`` in the compiled program, a
plain ``if`` eagerly. Padded rows (pad temperature 1) must not turn it back
on. Seen through the profiler: the sort runs exactly when a live row samples,
and the tokens are the eager forward's either way.
"""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("needs", ["none", "penalty", "bias", "hold", "bitmask"])
def test_each_logits_pass_runs_only_for_a_live_row_that_needs_it(
    monkeypatch: pytest.MonkeyPatch, needs: str
) -> None:
    """Rows 1 and 2 live, the third padded (request row 0) and given every
    processor's work: only a live row's need runs a pass, and the live rows'
    logits equal every pass run unconditionally."""
    from types import SimpleNamespace

    import graphrunner.sampling.processors as processors
    from graphrunner.sampling import TokenCounts, penalty_tensors

    vocab = 40
    counts = TokenCounts(4, vocab, "cpu")
    counts.reset(1, [3, 4])
    counts.reset(2, [5])
    hot = SamplingParams(presence_penalty=1.5, logit_bias={7: 2.0})
    live_params = {
        "penalty": SamplingParams(presence_penalty=1.5),
        "bias": SamplingParams(logit_bias={7: 2.0}),
    }.get(needs, SamplingParams())
    params = [SamplingParams(), live_params, hot]
    held = (9, [9])  # the end token 9 held until position 9
    holds = [(0, []), held if needs == "hold" else (0, []), held]
    b = SimpleNamespace(**penalty_tensors(params, "cpu", holds))
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[2, 0] = 0  # the padded row's grammar forbids tokens 0-31
    if needs == "bitmask":
        bitmask[1, 1] = 0
    rows, position = torch.tensor([1, 2, 0]), torch.tensor([5, 6, 5])
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))

    calls: list[str] = []
    for name in ("penalize", "hold_end_tokens", "apply_token_bitmask"):
        real = getattr(processors, name)
        monkeypatch.setattr(processors, name, _counted(real, name, calls))
    live = torch.tensor([True, True, False])
    out = processors.process_logits(logits, b, rows, position, counts, bitmask, live=live)
    expected = {"none": [], "penalty": ["penalize"], "bias": ["penalize"]}
    expected |= {"hold": ["hold_end_tokens"], "bitmask": ["apply_token_bitmask"]}
    assert calls == expected[needs]
    from graphrunner.sampling import apply_token_bitmask, hold_end_tokens, penalize

    full = apply_token_bitmask(
        hold_end_tokens(penalize(logits, counts, rows, b), position, b), bitmask
    )
    assert torch.equal(out[:2], full[:2])


def _counted(real: object, name: str, calls: list[str]) -> object:
    def call(*args: object) -> object:
        calls.append(name)
        return real(*args)  # type: ignore[operator]

    return call


@pytest.mark.parametrize("params", [(GREEDY, GREEDY), (GREEDY, HOT)], ids=["greedy", "one-samples"])
def test_a_saved_sampled_step_saves_the_model_and_samples_after_it(
    tmp_path: Path, params: tuple[SamplingParams, ...]
) -> None:
    """A saved program cannot branch (torch 2.13's export of ``torch.cond``),
    and saved whole the sampled step would sort every row every step: its
    model is saved and loaded, its sampler runs after it in process. Built,
    then loaded as a restart would: the sort runs exactly when a live row
    samples, and the tokens are the eager forward's."""
    bundle = default_model(max_requests=8, max_context_len=64)
    batch, _ = batch_of(bundle, len(params), seed=3)  # 2 live rows, 1 padded
    rows = sampling_tensors(list(params), [11, 12], "cpu")
    expected = eager_rows(bundle, batch, rows)
    for status in ("built (none saved)", "loaded"):
        runner = create_decode_runner(
            bundle, "cpu", capture_sizes=[3], sampling=True, aot_cache=tmp_path / "aot"
        )
        runner.capture()
        assert runner.mechanism.aot_status == f"{status}; the tail in process"
        sorts, out = _sorts(lambda r=runner: r.replay(with_sampling(batch, rows)))
        assert (sorts > 0) == (HOT in params), f"{status}: {sorts} sorts for {params}"
        assert isinstance(out, dict)
        for i, want in enumerate(expected):
            assert int(out["tokens"][i]) == int(want["tokens"][0]), f"{status}: row {i}"
