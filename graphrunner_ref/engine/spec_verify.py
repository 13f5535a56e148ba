"""How a speculative round is verified: the target's verify over the bonus
token and the drafts, greedy (longest prefix equal to the target's argmax)
or, when a request samples, by rejection sampling; and the log-probabilities
of the tokens a round emits, when asked.

A round that samples runs the verify that samples
(``verify_phase(..., sampling=True)``: the accept test and the residual draw
inside its captured step), built once on the first such round; without one
the same rule runs on the plain verify's logits after its replay. A round
with a grammar (``RoundState.bitmask``) takes that path too, on the logits
masked with it: a draft its grammar refuses has no probability, so it is
never accepted, and each target is one the grammar allows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from graphrunner import GraphRunner
from graphrunner.phases import with_sampling
from graphrunner.sampling import (
    SamplingParams,
    apply_token_bitmask,
    deterministic_probs,
    logprobs,
    rejection_sample,
    sampling_tensors,
)
from graphrunner_ref.engine.drafters import RoundState, SpecRequest, Verified, replay_named
from graphrunner_ref.engine.results import TokenLogprobs
from graphrunner_ref.engine.sampling import host_logprobs
from graphrunner_ref.model.build import ModelBundle

__all__ = ["RoundVerifier", "round_logprobs"]

_GREEDY = SamplingParams()


class RoundVerifier:
    """Verifies the rounds of one engine.

    Args:
        bundle: the target model and its pools.
        verify: the captured plain verify (width ``K + 1``).
        sampled_verify: builds the captured verify that samples, or None.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        verify: GraphRunner,
        sampled_verify: Callable[[], GraphRunner] | None,
    ) -> None:
        self.bundle, self.verify, self._build = bundle, verify, sampled_verify
        self._sampled: GraphRunner | None = None

    @property
    def sampled(self) -> GraphRunner | None:
        """The verify that samples, once a round built it."""
        return self._sampled

    def rows(self, live: Sequence[SpecRequest]) -> dict[str, torch.Tensor]:
        """The sampling rows of ``live`` (each ``[bs]``) on the device."""
        params = [r.request.sampling or _GREEDY for r in live]
        host = sampling_tensors(params, [r.sampling_seed for r in live], "cpu")
        return {n: t.to(self.bundle.device, non_blocking=True) for n, t in host.items()}

    def __call__(self, state: RoundState, drafts: torch.Tensor) -> Verified:
        """The verify of ``drafts`` int64 ``[bs, K]`` after each request's bonus token."""
        bonus = state.tensor([r.bonus for r in state.live])
        ids = torch.cat([bonus[:, None], drafts], 1).reshape(-1)
        if state.sampling is not None and self._build is not None and state.bitmask is None:
            out = self._replay_sampled(state, drafts, ids)
            targets, accepted = out["targets"], out["accepted"]
        else:
            out = replay_named(self.verify, state.tokens_step(ids))
            bs, w = drafts.shape[0], drafts.shape[1] + 1
            logits = out["logits"]
            if state.bitmask is not None:
                logits = apply_token_bitmask(logits, state.bitmask)
            if state.sampling is None:
                targets = logits.argmax(-1).view(bs, w)
                accepted = (drafts == targets[:, :-1]).long().cumprod(1).sum(1)
            else:
                targets, accepted = rejection_sample(
                    logits.view(bs, w, -1),
                    drafts,
                    state.draft_probs,
                    state.sampling,
                    state.positions(1),
                )
        return Verified(drafts, targets, out["hidden"], accepted, out["logits"])

    def _replay_sampled(
        self, state: RoundState, drafts: torch.Tensor, ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        if self._sampled is None:
            assert self._build is not None
            self._sampled = self._build()
        q = state.draft_probs
        if q is None:  # drafts not drawn: their one-hot
            q = deterministic_probs(drafts, self.bundle.config.vocab_size)
        inputs = state.tokens_step(ids, draft_probs=q)
        return replay_named(self._sampled, with_sampling(inputs, state.sampling or {}))


def round_logprobs(verified: Verified, n: int) -> list[list[TokenLogprobs]]:
    """Per request, the log-probabilities (chosen and top ``n``, from the
    unfiltered softmax of the verify's logits) of the token each column
    would emit: column ``j`` emits draft ``j`` while it holds, the target's
    token at the first column that does not (``W`` entries per request; the
    caller keeps ``accepted + 1``)."""
    v = verified
    if v.logits is None:
        raise ValueError("round_logprobs: the verify kept no logits")
    bs, w = v.targets.shape
    column = torch.arange(w, device=v.targets.device)
    held = torch.cat([v.drafts, v.drafts.new_zeros(bs, 1)], 1)
    emitted = torch.where(column < v.accepted[:, None], held, v.targets)
    lp = logprobs(v.logits, emitted.reshape(-1), n)
    entries = host_logprobs((lp.chosen, lp.top, lp.top_ids))
    return [entries[i * w : (i + 1) * w] for i in range(bs)]
