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
from graphrunner.declare import StepInputs
from graphrunner.phases import STEPS_LEFT, SpecBatch, check_steps_per_launch, with_sampling
from graphrunner.pools import PoolExhausted
from graphrunner_ref.engine.check import CheckMode
from graphrunner_ref.engine.multistep_runner import multistep_of
from graphrunner_ref.engine.results import EngineStats, LiveRequest, Run
from graphrunner_ref.engine.sampling import StepOut
from graphrunner_ref.engine.steps import EngineSteps

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
    """Admit, reserve, launch ``N`` decode steps, read back once, retire, merge."""

    def __init__(self, steps: int, check: CheckMode | None = None) -> None:
        self.steps = steps
        self.check = check

    def begin(self, engine: EngineSteps, max_steps: int | None) -> None:
        pass

    def end(self, engine: EngineSteps) -> None:
        pass

    def step(self, engine: EngineSteps, run: Run) -> int:
        joining = engine.admit(run)
        first_ids = torch.stack([ids for _, ids in joining]) if joining else engine.empty()
        bs, n = len(run.live), self.steps
        if not bs:
            host = first_ids.tolist()
        else:
            plan = self.reserve(engine, run.live)
            try:
                out = self.launch(engine, run, plan)
            except BaseException:  # the fresh pages are no request's yet
                engine.bundle.kv_alloc.free([s for r in plan for p in r.fresh for s in p])
                raise
            tokens, count = out["tokens"], out["count"]
            host = torch.cat([tokens.flatten(), count, first_ids]).tolist()  # the one sync
            run.stats.syncs += 1
            if engine.logprobs:  # a read back of its own: only when asked
                self.record_logprobs(engine, run.live, out, host[bs * n : bs * n + bs])
            batch = run.batch  # a row that continues took every step: it feeds its last
            batch.input_ids = tokens[:, -1]
            batch.seq_lens, batch.seq_lens_cpu = batch.seq_lens + n, batch.seq_lens_cpu + n
            self.retire(engine, run, plan, host[: bs * n], host[bs * n : bs * n + bs])
        stay = [
            j
            for j, (req, _) in enumerate(joining)
            if not engine.advance(run, req, host[-len(joining) + j])
        ]
        if stay:
            engine.join(run, [joining[j][0] for j in stay], first_ids[stay])
        return n if bs else 0

    def reserve(
        self, engine: EngineSteps, live: list[LiveRequest], ahead: Sequence[int] | None = None
    ) -> list[Reservation]:
        """Each row's slots for the launch, recorded in ``req_to_token``;
        ``ahead[i]``: tokens ``live[i]`` emits before it that are not in its
        ``tokens`` yet (overlap: not read back; its ``slots`` already hold them)."""
        b, page = engine.bundle, engine.bundle.page_size
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
        self, engine: EngineSteps, run: Run, plan: list[Reservation], *, timed: bool = True
    ) -> dict[str, torch.Tensor]:
        """The runner's launch; returns its outputs: ``tokens`` int64 ``[bs, N]``,
        ``count`` ``[bs]`` (and the log-probabilities when the runner has them).
        ``timed=False``: no device sync around it (overlap times its whole step)."""
        batch, n = run.batch, self.steps
        lens = batch.seq_lens_cpu
        slots = [r.slots + [0] * (n - r.budget) for r in plan]
        inputs: StepInputs = SpecBatch(
            req_pool_indices_cpu=batch.req_pool_indices_cpu,
            seq_lens_cpu=lens + 1,
            req_pool_indices=batch.req_pool_indices,
            input_ids=batch.input_ids,
            positions=lens,
            seq_lens=lens + 1,
            out_cache_loc=torch.tensor([s for row in slots for s in row], dtype=torch.int64),
            **{STEPS_LEFT: torch.tensor([r.budget for r in plan], dtype=torch.int64)},
        )
        if engine.sampling:
            inputs = with_sampling(inputs, engine.sampling_rows.of(run.live))
        stats: EngineStats = run.stats

        def replay() -> StepOut:
            return engine.launch(inputs)

        if self.check is not None:
            out = self.check.launch(inputs, [r.budget for r in plan], stats, replay)
        elif not timed:
            out = replay()
        else:
            out, seconds = engine.timed(replay)
            stats.decode_seconds += seconds
        if not isinstance(out, dict):
            raise TypeError("a multi-step runner returns a dict of outputs; got a tensor")
        lp = engine.logprobs
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
        self,
        engine: EngineSteps,
        live: list[LiveRequest],
        out: dict[str, torch.Tensor],
        count: list[int],
    ) -> None:
        """Append each row's entries of the steps it took (``count[i]`` of
        ``live[i]``), in order, from the launch's ``[bs, N]`` / ``[bs, N, n]``
        log-probability outputs."""
        n = engine.logprobs
        steps = self.steps
        parts = [out[k].flatten().double() for k in ("logprob", "top_logprobs", "top_ids")]
        host = torch.cat(parts).tolist()  # float64 holds float32 values and ids exactly
        rows = len(live) * steps
        chosen, top, ids = host[:rows], host[rows : rows * (1 + n)], host[rows * (1 + n) :]
        for i, (req, c) in enumerate(zip(live, count, strict=True)):
            for k in range(i * steps, i * steps + c):
                pairs = zip(ids[k * n : (k + 1) * n], top[k * n : (k + 1) * n], strict=True)
                req.logprobs.append((chosen[k], [(int(t), v) for t, v in pairs]))

    def retire(
        self,
        engine: EngineSteps,
        run: Run,
        plan: list[Reservation],
        tokens: list[int],
        count: list[int],
    ) -> None:
        """Record each row's tokens, keep the KV it used, free the rest, retire the finished."""
        n, keep = self.steps, []
        for i, (req, r) in enumerate(zip(list(run.live), plan, strict=True)):
            keep_used(engine, req, r, count[i])
            if self.record(engine, run, req, tokens[i * n : (i + 1) * n], count[i]):
                engine.free(run, req)
            else:
                keep.append(i)
        if len(keep) < len(run.live):
            run.batch.filter(keep)
            run.live[:] = [run.live[i] for i in keep]

    def record(
        self, engine: EngineSteps, run: Run, req: LiveRequest, tokens: list[int], c: int
    ) -> bool:
        """Record the ``c`` tokens ``req`` took of its row ``tokens`` (``N``);
        returns whether it finished (a row that did not took all ``N``). The
        engine's ``stop`` hook (a stop string, a cancelled request) may end it
        inside the launch: its later tokens are dropped, their KV freed with it."""
        run.stats.decode_tokens += c
        done = False
        for k, token in enumerate(tokens[:c]):
            done = engine.record_token(run, req, token)
            if done and k != c - 1:
                if token != engine.end_token:
                    return True  # the stop hook ended it here
                raise RuntimeError(
                    f"request {req.request.rid} finished at step {k} of the launch but the "
                    f"runner kept it for {c}: its end token differs from the engine's"
                )
        if not done and c != self.steps:
            raise RuntimeError(
                f"request {req.request.rid} took {c} of {self.steps} steps and did not finish"
            )
        return done


def keep_used(engine: EngineSteps, req: LiveRequest, r: Reservation, c: int) -> None:
    """``req`` took ``c`` steps of its reservation ``r``: it keeps the fresh
    pages its KV reaches and those steps' slots; the other pages are freed."""
    page = engine.bundle.page_size
    length = len(req.slots) + c  # its KV length after the launch
    # fresh page k starts at position len(req.pages) + k * page
    used = sum(1 for k in range(len(r.fresh)) if len(req.pages) + k * page < length)
    for p in r.fresh[:used]:
        req.pages.extend(p)
    engine.bundle.kv_alloc.free([s for p in r.fresh[used:] for s in p])
    req.slots.extend(r.slots[:c])
