"""Several decode steps per launch: the :class:`MultiStepSchedule` of
``Engine(steps_per_launch=N)``.

Per engine step: admit and prefill the arrived requests; give each running
row the KV slots of its next ``s = min(N, tokens it may still emit)``
positions (page size 1: ``s`` fresh slots; pages of ``P``: the rest of its
last page, then fresh whole pages up to its ``s``-th position), recorded in
``req_to_token`` before the launch; run the runner's ``N``-step launch
(:mod:`graphrunner.phases.multistep`, each row's budget ``s`` and the
engine's end token stop it on the device); read every row's tokens and
count back in ONE ``.tolist()`` with the joining requests' first tokens;
record the tokens, keep the slots (whole pages) the row used, free the
others, retire the finished requests and merge the joining ones. With
``Engine(logprobs=n)`` each step's entries come back in one more read; with
``Engine(check=True)`` each launch is checked against single eager steps.

A row that continues took all ``N`` steps (a row stopping earlier has
emitted its end token or spent its budget), so the batch advances by ``N``
positions and each row feeds its last token to the next launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphrunner import GraphRunner
from graphrunner.phases import STEPS_LEFT, SpecBatch, check_steps_per_launch, with_sampling
from graphrunner.pools import PoolExhausted
from graphrunner_ref.engine.model_runner import ModelRunner
from graphrunner_ref.engine.multistep_runner import multistep_of
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.results import EngineStats, LiveRequest, Run, StepPlan, StepResult
from graphrunner_ref.engine.sampling import StepOut

__all__ = ["MultiStepSchedule", "Reservation", "check_multistep", "keep_used"]


def check_multistep(
    runner: GraphRunner,
    steps_per_launch: object,
    end_token: int | None,
    overlap: bool,
    check: bool,
    logprobs: object,
) -> int:
    """``steps_per_launch`` checked against the engine's other options and the
    runner's (steps, end token); returns it. ``overlap``, ``check`` and
    ``logprobs`` combine with every N (launch i+1 prepared while launch i runs:
    :class:`~graphrunner_ref.engine.multistep_overlap.MultiStepOverlapSchedule`;
    each launch checked by :meth:`~graphrunner_ref.engine.check.CheckMode.launch`;
    each step's entry read)."""
    steps = check_steps_per_launch("steps_per_launch", steps_per_launch)
    built, built_end = multistep_of(runner)
    if built != steps:
        raise ValueError(
            f"steps_per_launch={steps}: the runner runs {built} decode step(s) per launch; "
            f"build it with create_decode_runner(..., steps_per_launch={steps})"
        )
    if steps == 1:
        return steps
    if built_end != end_token:
        raise ValueError(
            f"end_token={end_token!r}: the runner's multi-step launch stops rows at "
            f"{built_end!r}; build it with create_decode_runner(..., end_token={end_token!r})"
        )
    return steps


@dataclass(frozen=True, slots=True)
class Reservation:
    """One row's KV for a launch (host ints): ``slots[j]`` is the slot of its
    step ``j`` (``budget`` of them); ``fresh`` the whole pages allocated for it,
    page by page (page size 1: the slots themselves)."""

    slots: list[int]
    budget: int
    fresh: list[list[int]]


class MultiStepSchedule:
    """Reserve, launch ``N`` decode steps, read back once (the plan's chunks
    prefilled first): the several-steps-per-launch variant of a step's run."""

    def __init__(self, model: ModelRunner, steps: int) -> None:
        self.model = model
        self.steps = steps

    def end(self) -> None:
        pass

    def run(self, run: Run, plan: StepPlan) -> StepResult:
        """``plan``'s chunks, then one launch of its rows, one read back; each
        row keeps the KV its steps used (the rest freed)."""
        model = self.model
        completed = model.prefill(run, plan.chunks)
        first_ids = torch.stack([ids for _, ids in completed]) if completed else model.empty()
        live, n = list(plan.decode), self.steps
        bs = len(live)
        decoded: list[tuple[LiveRequest, list[int]]] = []
        if not bs:
            host = first_ids.tolist()
        else:
            reservations = self.reserve(live)
            try:
                out = self.launch(run, reservations)
            except BaseException:  # the fresh pages are no request's yet
                model.bundle.kv_alloc.free([s for r in reservations for p in r.fresh for s in p])
                raise
            tokens, count = out["tokens"], out["count"]
            host = torch.cat([tokens.flatten(), count, first_ids]).tolist()  # the one sync
            run.stats.syncs += 1
            counts = host[bs * n : bs * n + bs]
            if model.logprobs:  # a read back of its own: only when asked
                self.record_logprobs(live, out, counts)
            batch = run.batch  # a row that continues took every step: it feeds its last
            batch.input_ids = tokens[:, -1]
            batch.seq_lens, batch.seq_lens_cpu = batch.seq_lens + n, batch.seq_lens_cpu + n
            for i, (req, r) in enumerate(zip(live, reservations, strict=True)):
                keep_used(model.bundle, req, r, counts[i])
                decoded.append((req, host[i * n : i * n + counts[i]]))
            run.stats.decode_tokens += sum(counts)
        firsts = host[len(host) - len(completed) :]
        joining = [(req, t) for (req, _), t in zip(completed, firsts, strict=True)]
        return StepResult(decoded, joining, first_ids, n if bs else 0)

    def reserve(
        self, live: list[LiveRequest], ahead: Sequence[int] | None = None
    ) -> list[Reservation]:
        """Each row's slots for the launch, recorded in ``req_to_token``;
        ``ahead[i]``: tokens ``live[i]`` emits before it that are not in its
        ``tokens`` yet (overlap: not read back; its ``slots`` already hold them)."""
        b = self.model.bundle
        page = b.page_size
        needs = []
        for i, req in enumerate(live):
            left = req.request.max_new_tokens - len(req.tokens) - (ahead[i] if ahead else 0)
            budget = min(self.steps, left)
            length = len(req.slots)
            needs.append((budget, -(-max(length + budget - len(req.pages), 0) // page)))
        total = sum(pages for _, pages in needs) * page
        if total > b.kv_alloc.available_size():
            raise PoolExhausted(total, b.kv_alloc.available_size(), "KV token slots", "launch")
        fresh_all = b.kv_alloc.alloc(total) if total else []
        plan, at = [], 0
        try:
            for req, (budget, pages) in zip(live, needs, strict=True):
                fresh = [fresh_all[at + k * page : at + (k + 1) * page] for k in range(pages)]
                at += pages * page
                owned = req.pages + [s for p in fresh for s in p]
                length = len(req.slots)
                slots = owned[length : length + budget]
                b.req_pool.write(req.req_index, length, slots)
                plan.append(Reservation(slots, budget, fresh))
        except BaseException:  # no request owns them yet
            b.kv_alloc.free(fresh_all)
            raise
        return plan

    def launch(
        self, run: Run, plan: list[Reservation], *, timed: bool = True
    ) -> dict[str, torch.Tensor]:
        """The runner's launch; returns its outputs: ``tokens`` int64 ``[bs, N]``,
        ``count`` ``[bs]`` (and the log-probabilities when the runner has them).
        ``timed=False``: no device sync around it (overlap times its whole step)."""
        batch, n = run.batch, self.steps
        lens = batch.seq_lens_cpu
        slots = [r.slots + [0] * (n - r.budget) for r in plan]
        inputs = SpecBatch(
            req_pool_indices_cpu=batch.req_pool_indices_cpu,
            seq_lens_cpu=lens + 1,
            req_pool_indices=batch.req_pool_indices,
            input_ids=batch.input_ids,
            positions=lens,
            seq_lens=lens + 1,
            out_cache_loc=torch.tensor([s for row in slots for s in row], dtype=torch.int64),
            **{STEPS_LEFT: torch.tensor([r.budget for r in plan], dtype=torch.int64)},
        )
        model = self.model
        if model.sampling:
            inputs = with_sampling(inputs, model.sampling_rows.of(run.live))
        stats: EngineStats = run.stats

        def replay() -> StepOut:
            return model.launch(inputs)

        if model.check_mode is not None:
            out = model.check_mode.launch(inputs, [r.budget for r in plan], stats, replay)
        elif not timed:
            out = replay()
        else:
            out, seconds = model.timed(replay)
            stats.decode_seconds += seconds
        if not isinstance(out, dict):
            raise TypeError("a multi-step runner returns a dict of outputs; got a tensor")
        lp = model.logprobs
        if lp and ("logprob" not in out or out["top_ids"].shape[-1] != lp):
            raise ValueError(
                f"logprobs={lp}: the runner's launch does not return {lp} top log-probabilities; "
                f"build it with create_decode_runner(..., sampling=True, logprobs={lp})"
            )
        stats.steps += n
        stats.launches += 1
        stats.batch_sizes[len(plan)] = stats.batch_sizes.get(len(plan), 0) + 1
        return out

    def record_logprobs(
        self, live: list[LiveRequest], out: dict[str, torch.Tensor], count: list[int]
    ) -> None:
        """Append each row's entries of the steps it took (``count[i]`` of
        ``live[i]``), in order, from the launch's ``[bs, N]`` / ``[bs, N, n]``
        log-probability outputs."""
        n = self.model.logprobs
        steps = self.steps
        parts = [out[k].flatten().double() for k in ("logprob", "top_logprobs", "top_ids")]
        host = torch.cat(parts).tolist()  # float64 holds float32 values and ids exactly
        rows = len(live) * steps
        chosen, top, ids = host[:rows], host[rows : rows * (1 + n)], host[rows * (1 + n) :]
        for i, (req, c) in enumerate(zip(live, count, strict=True)):
            for k in range(i * steps, i * steps + c):
                pairs = zip(ids[k * n : (k + 1) * n], top[k * n : (k + 1) * n], strict=True)
                req.logprobs.append((chosen[k], [(int(t), v) for t, v in pairs]))


def keep_used(bundle: ServingBundle, req: LiveRequest, r: Reservation, c: int) -> None:
    """``req`` took ``c`` steps of its reservation ``r``: it keeps the fresh
    pages its KV reaches and those steps' slots; the other pages are freed."""
    page = bundle.page_size
    length = len(req.slots) + c  # its KV length after the launch
    # fresh page k starts at position len(req.pages) + k * page
    used = sum(1 for k in range(len(r.fresh)) if len(req.pages) + k * page < length)
    for p in r.fresh[:used]:
        req.pages.extend(p)
    bundle.kv_alloc.free([s for p in r.fresh[used:] for s in p])
    req.slots.extend(r.slots[:c])
