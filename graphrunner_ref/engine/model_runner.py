"""The model runner: a step's plan executed through the runners.

:class:`ModelRunner` runs a :class:`~graphrunner_ref.engine.results.StepPlan`
on the device: its prompt chunks (one padded token batch through the token
runner, or each chunk eagerly), the first token of each prompt they
complete, one decode step of the running rows through the captured runner,
and ONE read back of every token and new KV slot. Its :meth:`ModelRunner.run`
is the plain variant of a step's run; the overlap and several-steps-per-launch
variants (:mod:`~graphrunner_ref.engine.schedule`) compose its operations
(:meth:`~ModelRunner.prefill`, :meth:`~ModelRunner.replay`,
:meth:`~ModelRunner.launch`) themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch

from graphrunner import DecodeBatch, GraphRunner
from graphrunner.phases import SpecBatch, token_batch_inputs, with_sampling
from graphrunner.pools import CachedKVAllocator, starts_page
from graphrunner.sampling import row_argmax
from graphrunner_ref.engine.registry import DecodeStep, ServingBundle
from graphrunner_ref.engine.results import (
    Chunk,
    EngineStats,
    LiveRequest,
    Run,
    StepPlan,
    StepResult,
)
from graphrunner_ref.engine.sampling import (
    SampledRows,
    StepOut,
    first_logprobs,
    record_logprobs,
    step_logprobs,
)

__all__ = ["ModelRunner", "StepCheck", "check_step_out", "logits_of", "tokens_of"]

T = TypeVar("T")


class StepCheck(Protocol):
    """Runs a step checked against the eager forward
    (:class:`~graphrunner_ref.engine.check.CheckMode`)."""

    def replay(
        self, batch: DecodeBatch, stats: EngineStats, live: Sequence[LiveRequest] = ()
    ) -> StepOut: ...

    def launch(
        self, inputs: Any, budgets: list[int], stats: EngineStats, replay: Callable[[], StepOut]
    ) -> StepOut: ...


class ModelRunner:
    """Runs a step's plan on the model (see the module doc).

    Args:
        bundle: the model and its pools.
        runner: the captured decode runner.
        decoder: the bundle's :class:`~graphrunner_ref.engine.registry.DecodeStep`.
        sampling_rows: the running requests' sampling rows (when the runner samples).
        sampling: whether the runner's step samples.
        logprobs: N >= 1: each token's log-probabilities and the top N are collected.
        token_runner: a captured runner of the token-batch phase (each step's
            prompt chunks as one padded step), or None (each chunk eagerly).
        prefix_cache: the prefix cache, where each chunk's full pages are
            indexed as soon as written, or None.
        rank_check: checks a replay's batch size against the other ranks', or None.
        end_token: the engine's end token (read by the check mode and the variants).
        atol: the check mode's tolerance on logits and KV values.
    """

    def __init__(
        self,
        bundle: ServingBundle,
        runner: GraphRunner,
        decoder: DecodeStep,
        sampling_rows: SampledRows,
        *,
        sampling: bool,
        logprobs: int,
        token_runner: GraphRunner | None,
        prefix_cache: CachedKVAllocator | None,
        rank_check: Callable[[int], None] | None,
        end_token: int | None,
        atol: float,
    ) -> None:
        self.bundle, self.runner, self.decoder = bundle, runner, decoder
        self.sampling_rows, self.sampling, self.logprobs = sampling_rows, sampling, logprobs
        self.token_runner, self.prefix_cache = token_runner, prefix_cache
        self.end_token, self.atol = end_token, atol
        self.device = bundle.device
        self._rank_check = rank_check
        #: Set by the engine with check=True: each decode step also run eagerly.
        self.check_mode: StepCheck | None = None
        self._sync: Callable[[], None] = (
            torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        )

    # -- the plain variant of a step's run ------------------------------------------

    def end(self) -> None:
        pass

    def run(self, run: Run, plan: StepPlan) -> StepResult:
        """``plan`` on the device: its chunks, the first tokens of the prompts
        they complete, a decode step of its rows, and one read back. Each
        decoded row's new KV slot (and fresh page) is recorded on its request."""
        completed = self.prefill(run, plan.chunks)
        first_ids = torch.stack([ids for _, ids in completed]) if completed else self.empty()
        bs = len(plan.decode)
        next_ids, new_slots = (
            self.decode(run.batch, run.stats, plan.decode) if bs else (self.empty(),) * 2
        )
        host = torch.cat([next_ids, new_slots, first_ids]).tolist()  # the step's one sync
        run.stats.syncs += 1 if bs else 0
        page = self.bundle.page_size
        for i, req in enumerate(plan.decode):
            slot = host[bs + i]
            if starts_page(len(req.slots), page):  # a fresh page: slot is its first
                req.pages.extend(range(slot, slot + page))
            req.slots.append(slot)
        run.batch.input_ids = next_ids  # what each row feeds next step
        decoded = [(req, [host[i]]) for i, req in enumerate(plan.decode)]
        firsts = [(live, host[2 * bs + j]) for j, (live, _) in enumerate(completed)]
        return StepResult(decoded, firsts, first_ids, 1 if bs else 0)

    # -- the operations the variants compose -----------------------------------------

    def prefill(self, run: Run, chunks: Sequence[Chunk]) -> list[tuple[LiveRequest, torch.Tensor]]:
        """Run the step's ``chunks`` (each attends to the KV its earlier chunks
        wrote): one token batch through the token runner, or each eagerly.
        Returns the requests whose prompt is now whole, each with its first
        token (0-d, on the device)."""
        if not chunks:
            return []
        # Host time, no device sync (an overlapped schedule prefills while the
        # last step runs): on a GPU, prefill's device work may be waited for
        # in the step's read back instead.
        begin = time.perf_counter()
        try:
            return self._prefill(run, chunks)
        finally:
            run.stats.prefill_seconds += time.perf_counter() - begin

    def _prefill(self, run: Run, chunks: Sequence[Chunk]) -> list[tuple[LiveRequest, torch.Tensor]]:
        if self.token_runner is not None:
            logits = self._token_batch(self.token_runner, chunks)
            last = [logits[i] for i in range(len(chunks))]
        else:
            last = [self._extend(live, start, end) for live, start, end in chunks]
        cache = self.prefix_cache
        completed: list[tuple[LiveRequest, torch.Tensor]] = []
        for (live, start, end), row in zip(chunks, last, strict=True):
            live.prefilled = end
            run.stats.prefill_tokens += end - start
            run.stats.prefill_chunks += 1
            if cache is not None:  # its full pages written so far serve later prompts
                cache.insert(live.request.prompt[:end], live.slots[:end])
            if end < len(live.request.prompt):
                continue  # the budget is spent inside this prompt
            run.prefilling.remove(live)
            completed.append((live, self.first_token(live, row)))
            run.stats.prefills += 1
        return completed

    def _token_batch(self, runner: GraphRunner, chunks: Sequence[Chunk]) -> torch.Tensor:
        """The chunks as one token batch (their slots recorded in ``req_to_token``
        first) through ``runner``: each chunk's last-token logits ``[chunks, vocab]``."""
        pool = self.bundle.req_pool
        ids: list[int] = []
        slots: list[int] = []
        for live, start, end in chunks:
            pool.write(live.req_index, start, live.slots[start:end])
            ids += live.request.prompt[start:end]
            slots += live.slots[start:end]
        inputs = token_batch_inputs(
            input_ids=ids,
            out_cache_loc=slots,
            req_pool_indices=[live.req_index for live, _, _ in chunks],
            seq_lens=[end for _, _, end in chunks],
            extend_lens=[end - start for _, start, end in chunks],
            device=self.device,
        )
        return cast(torch.Tensor, runner.replay(inputs))

    def _extend(self, live: LiveRequest, start: int, end: int) -> torch.Tensor:
        """Prompt tokens ``start:end`` of ``live`` into the KV cache; the logits
        of the last (float32 ``[vocab]``)."""
        device = self.device
        ids = torch.tensor(live.request.prompt[start:end], dtype=torch.int64).to(
            device, non_blocking=True
        )
        slots = torch.tensor(live.slots[start:end], dtype=torch.int64).to(device, non_blocking=True)
        model = self.bundle.model
        if start == 0:  # a whole prompt, or its first chunk: every model kind
            return model.forward_extend(live.req_index, ids, slots)
        chunked = cast(_ChunkedModel, model)
        return chunked.forward_extend(live.req_index, ids, slots, prefix_len=start)

    def first_token(self, live: LiveRequest, logits: torch.Tensor) -> torch.Tensor:
        """Prefill's token from its last logits ``[vocab]`` (0-d, on device):
        the argmax for a plain greedy request (temperature 0, no penalty,
        logit bias, ``min_tokens`` or grammar: what the sampled draw takes
        for it, its token counts never read), else drawn by the sampling rows."""
        request = live.request
        params = request.sampling
        plain = (
            (params is None or (params.greedy and not params.penalized))
            and not request.min_tokens
            and live.matcher is None
        )
        if plain or not self.sampling:
            token = row_argmax(logits.unsqueeze(0))[0]
        else:
            token = self.sampling_rows.first_token(live, logits)
        if self.logprobs:
            live.logprobs.append(first_logprobs(logits, token, self.logprobs))
        return token

    def decode(
        self, batch: DecodeBatch, stats: EngineStats, live: Sequence[LiveRequest] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``live`` (row ``i`` is ``live[i]``); returns each
        row's token and new KV slot, on device."""
        batch.prepare_decode(self.bundle.req_pool, self.bundle.kv_alloc)
        try:
            if self.check_mode is not None:
                out = self.check_mode.replay(batch, stats, live)
            else:
                out, seconds = self.timed(lambda: self.replay(batch, live))
                stats.decode_seconds += seconds
            if self.logprobs:  # a read back of its own: only when asked
                record_logprobs(live, step_logprobs(out, self.logprobs))
        except BaseException:  # the step's fresh pages are no request's yet: free them here
            self._free_fresh_pages(batch)
            raise
        stats.steps += 1
        stats.launches += 1
        stats.decode_tokens += batch.batch_size
        stats.batch_sizes[batch.batch_size] = stats.batch_sizes.get(batch.batch_size, 0) + 1
        return tokens_of(out), batch.out_cache_loc

    def _free_fresh_pages(self, batch: DecodeBatch) -> None:
        """Free the pages :meth:`DecodeBatch.prepare_decode` just handed out: those of
        the rows that started a page (the others wrote inside a page they own)."""
        page = self.bundle.page_size
        first_slots = batch.out_cache_loc.tolist()  # a failure path: a read back is fine
        lens = (batch.seq_lens_cpu - 1).tolist()  # lengths before the step
        fresh = [
            s + o
            for s, n in zip(first_slots, lens, strict=True)
            if starts_page(n, page)
            for o in range(page)
        ]
        self.bundle.kv_alloc.free(fresh)

    def step_inputs(self, batch: DecodeBatch) -> DecodeBatch | SpecBatch:
        """What the decode forward reads for ``batch`` (the kind's own inputs, or the batch)."""
        inputs = self.decoder.inputs
        return batch if inputs is None else inputs(batch)

    def replay(self, batch: DecodeBatch, live: Sequence[LiveRequest] = ()) -> StepOut:
        """The runner's step on ``batch`` (``live[i]`` its row ``i``, whose
        sampling rows go with it when the runner samples)."""
        if self._rank_check is not None:
            self._rank_check(batch.batch_size)
        inputs = self.step_inputs(batch)
        if self.sampling:
            inputs = with_sampling(inputs, self.sampling_rows.of(live))
        return check_step_out(self.runner.replay(inputs))

    def launch(self, inputs: SpecBatch) -> StepOut:
        """The runner's step on inputs a variant built itself (a multi-step
        launch), its outputs checked."""
        return check_step_out(self.runner.replay(inputs))

    def timed(self, fn: Callable[[], T]) -> tuple[T, float]:
        """``fn()`` and its seconds, the device synchronised around it."""
        self._sync()
        start = time.perf_counter()
        out = fn()
        self._sync()
        return out, time.perf_counter() - start

    def empty(self) -> torch.Tensor:
        """An empty int64 device tensor."""
        return torch.empty(0, dtype=torch.int64, device=self.device)


class _ChunkedModel(Protocol):
    """A model whose prefill extends a cached prefix (native Llama, the bridge)."""

    def forward_extend(
        self,
        req_pool_index: int,
        token_ids: torch.Tensor,
        kv_slots: torch.Tensor,
        *,
        prefix_len: int,
    ) -> torch.Tensor: ...


def check_step_out(out: object) -> StepOut:
    """``out`` if it is a decode step's output, else a TypeError saying what was expected."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and {"logits", "tokens"} <= set(out):
        return out
    raise TypeError(
        f"runner.replay returned {type(out).__name__}; expected the logits tensor "
        '[bs, vocab] of forward_decode, or a sampled step\'s {"logits", "tokens"}'
    )


def logits_of(out: StepOut) -> torch.Tensor:
    """A step's logits ``[bs, vocab]``."""
    return out["logits"] if isinstance(out, dict) else out


def tokens_of(out: StepOut) -> torch.Tensor:
    """Each row's token ``[bs]``: the sampled step's, or the logits' argmax."""
    return out["tokens"] if isinstance(out, dict) else row_argmax(out)
