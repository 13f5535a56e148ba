"""Repetition, presence and frequency penalties and logit bias inside the
sampled step, against a plain torch reference of vLLM's formulas written here.

The reference (:func:`reference`) takes a row's logits, its prompt and its
output so far: the bias is added; a token seen in the prompt or the output
has a positive logit divided by the repetition penalty and a negative one
multiplied; then ``frequency * count`` and ``presence * (count > 0)`` of the
output are subtracted. The step must pick the token the sampler picks from
those logits, alone and in a padded batch beside neutral rows, on the eager
and the compiled CPU runner; the counts table must hold each live row's own
tokens, and row 0 (padding) and a bystander's row must never change.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest
import torch

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.phases.sampled import with_sampling
from graphrunner.sampling import (
    MAX_LOGIT_BIAS,
    PENALTY_FIELDS,
    SamplingParams,
    TokenCounts,
    penalize,
    penalty_tensors,
    sample,
    sampling_tensors,
)
from graphrunner_ref import create_decode_runner, default_model

#: The neutral pad of every penalty buffer (written here, not read from the specs).
NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias_ids": 0,
    "logit_bias_values": 0.0,
    "hold_until": 0,  # min_tokens: nothing held
    "hold_ids": 0,
}
CTX = 64
STEPS = 6
POISON_COUNT = 7  # row 0 and the bystander's row hold this before the run

#: Penalized rows and their neutral neighbours, cycled over a batch.
PARAMS = (
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(),
    SamplingParams(frequency_penalty=1.5, presence_penalty=0.7),
    SamplingParams(temperature=0.9, repetition_penalty=0.6, presence_penalty=-1.0),
    SamplingParams(logit_bias={3: 100.0, 9: -100.0, 17: 4.5}),
)


def reference(
    logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], p: SamplingParams
) -> torch.Tensor:
    """vLLM's penalties and OpenAI's logit bias on one row's ``logits [V]``."""
    x = logits.to(torch.float32).clone()
    for token, bias in dict(p.logit_bias).items():
        x[token] += bias
    vocab = x.shape[0]
    count = torch.bincount(torch.tensor(list(output), dtype=torch.int64), minlength=vocab)
    seen = count > 0
    seen[list(prompt)] = True
    r = p.repetition_penalty
    penalized = torch.where(x > 0, x / r, x * r)
    x = torch.where(seen, penalized, x)
    x = x - p.frequency_penalty * count.to(torch.float32)
    return x - p.presence_penalty * (count > 0).to(torch.float32)


def expected_token(
    logits: torch.Tensor,
    prompt: Sequence[int],
    output: Sequence[int],
    p: SamplingParams,
    seed: int,
    position: int,
) -> int:
    """The sampler's token on the reference's logits (greedy: their argmax)."""
    x = reference(logits, prompt, output, p).view(1, -1)
    t = torch.tensor
    return int(
        sample(
            x,
            t([p.temperature]),
            t([p.top_k]),
            t([p.top_p]),
            t([p.min_p]),
            t([seed]),
            t([position]),
        )[0]
    )


def test_penalize_equals_the_reference_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 50, len(PARAMS)
    counts = TokenCounts(rows + 1, vocab, "cpu")
    logits = torch.randn(rows, vocab, generator=gen) * 3
    prompts, outputs = [], []
    for r in range(1, rows + 1):
        prompt = torch.randint(vocab, (6,), generator=gen).tolist()
        output = torch.randint(vocab, (9,), generator=gen).tolist()
        counts.reset(r, prompt)
        counts.record(torch.full((9,), r), torch.tensor(output))
        prompts.append(prompt)
        outputs.append(output)
    got = penalize(logits, counts, torch.arange(1, rows + 1), penalty_tensors(PARAMS, "cpu"))
    for i, p in enumerate(PARAMS):
        want = reference(logits[i], prompts[i], outputs[i], p)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)
    assert torch.equal(got[1], logits[1])  # a neutral row: unchanged, bit for bit


def test_record_adds_nothing_at_row_zero() -> None:
    counts = TokenCounts(4, 10, "cpu")
    counts.counts[0].fill_(POISON_COUNT)
    counts.record(torch.tensor([0, 2, 0, 2]), torch.tensor([5, 5, 1, 5]))
    assert torch.equal(counts.counts[0], torch.full((10,), POISON_COUNT, dtype=torch.int32))
    assert counts.counts[2, 5] == 2 and counts.counts.sum() == 2 + 10 * POISON_COUNT


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
    ],
)
def test_bad_values_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={300: 1.0}).check_vocab(256)


_RUNNERS: dict[str, object] = {}


def runner_of(kind: str) -> tuple[object, object]:
    if kind not in _RUNNERS:
        bundle = default_model(max_requests=8, max_context_len=CTX)
        runner = create_decode_runner(
            bundle, kind, capture_sizes=[4], sampling=True, penalties=True
        )
        runner.capture()
        _RUNNERS[kind] = (bundle, runner)
    return _RUNNERS[kind]  # type: ignore[return-value]


def poison_tails(runner: object, raw_bs: int) -> None:
    """The penalty buffers' padded rows: NaN and huge values (populate must
    write the neutral pads over them)."""
    bufs = runner.buffers  # type: ignore[attr-defined]
    for spec in PENALTY_FIELDS:
        tail = bufs.tensors[spec.name][raw_bs:]
        tail.fill_(float("nan") if tail.is_floating_point() else 2**40)


@pytest.mark.parametrize("kind", ["eager", "cpu"])
@pytest.mark.parametrize("raw_bs", [1, 3])
def test_step_picks_the_reference_token_and_counts_only_its_own_rows(
    kind: str, raw_bs: int
) -> None:
    bundle, runner = runner_of(kind)
    counts: TokenCounts = runner.phase.token_counts  # type: ignore[attr-defined]
    bundle.req_pool.clear()  # type: ignore[attr-defined]
    bundle.kv_alloc.clear()  # type: ignore[attr-defined]
    vocab = bundle.config.vocab_size  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(raw_bs)
    bystander = bundle.req_pool.alloc(1)[0]  # type: ignore[attr-defined]
    counts.counts[0].fill_(POISON_COUNT)
    counts.counts[bystander].fill_(POISON_COUNT)
    params = [PARAMS[(raw_bs + i) % len(PARAMS)] for i in range(raw_bs)]
    if raw_bs == 1:
        params = [PARAMS[0]]
    seeds = [11 * i + 3 for i in range(raw_bs)]
    rows, prompts, outputs, lens = [], [], [], []
    with torch.no_grad():
        for i in range(raw_bs):
            row = bundle.req_pool.alloc(1)[0]  # type: ignore[attr-defined]
            prompt = torch.randint(vocab, (5 + 3 * i,), generator=gen)
            slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)))  # type: ignore[attr-defined]
            first = bundle.model.forward_extend(row, prompt, slots)  # type: ignore[attr-defined]
            counts.reset(row, prompt.tolist())
            token = expected_token(first, prompt.tolist(), [], params[i], seeds[i], len(prompt))
            counts.record(torch.tensor([row]), torch.tensor([token]))
            rows.append(row)
            prompts.append(prompt.tolist())
            outputs.append([token])
            lens.append(len(prompt))
    sampling = sampling_tensors(params, seeds, "cpu") | penalty_tensors(params, "cpu")
    for step in range(STEPS):
        batch = DecodeBatch.from_requests(
            rows, lens, torch.tensor([o[-1] for o in outputs]), device="cpu", max_context_len=CTX
        )
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)  # type: ignore[attr-defined]
        poison_tails(runner, raw_bs)
        out = runner.replay(with_sampling(batch, sampling))  # type: ignore[attr-defined]
        for i in range(raw_bs):
            want = expected_token(
                out["logits"][i], prompts[i], outputs[i], params[i], seeds[i], lens[i] + 1
            )
            assert int(out["tokens"][i]) == want, f"{kind} bs {raw_bs} step {step} row {i}"
            outputs[i].append(want)
            lens[i] += 1
        for spec in PENALTY_FIELDS:
            tail = runner.buffers.tensors[spec.name][raw_bs:4]  # type: ignore[attr-defined]
            assert torch.equal(tail, torch.full_like(tail, NEUTRAL[spec.name])), spec.name
    for i, row in enumerate(rows):
        want = torch.bincount(torch.tensor(outputs[i]), minlength=vocab).to(torch.int32)
        assert torch.equal(counts.counts[row], want), f"row {row}'s counts"
    poisoned = torch.full((vocab,), POISON_COUNT, dtype=torch.int32)
    assert torch.equal(counts.counts[0], poisoned), "row 0 (padding) was written"
    assert torch.equal(counts.counts[bystander], poisoned), "a row outside the batch was written"
    assert any(p.penalized for p in params)


def test_a_saved_penalized_step_applies_penalties_in_process_and_counts(tmp_path) -> None:
    """A penalized step skips the penalties' pass where no live row needs
    it (torch.cond), which a saved program cannot hold: ``aot_cache`` saves
    its model (then loads it), the sampler with its penalties runs after it
    in process, counts into the table and draws the same token at every start."""
    outs = []
    for status in ("built (none saved)", "loaded"):
        bundle = default_model(max_requests=4, max_context_len=CTX)
        runner = create_decode_runner(
            bundle, "cpu", capture_sizes=[2], sampling=True, penalties=True, aot_cache=tmp_path
        )
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            runner.capture()
        refused = [str(w.message) for w in said if "aot_cache" in str(w.message)]
        assert not refused, refused
        assert runner.mechanism.aot_status == f"{status}; the tail in process"
        counts = runner.phase.token_counts
        row = bundle.req_pool.alloc(1)[0]
        counts.reset(row, [5, 5])
        slots = torch.tensor(bundle.kv_alloc.alloc(2))
        first = int(bundle.model.forward_extend(row, torch.tensor([5, 5]), slots).argmax())
        batch = DecodeBatch.from_requests(
            [row], [2], torch.tensor([first]), device="cpu", max_context_len=CTX
        )
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
        params = [SamplingParams(repetition_penalty=1.5, logit_bias={3: 9.0})]
        rows = sampling_tensors(params, [0], "cpu") | penalty_tensors(params, "cpu")
        out = runner.replay(with_sampling(batch, rows))
        outs.append(int(out["tokens"][0]))
        assert int(counts.counts[row].sum()) == 1 and counts.counts[row, outs[-1]] == 1
    assert outs[0] == outs[1]
