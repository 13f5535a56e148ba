"""Log-probabilities through the speculative engine: each emitted token's
(prefill's first, drafts that held, the target's token after them) equals
the log-softmax of an independent eager forward of the target, with the
top N sorted; the tokens are those of the run without them."""

from __future__ import annotations

import pytest
import torch
from test_engine_logprobs import CTX, TRACE, eager_last_logits

from graphrunner_ref import default_model
from graphrunner_ref.engine.spec_factory import speculative_engine
from graphrunner_ref.engine.spec_stats import SpeculativeResult


def _run(method: str, draft: str, logprobs: int) -> SpeculativeResult:
    bundle = default_model(max_requests=4, max_context_len=CTX)
    engine = speculative_engine(
        bundle,
        "eager",
        method=method,
        draft=draft,
        k=2,
        capture_sizes=[1, 2, 4],
        run_seed=11,
        logprobs=logprobs,
    )
    return engine.run(TRACE)


@pytest.mark.parametrize(("method", "draft"), [("eagle", "random"), ("mtp", "self")])
def test_speculative_logprobs_are_the_eager_log_softmax_of_each_token(
    method: str, draft: str
) -> None:
    result = _run(method, draft, logprobs=3)
    assert result.outputs == _run(method, draft, logprobs=0).outputs
    if draft == "random":
        assert result.stats.accepted < result.stats.proposed  # targets after a rejection too
    reference = default_model(max_requests=4, max_context_len=CTX)  # same weights, own pools
    assert set(result.logprobs) == {r.rid for r in TRACE}
    for r in TRACE:
        tokens, entries = result.outputs[r.rid], result.logprobs[r.rid]
        assert len(entries) == len(tokens) == r.max_new_tokens
        for i, (token, (chosen, top)) in enumerate(zip(tokens, entries, strict=True)):
            lp = torch.log_softmax(eager_last_logits(reference, [*r.prompt, *tokens[:i]]), -1)
            assert chosen == pytest.approx(lp[token].item(), abs=1e-4), (r.rid, i)
            expected = torch.topk(lp, 3)
            assert [t for t, _ in top] == expected.indices.tolist()
            assert [v for _, v in top] == pytest.approx(expected.values.tolist(), abs=1e-4)
