"""A grammar's token bitmask inside the sampled step
(:mod:`graphrunner.sampling.bitmask`), against a reference written here:
the masked logits equal a per-token loop over the bits; a step built with
``structured=True`` picks, on the eager and the compiled CPU runner, at every
padded size, the token a plain sampler picks from the model's logits masked
by the reference, and its padded rows' ``token_bitmask`` are all ones
(every token allowed) after populate, whatever they held before."""

from __future__ import annotations

import pytest
import torch

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.phases.sampled import with_sampling
from graphrunner.sampling import (
    TOKEN_BITMASK,
    SamplingParams,
    apply_token_bitmask,
    sample_rows,
    sampling_tensors,
)
from graphrunner.sampling.bitmask import bitmask_words
from graphrunner_ref import create_decode_runner, default_model

CTX = 32


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [n, V]`` with ``-inf`` where bit ``t % 32`` of word ``t // 32`` is clear."""
    out = logits.clone()
    for i in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


def _random_mask(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 2, (n, bitmask_words(vocab) * 32), generator=gen, dtype=torch.int64)
    bits[:, 0] = 1  # never an empty row
    words = (bits.view(n, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_the_mask_equals_the_reference_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(5, vocab, generator=gen)
    mask = _random_mask(5, vocab, gen)
    mask[2] = -1  # a row of all ones passes unchanged
    got = apply_token_bitmask(logits, mask)
    assert torch.equal(got, reference(logits, mask))
    assert torch.equal(got[2], logits[2])


_RUNNERS: dict[str, tuple[object, object]] = {}


def _runner(kind: str) -> tuple[object, object]:
    if kind not in _RUNNERS:
        bundle = default_model(max_requests=4, max_context_len=CTX)
        runner = create_decode_runner(bundle, kind, capture_sizes=[4], sampling=True,
                                      structured=True)  # fmt: skip
        runner.capture()
        _RUNNERS[kind] = (bundle, runner)
    return _RUNNERS[kind]


@pytest.mark.parametrize("kind", ["eager", "cpu"])
@pytest.mark.parametrize("raw_bs", [1, 3])
def test_the_step_samples_from_the_masked_logits_and_pads_all_ones(kind: str, raw_bs: int) -> None:
    bundle, runner = _runner(kind)
    bundle.req_pool.clear()  # type: ignore[attr-defined]
    bundle.kv_alloc.clear()  # type: ignore[attr-defined]
    vocab = bundle.config.vocab_size  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(raw_bs)
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0.0, 1.0, 0.7][:raw_bs])]
    rows, lens, last = [], [], []
    with torch.no_grad():
        for i in range(raw_bs):
            row = bundle.req_pool.alloc(1)[0]  # type: ignore[attr-defined]
            prompt = torch.randint(vocab, (4 + i,), generator=gen)
            slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)))  # type: ignore[attr-defined]
            bundle.model.forward_extend(row, prompt, slots)  # type: ignore[attr-defined]
            rows.append(row)
            lens.append(len(prompt))
            last.append(int(prompt[-1]))
    rows_in = sampling_tensors(params, [p.seed or 0 for p in params], "cpu")
    for step in range(3):
        batch = DecodeBatch.from_requests(rows, lens, torch.tensor(last), device="cpu",
                                          max_context_len=CTX)  # fmt: skip
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)  # type: ignore[attr-defined]
        mask = _random_mask(raw_bs, vocab, gen)
        if raw_bs > 1:
            mask[1] = -1  # an unconstrained row beside constrained ones
        runner.buffers.tensors[TOKEN_BITMASK][raw_bs:].fill_(0)  # type: ignore[attr-defined]
        out = runner.replay(with_sampling(batch, {**rows_in, TOKEN_BITMASK: mask}))  # type: ignore[attr-defined]
        position = torch.tensor(lens) + 1
        want = sample_rows(reference(out["logits"][:raw_bs], mask), rows_in, position)
        assert out["tokens"][:raw_bs].tolist() == want.tolist(), (kind, raw_bs, step)
        tail = runner.buffers.tensors[TOKEN_BITMASK][raw_bs:4]  # type: ignore[attr-defined]
        assert torch.equal(tail, torch.full_like(tail, -1)), "padded rows: every token allowed"
        last = want.tolist()
        lens = [n + 1 for n in lens]
