"""Admission: prefill the requests the scheduling policy admits
(:func:`~graphrunner_ref.engine.policy.admit_count`), each with its first
token, and the trace's checks before a run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from graphrunner_ref.engine.policy import admit_count
from graphrunner_ref.engine.results import LiveRequest, Run
from graphrunner_ref.engine.sampling import check_greedy, seed_of
from graphrunner_ref.engine.steps import EngineSteps
from graphrunner_ref.engine.workload import Request, check_trace

__all__ = ["Admission"]


class Admission:
    """The engine's admission: which arrived requests join, and their prefill.

    Args:
        engine: the step operations and facts it reads (the engine).
        agree: turns the count that fits into the count admitted (a sharded
            model's ranks admit rank 0's,
            :func:`~graphrunner_ref.engine.ranks.rank0_admits`), or None.
    """

    def __init__(self, engine: EngineSteps, agree: Callable[[int], int] | None = None) -> None:
        self.engine = engine
        self.agree = agree

    def admit(self, run: Run) -> list[tuple[LiveRequest, torch.Tensor]]:
        """Prefill ``run``'s arrived requests in order while they fit; returns
        each with its first token (a 0-d device tensor: drawn by its sampling
        parameters when the engine samples, else the argmax). Raises
        :class:`AdmissionError` when nothing runs and the next one can never fit."""
        count = admit_count(self.engine, run)
        if self.agree is not None:
            count = self.agree(count)
        return _prefill(self.engine, run, count)

    def validate(self, trace: Sequence[Request]) -> None:
        """``trace`` checked before a run: valid requests, each fitting the
        context and the KV pool, greedy unless the engine samples."""
        _validate_trace(self.engine, trace)


def _prefill(engine: EngineSteps, run: Run, count: int) -> list[tuple[LiveRequest, torch.Tensor]]:
    b, pending = engine.bundle, run.pending
    joining: list[tuple[LiveRequest, torch.Tensor]] = []
    for _ in range(count):
        req = pending.popleft()
        live = LiveRequest(req, b.req_pool.alloc(1)[0], seed=seed_of(req, engine.seed))
        run.held[req.rid] = live
        if engine.logprobs:
            run.logprobs[req.rid] = live.logprobs
        live.pages = b.kv_alloc.alloc(engine.kv_need(len(req.prompt)))
        live.slots = live.pages[: len(req.prompt)]  # decode continues in the last page
        ids = torch.tensor(req.prompt, dtype=torch.int64).to(engine.device, non_blocking=True)
        slots = torch.tensor(live.slots, dtype=torch.int64).to(engine.device, non_blocking=True)
        logits = b.model.forward_extend(live.req_index, ids, slots)
        joining.append((live, engine.first_token(live, logits)))
        run.stats.prefills += 1
        run.stats.prefill_tokens += len(req.prompt)
    return joining


def _validate_trace(engine: EngineSteps, trace: Sequence[Request]) -> None:
    ctx, kv_room = engine.bundle.max_context_len, engine.bundle.kv_alloc.size
    check_trace(trace, engine.bundle.config.vocab_size)
    if not engine.sampling:
        check_greedy(trace)
    for r in trace:
        if r.max_len > min(ctx, kv_room):
            raise ValueError(
                f"request {r.rid}: prompt {len(r.prompt)} + max_new_tokens "
                f"{r.max_new_tokens} - 1 = {r.max_len} tokens; expected <= "
                f"max_context_len {ctx} and <= KV slots {kv_room}"
            )
