"""A decode runner built by the engine factory with ``check_padding`` bounds
live token ids by its model's vocabulary: an id outside it is a named
PaddingViolation before the step runs, not an index error inside the model."""

from __future__ import annotations

import pytest
import torch

from graphrunner import DecodeBatch, PaddingViolation
from graphrunner_ref import create_decode_runner, default_model
from graphrunner_ref.model import ModelBundle


def batch_with_token(bundle: ModelBundle, token: int) -> DecodeBatch:
    """Three live requests; row 1 feeds ``token``."""
    reqs = bundle.req_pool.alloc(3)
    for position in range(4):  # the 4 cached tokens each request has, recorded as prefill would
        bundle.req_pool.write_tokens(reqs, [position] * 3, bundle.kv_alloc.alloc(3))
    ids = torch.tensor([5, token, 7])
    batch = DecodeBatch.from_requests(
        reqs, [4, 4, 4], ids, device=bundle.device, max_context_len=bundle.max_context_len
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return batch


@pytest.mark.parametrize("past_vocab", [False, True])
def test_a_live_token_outside_the_vocabulary_is_named(past_vocab: bool):
    bundle = default_model(max_requests=8, max_context_len=32, device="cpu")
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4], check_padding=True)
    runner.capture()
    vocab = bundle.config.vocab_size
    bad = vocab if past_vocab else -1
    batch = batch_with_token(bundle, bad)
    with pytest.raises(PaddingViolation, match=rf"input_ids batch row 1 = {bad}"):
        runner.replay(batch)
    ok = batch_with_token(bundle, vocab - 1)
    assert runner.replay(ok).shape[0] == 3
