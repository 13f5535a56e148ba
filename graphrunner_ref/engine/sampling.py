"""The engine's side of in-graph sampling: each running request's sampling
row, made once per batch composition, prefill's first token drawn as the
step draws, and the log-probabilities read from a step's outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import torch

from graphrunner import GraphRunner
from graphrunner.sampling import (
    SAMPLING_FIELD_NAMES,
    TOKEN_BITMASK,
    SamplingParams,
    TokenCounts,
    apply_token_bitmask,
    hold_end_tokens,
    logprobs,
    penalize,
    penalty_tensors,
    sample_rows,
    sampling_tensors,
)
from graphrunner_ref.engine.results import LiveRequest, TokenLogprobs
from graphrunner_ref.engine.workload import Request

__all__ = [
    "SampledRows",
    "StepOut",
    "check_logprobs",
    "first_logprobs",
    "host_logprobs",
    "logprob_outputs",
    "record_logprobs",
    "step_logprobs",
]

#: What a decode runner returns: logits ``[bs, vocab]``, or a sampled step's
#: ``{"logits": [bs, vocab], "tokens": [bs]}``.
StepOut: TypeAlias = torch.Tensor | dict[str, torch.Tensor]

_GREEDY = SamplingParams()


class SampledRows:
    """The sampling rows of the running requests (row ``i`` of request
    ``live[i]``), rebuilt only when the batch's requests change.

    Args:
        device: where the rows go (built on the host, copied without a sync).
        counts: the runner's token counts when its step applies penalties
            (the phase's ``token_counts``): the rows then carry the penalty
            fields (with each request's ``min_tokens`` hold), and
            :meth:`first_token` resets the request's counts row.
        end_token: the engine's end token (held back by ``min_tokens``
            unless the request ignores it), or None.
        words: the int32 words of a row of the grammar's ``token_bitmask``
            the runner's step reads (``[bs, ceil(vocab / 32)]``,
            :mod:`graphrunner.sampling.bitmask`), 0 for a step without one:
            :meth:`of` fills it afresh each step from the requests' matchers
            (every token allowed for a request without a grammar), and
            :meth:`first_token` masks prefill's token the same way.
    """

    def __init__(
        self,
        device: torch.device,
        counts: TokenCounts | None = None,
        end_token: int | None = None,
        *,
        words: int = 0,
    ) -> None:
        self.device = device
        self.counts = counts
        self.end_token = end_token
        self.words = words  # 0: the step masks nothing
        self._allow_all: torch.Tensor | None = None  # the composition's mask of no grammar
        self._live: list[LiveRequest] = []  # held: their ids key the cache
        self._key: tuple[int, ...] | None = None
        self._rows: dict[str, torch.Tensor] = {}

    @staticmethod
    def declared_by(runner: GraphRunner) -> bool:
        """Whether ``runner``'s step samples (it declares the sampling buffers)."""
        return all(name in runner.buffers.tensors for name in SAMPLING_FIELD_NAMES)

    def of(self, live: Sequence[LiveRequest]) -> dict[str, torch.Tensor]:
        """``{name: [len(live)]}`` on the device, for the requests ``live`` in order."""
        key = tuple(id(r) for r in live)
        if key != self._key:
            self._rows = self.build(live)
            self._live, self._key = list(live), key
            self._allow_all = None
        if not self.words:
            return self._rows
        if all(r.matcher is None for r in live):
            if self._allow_all is None:
                self._allow_all = self.bitmask(live)
            return {**self._rows, TOKEN_BITMASK: self._allow_all}
        return {**self._rows, TOKEN_BITMASK: self.bitmask(live)}

    def bitmask(self, live: Sequence[LiveRequest]) -> torch.Tensor:
        """The ``token_bitmask`` rows of ``live`` now (int32 ``[n, words]`` on
        the device): each matcher's next tokens, all ones without one."""
        mask = torch.full((len(live), self.words), -1, dtype=torch.int32)  # all ones: any token
        for i, r in enumerate(live):
            if r.matcher is not None:
                r.matcher.fill_next_token_bitmask(mask, i)
        return mask.to(self.device, non_blocking=True)

    def first_token(self, live: LiveRequest, logits: torch.Tensor) -> torch.Tensor:
        """Prefill's token (0-d, on the device) from its last logits ``[vocab]``:
        drawn as a decode step draws, at the position it takes (the prompt's
        length). With penalties, the request's counts row starts afresh (its
        prompt marked), the token is penalized (its end tokens held back by
        ``min_tokens``) as the step does and counted; with a grammar, only
        the tokens its matcher allows at the start."""
        position = torch.tensor([len(live.request.prompt)]).to(self.device, non_blocking=True)
        rows, x = self.build([live]), logits.view(1, -1)
        row = torch.tensor([live.req_index]).to(self.device, non_blocking=True)
        if self.counts is not None:
            self.counts.reset(live.req_index, live.request.prompt)
            x = hold_end_tokens(penalize(x, self.counts, row, rows), position, rows)
        if self.words and live.matcher is not None:
            x = apply_token_bitmask(x, self.bitmask([live]))
        token = sample_rows(x, rows, position)
        if self.counts is not None:
            self.counts.record(row, token)
        return token[0]

    def build(self, live: Sequence[LiveRequest]) -> dict[str, torch.Tensor]:
        """The rows of ``live``, made now (not kept)."""
        params = [r.request.sampling or _GREEDY for r in live]
        host = sampling_tensors(params, [r.seed for r in live], "cpu")
        if self.counts is not None:
            host |= penalty_tensors(params, "cpu", [self.hold(r.request) for r in live])
        return {n: t.to(self.device, non_blocking=True) for n, t in host.items()}

    def hold(self, request: Request) -> tuple[int, tuple[int, ...]]:
        """``request``'s ``min_tokens`` hold: the position from which its end
        tokens may be drawn, and those tokens (none when nothing is held)."""
        if not request.min_tokens:
            return 0, ()
        end = () if self.end_token is None or request.ignore_eos else (self.end_token,)
        ids = tuple(dict.fromkeys((*end, *request.stop_token_ids)))
        return len(request.prompt) + request.min_tokens, ids


#: The largest top-N of ``Engine(logprobs=N)`` (the CLI's ``--logprobs`` bound).
MAX_LOGPROBS = 20


def check_logprobs(n: object, sampling: bool) -> int:
    """``Engine(logprobs=n)`` checked: an int in ``0..MAX_LOGPROBS``, asked of
    a runner that samples (``sampling``)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS:
        raise ValueError(f"logprobs={n!r}; expected an int in 0..{MAX_LOGPROBS} (0: none)")
    if n and not sampling:
        raise ValueError(
            f"logprobs={n}: the runner does not sample; build it with "
            f"create_decode_runner(..., sampling=True, logprobs={n})"
        )
    return n


def _entries(chosen: torch.Tensor, top: torch.Tensor, ids: torch.Tensor) -> list[TokenLogprobs]:
    c, t, i = chosen.tolist(), top.tolist(), ids.tolist()
    return [(cv, list(zip(iv, tv, strict=True))) for cv, tv, iv in zip(c, t, i, strict=True)]


def logprob_outputs(out: StepOut, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-probability outputs of a step built with ``logprobs=n``:
    ``"logprob"`` ``[bs]``, ``"top_logprobs"`` and ``"top_ids"`` ``[bs, n]``
    (views of the runner's outputs: valid until its next replay)."""
    if not isinstance(out, dict) or "logprob" not in out or out["top_ids"].shape[-1] != n:
        raise ValueError(
            f"logprobs={n}: the runner's step does not return {n} top log-probabilities; "
            f"build it with create_decode_runner(..., sampling=True, logprobs={n})"
        )
    return out["logprob"], out["top_logprobs"], out["top_ids"]


def step_logprobs(out: StepOut, n: int) -> list[TokenLogprobs]:
    """Each row's log-probabilities from a step built with ``logprobs=n``
    (:func:`logprob_outputs`), read back to the host."""
    return _entries(*logprob_outputs(out, n))


def host_logprobs(
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> list[TokenLogprobs]:
    """:func:`logprob_outputs` (or copies of them) read back to the host."""
    return _entries(*outputs)


def first_logprobs(logits: torch.Tensor, token: torch.Tensor, n: int) -> TokenLogprobs:
    """Prefill's first token's log-probabilities from its last logits ``[vocab]``
    and the token (0-d), as the sampled step computes a decode token's."""
    lp = logprobs(logits.view(1, -1), token.view(1), n)
    return _entries(lp.chosen, lp.top, lp.top_ids)[0]


def record_logprobs(live: Sequence[LiveRequest], entries: list[TokenLogprobs]) -> None:
    """Append row ``i``'s entry to ``live[i]``'s log-probabilities."""
    for req, entry in zip(live, entries, strict=True):
        req.logprobs.append(entry)
