"""Overlap scheduling with several decode steps per launch:
``Engine(overlap=True, steps_per_launch=N)``.

Launch i runs ``N`` steps (:class:`~graphrunner_ref.engine.multistep.MultiStepSchedule`'s
launch); the runner stores each row's last token in its future map on the
device (:mod:`graphrunner.phases.multistep`). While it runs, the host keeps
the KV the launch reserved as if every row took all ``N`` steps, admits and
prefills arrivals, drops the rows whose budget ends inside launch i (known
on the host), merges the arrivals, and prepares launch i+1: positions and
``seq_lens`` ``N`` further, input ids future references, each row's slots
reserved. Only then does it wait for launch i's one read back (tokens, counts,
the arrivals' first tokens) to record the tokens; a row that stopped on the
end token inside launch i leaves the prepared launch, its reservation freed.
A row that stops early owns every page its launch reserved: freeing the
request frees them. Tokens equal the plain engine's; on the CPU the same
control flow runs synchronously.
"""

from __future__ import annotations

import time

import torch

from graphrunner import GraphRunner
from graphrunner.core import future_refs
from graphrunner_ref.engine.model_runner import ModelRunner
from graphrunner_ref.engine.multistep import MultiStepSchedule, Reservation, keep_used
from graphrunner_ref.engine.overlap_schedule import HostCopy, device_ints, future_map_of
from graphrunner_ref.engine.postprocess import Postprocess
from graphrunner_ref.engine.results import LiveRequest, Run, StepPlan, StepResult

__all__ = ["MultiStepOverlapSchedule"]


class MultiStepOverlapSchedule:
    """Launch i+1 prepared while launch i of ``steps`` decode steps runs (see
    the module). ``runner`` is built with ``steps_per_launch=steps`` and a
    future map (``create_decode_runner(..., future_map=FutureMap(...))``)."""

    def __init__(
        self, model: ModelRunner, post: Postprocess, runner: GraphRunner, steps: int
    ) -> None:
        self.model, self.post = model, post
        self.future = future_map_of(runner)
        self.base = MultiStepSchedule(model, steps)
        self.steps = steps
        # The prepared launch's reservations, one per row of run.live.
        self._plan: list[Reservation] | None = None

    def end(self) -> None:
        """A launch prepared but never run: its fresh pages are nobody's."""
        if self._plan is not None:
            self._free(self._plan)
            self._plan = None

    def run(self, run: Run, step: StepPlan) -> StepResult:
        """Launch i, ``step``'s chunks prefilled and launch i+1 prepared before
        the one wait; the tokens recorded here (nothing left for the
        postprocess but its callbacks)."""
        # Wall time of the whole step, host work included (no sync to time the launch).
        start = time.perf_counter()
        model, post = self.model, self.post
        stepped, n = list(step.decode), self.steps
        plan: list[Reservation] = []
        parts: list[torch.Tensor] = []
        out: dict[str, torch.Tensor] = {}
        if stepped:
            plan = self._plan if self._plan is not None else self.base.reserve(stepped)
            self._plan = None
            try:
                out = self.base.launch(run, plan, timed=False)
            except BaseException:  # the fresh pages are no request's yet
                self._free(plan)
                raise
            parts = [out["tokens"].flatten(), out["count"]]
            for req, r in zip(stepped, plan, strict=True):  # as if it took every step
                keep_used(model.bundle, req, r, r.budget)
        pairs = model.prefill(run, step.chunks)
        joining = [r for r, _ in pairs]
        first = torch.stack([ids for _, ids in pairs]) if pairs else model.empty()
        if joining:
            self.future.store(device_ints(model.device, [r.req_index for r in joining]), first)
        copy = HostCopy(torch.cat([*parts, first]))
        self._prepare(run, stepped, plan, joining)
        host = copy.wait()  # the launch's one read back
        bs = len(stepped)
        count = host[bs * n : bs * n + bs]
        if stepped and model.logprobs:  # its outputs still: no launch ran since
            self.base.record_logprobs(stepped, out, count)
        run.stats.decode_tokens += sum(count)
        done = [
            req
            for i, req in enumerate(stepped)
            if post.record_row(run, req, host[i * n : i * n + count[i]], n)
        ]
        firsts = host[bs * n + bs :]
        done += [r for r, t in zip(joining, firsts, strict=True) if post.record_token(run, r, t)]
        self._retire(run, done)
        if stepped:
            run.stats.decode_seconds += time.perf_counter() - start
            run.stats.syncs += 1
        return StepResult(steps=n if stepped else 0)

    def _prepare(
        self,
        run: Run,
        stepped: list[LiveRequest],
        plan: list[Reservation],
        joining: list[LiveRequest],
    ) -> None:
        """Launch i+1 before launch i's tokens are read: the rows whose budget
        goes on, ``N`` positions further, and the arrivals; input ids future
        references, slots reserved."""
        batch, n = run.batch, self.steps
        if stepped:
            batch.seq_lens, batch.seq_lens_cpu = batch.seq_lens + n, batch.seq_lens_cpu + n
            keep = [
                i
                for i, (req, r) in enumerate(zip(stepped, plan, strict=True))
                if len(req.tokens) + r.budget < req.request.max_new_tokens
            ]
            if len(keep) < len(stepped):
                batch.filter(keep)
                run.live[:] = [stepped[i] for i in keep]
        ahead = [n] * len(run.live)  # each kept row took all N steps, not read yet
        going = [r for r in joining if r.request.max_new_tokens > 1]
        if going:
            rows = device_ints(self.model.device, [r.req_index for r in going])
            self.post.join(run, going, future_refs(rows))
            ahead += [1] * len(going)  # its first token, not read yet
        steps_left = run.max_steps is None or run.stats.steps < run.max_steps
        if run.live and steps_left:
            run.batch.input_ids = future_refs(run.batch.req_pool_indices)
            self._plan = self.base.reserve(run.live, ahead)

    def _retire(self, run: Run, done: list[LiveRequest]) -> None:
        """Free the finished requests; one in the prepared launch leaves it,
        with its reservation's fresh pages."""
        gone = {id(r) for r in done}
        keep = [i for i, r in enumerate(run.live) if id(r) not in gone]
        if len(keep) < len(run.live):
            if self._plan is not None:
                dropped = set(range(len(run.live))) - set(keep)
                self._free([self._plan[i] for i in sorted(dropped)])
                self._plan = [self._plan[i] for i in keep] if keep else None
            run.batch.filter(keep)
            run.live[:] = [run.live[i] for i in keep]
        for r in done:
            self.post.free(run, r)

    def _free(self, plan: list[Reservation]) -> None:
        self.model.bundle.kv_alloc.free([s for r in plan for p in r.fresh for s in p])
