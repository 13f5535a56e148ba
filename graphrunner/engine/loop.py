"""A small engine loop: continuous batching over a request trace, every decode step
through a runner, optionally checked against the eager forward.

Per engine step: admit the requests that have arrived (while rows, request
slots and KV room last), prefill each eagerly; run one decode step of the
running batch through the runner; sample greedily on the device; read the
step's tokens (and new KV slots) back to the host in ONE ``.tolist()``; retire
finished requests (token budget or end token) via ``filter``, freeing their
pool rows and KV pages; merge the prefilled ones in for the next step.

KV is allocated in whole pages of ``bundle.page_size`` slots (1: one slot per
token). A prefill takes the prompt's pages, its tokens in the first slots in
order; a decode step gives a row a fresh page when its length is a multiple of
the page size, else the slot after its last token (see
:meth:`DecodeBatch.prepare_decode`). Each request owns the pages it was given
and frees them whole.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.core.future_map import FutureMap
from graphrunner.core.runner import GraphRunner
from graphrunner.core.runners import create_runner
from graphrunner.declare.decode import decode_buffer_specs
from graphrunner.engine.workload import Request, check_trace
from graphrunner.model.build import ModelBundle
from graphrunner.pools import starts_page, whole_pages
from graphrunner.sanitizer.padding import PaddingSanitizer
from graphrunner.sizing.histogram import BatchSizeHistogram
from graphrunner.sizing.sizes import PaddingWaste


class AdmissionError(RuntimeError):
    """An arrived request can never be admitted: nothing is running that could
    free the rows or KV pages it needs (they are held outside the run)."""


def create_model_runner(
    bundle: ModelBundle,
    kind: str,
    *,
    capture_sizes: Sequence[int] | None = None,
    max_bs: int | None = None,
    show_progress: bool = False,
    check_padding: bool = False,
    future_map: FutureMap | None = None,
    **mechanism_options: Any,
) -> GraphRunner:
    """A ``kind`` runner (``cuda``, ``cpu``, ``eager``) over the bundle's decode
    step, with its attention backend's hooks and pad value. Not yet captured.

    ``check_padding=True`` guards the bundle's pools with a
    :class:`~graphrunner.sanitizer.padding.PaddingSanitizer` around every replay (a
    debug mode: it copies the KV cache per step). ``future_map`` lets
    ``input_ids`` carry future references (overlap scheduling).
    ``mechanism_options`` go to the runner's mechanism, e.g. ``compile=True``
    for ``cuda``.
    """
    model = bundle.model
    specs = decode_buffer_specs(
        seq_len_fill_value=model.attn_backend.seq_len_fill_value, future=future_map is not None
    )
    sanitizer = None
    if check_padding:
        sanitizer = PaddingSanitizer.for_pools(
            bundle.req_pool, bundle.kv_cache, kv_allocator=bundle.kv_alloc
        )
    return create_runner(
        kind,
        model.forward_decode,
        specs,
        device=bundle.device,
        capture_sizes=capture_sizes,
        max_bs=max_bs,
        backend=model.attn_backend,
        show_progress=show_progress,
        sanitizer=sanitizer,
        future_map=future_map,
        **mechanism_options,
    )


@dataclass(slots=True)
class EngineStats:
    """What a run did. Seconds are wall time around the forward calls only,
    with a device sync on CUDA so they measure the work, not the launch."""

    steps: int = 0  # decode steps
    prefills: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0  # live rows over all decode steps
    decode_seconds: float = 0.0  # in runner.replay
    eager_seconds: float = 0.0  # in the eager reference (check mode)
    live_rows: int = 0
    padded_rows: int = 0
    checked_steps: int = 0
    mismatches: int = 0  # checked steps outside tolerance
    token_flips: int = 0  # rows whose greedy token differs (near-ties, inside tolerance)
    max_logit_diff: float = 0.0
    max_kv_diff: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # decode steps per live bs

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def eager_tokens_per_second(self) -> float:
        return self.decode_tokens / self.eager_seconds if self.eager_seconds else 0.0

    @property
    def padded_fraction(self) -> float:
        return PaddingWaste(self.live_rows, self.padded_rows).fraction

    @property
    def histogram(self) -> BatchSizeHistogram:
        """``batch_sizes`` as the runner keeps it, to write for ``graphrunner sizes``."""
        return BatchSizeHistogram(self.batch_sizes)


@dataclass(frozen=True, slots=True)
class EngineResult:
    """Generated tokens per request id (prompt excluded); ``finished``: the ids
    that reached their budget or the end token (others were cut by max_steps)."""

    outputs: dict[int, list[int]]
    finished: frozenset[int]
    stats: EngineStats


@dataclass(slots=True)
class _Live:
    request: Request
    req_index: int
    slots: list[int] = field(default_factory=list)  # KV slot per position, host ints
    pages: list[int] = field(default_factory=list)  # every slot of its whole pages: to free
    tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Run:
    """The state of one :meth:`Engine.run`; ``live[i]`` is row ``i`` of ``batch``."""

    pending: deque[Request]
    batch: DecodeBatch
    outputs: dict[int, list[int]]
    live: list[_Live] = field(default_factory=list)
    held: dict[int, _Live] = field(default_factory=dict)  # by rid: pool rows / KV pages to free
    finished: set[int] = field(default_factory=set)
    stats: EngineStats = field(default_factory=EngineStats)
    clock: int = 0  # engine steps, idle ones included: what arrival_step counts


class Engine:
    """Runs request traces on ``bundle``'s model with decode steps through ``runner``.

    Args:
        bundle: the model and its pools; a run frees everything it allocated,
            also when it raises.
        runner: a captured runner over ``bundle.model.forward_decode``.
        check: run the eager forward on every decode step and compare (see
            :meth:`_checked_replay`); counts go to ``stats``.
        end_token: a token that finishes its request (it is kept in the output).
        atol: tolerance on logits and KV values in check mode.
        on_finish: called with ``(rid, tokens)`` as each request finishes (text
            output streams through it); not for requests cut by ``max_steps``.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        runner: GraphRunner,
        *,
        check: bool = False,
        end_token: int | None = None,
        atol: float = 1e-4,
        on_finish: Callable[[int, list[int]], None] | None = None,
    ) -> None:
        self.bundle, self.runner = bundle, runner
        self.check, self.end_token, self.atol = check, end_token, atol
        self.on_finish = on_finish
        self.device = bundle.device
        self._sync: Callable[[], None] = (
            torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        )

    def run(
        self, trace: Sequence[Request], *, max_steps: int | None = None, progress: bool = False
    ) -> EngineResult:
        """Serve ``trace`` until every request finishes or ``max_steps`` decode steps ran.

        Raises :class:`AdmissionError` when nothing is running and the next
        arrived request does not fit in the free request rows and KV pages
        (held outside this run): waiting would never end.
        """
        self._validate(trace)
        run = _Run(
            deque(sorted(trace, key=lambda r: (r.arrival_step, r.rid))),
            DecodeBatch.empty(self.device, self.bundle.max_context_len),
            {r.rid: [] for r in trace},
        )
        start_live, start_pad = self.runner.stats.live_rows, self.runner.stats.padded_rows
        try:
            with tqdm(total=max_steps, desc="decode", unit="step", disable=not progress) as bar:
                while (run.pending or run.live) and (
                    max_steps is None or run.stats.steps < max_steps
                ):
                    if not run.live:  # idle: jump to the next arrival
                        run.clock = max(run.clock, run.pending[0].arrival_step)
                    bar.update(self._step(run))
                    run.clock += 1
            for req in run.live:  # cut by max_steps
                run.outputs[req.request.rid] = req.tokens
        finally:  # on an error too: a failed run leaks no pool row or KV page
            for req in list(run.held.values()):
                self._free(run, req)
        run.stats.live_rows = self.runner.stats.live_rows - start_live
        run.stats.padded_rows = self.runner.stats.padded_rows - start_pad
        return EngineResult(run.outputs, frozenset(run.finished), run.stats)

    def _step(self, run: _Run) -> int:
        """Admit, decode the running batch, read back, retire, merge. Returns decode steps run."""
        joining = self._admit(run)
        bs = len(run.live)
        first_ids = torch.stack([ids for _, ids in joining]) if joining else self._empty()
        next_ids, new_slots = self._decode(run.batch, run.stats) if bs else (self._empty(),) * 2
        host = torch.cat([next_ids, new_slots, first_ids]).tolist()  # the step's one sync
        page = self.bundle.page_size
        keep = []
        for i, req in enumerate(run.live):
            slot = host[bs + i]
            if starts_page(len(req.slots), page):  # a fresh page: slot is its first
                req.pages.extend(range(slot, slot + page))
            req.slots.append(slot)
            if not self._advance(run, req, host[i]):
                keep.append(i)
        run.batch.input_ids = next_ids  # what each row feeds next step
        if len(keep) < bs:
            run.batch.filter(keep)
            run.live[:] = [run.live[i] for i in keep]
        stay = [
            j for j, (req, _) in enumerate(joining) if not self._advance(run, req, host[2 * bs + j])
        ]
        if stay:
            self._join(run, [joining[j][0] for j in stay], first_ids[stay])
        return 1 if bs else 0

    def _validate(self, trace: Sequence[Request]) -> None:
        ctx, kv_room = self.bundle.max_context_len, self.bundle.kv_alloc.size
        check_trace(trace, self.bundle.config.vocab_size)
        for r in trace:
            if r.max_len > min(ctx, kv_room):
                raise ValueError(
                    f"request {r.rid}: prompt {len(r.prompt)} + max_new_tokens "
                    f"{r.max_new_tokens} - 1 = {r.max_len} tokens; expected <= "
                    f"max_context_len {ctx} and <= KV slots {kv_room}"
                )

    def _kv_need(self, tokens: int) -> int:
        """KV slots that ``tokens`` tokens take: whole pages."""
        return whole_pages(tokens, self.bundle.page_size)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _admit(self, run: _Run) -> list[tuple[_Live, torch.Tensor]]:
        """Prefill arrived requests in order while they fit; returns each with its
        first token (a 0-d device tensor)."""
        b, pending = self.bundle, run.pending
        joining: list[tuple[_Live, torch.Tensor]] = []
        # KV slots (whole pages) promised to running requests but not yet allocated.
        reserved = sum(self._kv_need(r.request.max_len) - len(r.pages) for r in run.live)
        while pending and pending[0].arrival_step <= run.clock:
            req = pending[0]
            room = b.kv_alloc.available_size() - reserved
            rows = b.req_pool.available_size()
            need = self._kv_need(req.max_len)
            if len(run.live) + len(joining) >= self.runner.max_bs or need > room or not rows:
                if not run.live and not joining:  # nothing running will ever free room
                    raise AdmissionError(
                        f"request {req.rid} can never be admitted: it needs 1 request row "
                        f"and {self._kv_amount(need)}, nothing is running, and "
                        f"{rows} request rows and {self._kv_amount(room)} are free"
                    )
                break  # FIFO: later arrivals wait behind it
            pending.popleft()
            live_req = _Live(req, b.req_pool.alloc(1)[0])
            run.held[req.rid] = live_req
            live_req.pages = b.kv_alloc.alloc(self._kv_need(len(req.prompt)))
            live_req.slots = live_req.pages[: len(req.prompt)]  # decode continues in the last page
            reserved += need - len(live_req.pages)
            ids = torch.tensor(req.prompt, dtype=torch.int64).to(self.device, non_blocking=True)
            slots = torch.tensor(live_req.slots, dtype=torch.int64).to(
                self.device, non_blocking=True
            )
            logits = b.model.forward_extend(live_req.req_index, ids, slots)
            joining.append((live_req, logits.argmax()))
            run.stats.prefills += 1
            run.stats.prefill_tokens += len(req.prompt)
        return joining

    def _kv_amount(self, slots: int) -> str:
        page = self.bundle.page_size
        return f"{slots} KV slots" if page == 1 else f"{slots // page} KV pages of {page} slots"

    def _decode(self, batch: DecodeBatch, stats: EngineStats) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step; returns greedy tokens and the rows' new KV slots, on device."""
        batch.prepare_decode(self.bundle.req_pool, self.bundle.kv_alloc)
        try:
            if self.check:
                logits = self._checked_replay(batch, stats)
            else:
                logits, seconds = self._timed(lambda: self._replay(batch))
                stats.decode_seconds += seconds
        except BaseException:  # the step's fresh pages are no request's yet: free them here
            self._free_fresh_pages(batch)
            raise
        stats.steps += 1
        stats.decode_tokens += batch.batch_size
        stats.batch_sizes[batch.batch_size] = stats.batch_sizes.get(batch.batch_size, 0) + 1
        return logits.argmax(-1), batch.out_cache_loc

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

    def _checked_replay(self, batch: DecodeBatch, stats: EngineStats) -> torch.Tensor:
        """Eager reference first, then the runner, on the same prepared batch.

        Both write the new tokens' K/V at ``out_cache_loc`` before reading, so
        the second run overwrites the first's writes and reads nothing else of
        it. The reference goes first because it touches live rows only: every
        value it reads is the true state. A snapshot of the KV cache between
        the two then shows any write of the runner outside the live rows'
        ``out_cache_loc`` (slot 0, the padding sink, excepted). The runner's
        outputs drive the engine; this check syncs, it is not the hot path.
        """
        with torch.no_grad():
            ref, eager_seconds = self._timed(lambda: self.bundle.model.forward_decode(batch))
        kv = self.bundle.kv_cache
        before = [t.clone() for t in (*kv.k_buffers, *kv.v_buffers)]
        out, seconds = self._timed(lambda: self._replay(batch))
        stats.eager_seconds += eager_seconds
        stats.decode_seconds += seconds
        after = (*kv.k_buffers, *kv.v_buffers)
        kv_diff = torch.stack(
            [(a[1:] - b[1:]).abs().max() for a, b in zip(after, before, strict=True)]
        ).max()
        flips = (out.argmax(-1) != ref.argmax(-1)).sum()
        logit_diff, kv_diff_f, n_flips = torch.stack(
            [(out - ref).abs().max(), kv_diff.float(), flips.float()]
        ).tolist()
        stats.checked_steps += 1
        stats.max_logit_diff = max(stats.max_logit_diff, logit_diff)
        stats.max_kv_diff = max(stats.max_kv_diff, kv_diff_f)
        stats.token_flips += int(n_flips)
        # A token flip with logits inside atol is a near-tie (the two logits differ
        # by at most 2 * atol), not a divergence.
        if not (logit_diff <= self.atol and kv_diff_f <= self.atol):
            stats.mismatches += 1
        return out

    def _replay(self, batch: DecodeBatch) -> torch.Tensor:
        logits = self.runner.replay(batch)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(
                f"runner.replay returned {type(logits).__name__}; expected the "
                "logits tensor [bs, vocab] of forward_decode"
            )
        return logits

    def _timed(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
        self._sync()
        start = time.perf_counter()
        out = fn()
        self._sync()
        return out, time.perf_counter() - start

    def _advance(self, run: _Run, req: _Live, token: int) -> bool:
        """Record ``token``; retire the request if it is done. Returns whether it was."""
        done = self._record_token(run, req, token)
        if done:
            self._free(run, req)
        return done

    def _record_token(self, run: _Run, req: _Live, token: int) -> bool:
        """Append ``token``; when the budget or the end token is reached, record
        the request's output as finished. Returns whether it is done."""
        req.tokens.append(token)
        if len(req.tokens) < req.request.max_new_tokens and token != self.end_token:
            return False
        run.outputs[req.request.rid] = req.tokens
        run.finished.add(req.request.rid)
        if self.on_finish is not None:
            self.on_finish(req.request.rid, req.tokens)
        return True

    def _free(self, run: _Run, req: _Live) -> None:
        del run.held[req.request.rid]
        self.bundle.req_pool.free([req.req_index])
        self.bundle.kv_alloc.free(req.pages)

    def _join(self, run: _Run, joining: list[_Live], first_ids: torch.Tensor) -> None:
        new = DecodeBatch.from_requests(
            [r.req_index for r in joining],
            [len(r.request.prompt) for r in joining],
            first_ids,
            device=self.device,
            max_context_len=self.bundle.max_context_len,
        )
        run.batch.merge(new)
        run.live.extend(joining)
