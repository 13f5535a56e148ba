"""Overlap scheduling in the engine: step N+1 is scheduled on the host while
step N runs on the device.

Each step stores its sampled tokens in the runner's
:class:`~graphrunner.core.future_map.FutureMap` and starts copying them to the host
(pinned memory and an event on CUDA). While the device works, the host admits
and prefills arrivals, retires the requests whose budget ends with this step,
merges the new ones and prepares step N+1, whose ``input_ids`` are future
references resolved by populate on the device. Only then does it wait for the
copy (the one wait per step) to record tokens and slots and retire requests
that met the end token; one of those already prepared for step N+1 is dropped
from it before launch, with its fresh page freed (known on the host). On the
CPU the same control flow runs synchronously. Tokens equal the plain engine's.
With ``Engine(logprobs=N)`` step N's log-probabilities are read back with
its tokens, after the wait (no replay runs in between: they are the
runner's outputs still).
"""

from __future__ import annotations

import time

import torch

from graphrunner import FutureMap, GraphRunner
from graphrunner.core import future_refs
from graphrunner.pools import starts_page
from graphrunner_ref.engine.model_runner import ModelRunner, tokens_of
from graphrunner_ref.engine.postprocess import Postprocess
from graphrunner_ref.engine.results import LiveRequest, Run, StepPlan, StepResult
from graphrunner_ref.engine.sampling import host_logprobs, logprob_outputs, record_logprobs

__all__ = ["OverlapSchedule", "device_ints", "future_map_of"]


def future_map_of(runner: GraphRunner) -> FutureMap:
    """The future map ``runner`` was built with; a ValueError when it has none."""
    future = getattr(runner, "future_map", None)
    if not isinstance(future, FutureMap):
        raise ValueError(
            "overlap scheduling: the runner has no future map; build it with "
            "create_decode_runner(..., future_map=FutureMap(req_pool rows, device))"
        )
    return future


def device_ints(device: torch.device, values: list[int]) -> torch.Tensor:
    """``values`` as int64 on ``device``, without a sync (non_blocking from
    host memory: ``torch.tensor(..., device=)`` would sync)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


class HostCopy:
    """A device int64 vector on its way to the host: pinned buffer and event on CUDA."""

    def __init__(self, values: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    def wait(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class OverlapSchedule:
    """The overlap :class:`~graphrunner_ref.engine.schedule.Schedule` (see the module
    doc): ``Engine(bundle, runner, overlap=True)``. ``runner`` must be built with
    a future map (``create_decode_runner(..., future_map=FutureMap(...))``)."""

    def __init__(self, model: ModelRunner, post: Postprocess, runner: GraphRunner) -> None:
        self.model, self.post = model, post
        self.future = future_map_of(runner)
        # The next step, prepared before this one's tokens were read: the fresh
        # page (first slot) each starting request took there, by request id.
        self._prepared: dict[int, int] | None = None
        # Step N's log-probability outputs, read after the wait.
        self._logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def end(self) -> None:
        """A step prepared but never launched: its fresh pages are nobody's."""
        if self._prepared is not None:
            page = self.model.bundle.page_size
            slots = [s + o for s in self._prepared.values() for o in range(page)]
            self.model.bundle.kv_alloc.free(slots)
            self._prepared = None

    def run(self, run: Run, plan: StepPlan) -> StepResult:
        """Step N launched, ``plan``'s chunks prefilled and step N+1 prepared
        before the one wait; the tokens recorded here (nothing left for the
        postprocess but its callbacks)."""
        # Wall time of the whole step, host work included: timing the replay
        # alone would need a device sync, which overlap exists to avoid.
        start = time.perf_counter()
        model = self.model
        stepped = list(plan.decode)
        launched = self._launch(run) if stepped else (model.empty(), model.empty())
        joining = model.prefill(run, plan.chunks)
        first = torch.stack([ids for _, ids in joining]) if joining else model.empty()
        if joining:
            rows = [r.req_index for r, _ in joining]
            self.future.store(device_ints(model.device, rows), first)
        copy = HostCopy(torch.cat([*launched, first]))
        self._schedule(run, stepped, [r for r, _ in joining])
        self._record(run, stepped, [r for r, _ in joining], copy.wait())
        if stepped:
            run.stats.decode_seconds += time.perf_counter() - start
            run.stats.syncs += 1
        return StepResult(steps=1 if stepped else 0)

    def _launch(self, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
        """Step N on the prepared batch; its tokens go to the future map."""
        batch = run.batch
        self._prepared = None  # its fresh pages are recorded by this step's read
        out = self.model.replay(batch, run.live)
        next_ids = tokens_of(out)
        if self.model.logprobs:
            self._logprobs = logprob_outputs(out, self.model.logprobs)
        self.future.store(batch.req_pool_indices, next_ids)
        stats = run.stats
        stats.steps += 1
        stats.launches += 1
        stats.decode_tokens += batch.batch_size
        stats.batch_sizes[batch.batch_size] = stats.batch_sizes.get(batch.batch_size, 0) + 1
        return next_ids, batch.out_cache_loc

    def _schedule(self, run: Run, stepped: list[LiveRequest], joining: list[LiveRequest]) -> None:
        """Step N+1 while step N runs: keep the requests whose budget goes on,
        merge the arrivals, prepare it with future references as input ids."""
        keep = [i for i, r in enumerate(stepped) if len(r.tokens) + 1 < r.request.max_new_tokens]
        if len(keep) < len(stepped):
            run.batch.filter(keep)
            run.live[:] = [stepped[i] for i in keep]
        going = [r for r in joining if r.request.max_new_tokens > 1]
        if going:
            rows = device_ints(self.model.device, [r.req_index for r in going])
            self.post.join(run, going, future_refs(rows))
        steps_left = run.max_steps is None or run.stats.steps < run.max_steps
        if run.live and steps_left:
            refs = future_refs(run.batch.req_pool_indices)
            bundle = self.model.bundle
            fresh = run.batch.prepare_decode(bundle.req_pool, bundle.kv_alloc, refs)
            self._prepared = {run.live[i].request.rid: s for i, s in fresh.items()}

    def _record(
        self,
        run: Run,
        stepped: list[LiveRequest],
        joining: list[LiveRequest],
        host: list[int],
    ) -> None:
        """After the one wait: slots and tokens of step N, first tokens of the arrivals."""
        bs, page, post = len(stepped), self.model.bundle.page_size, self.post
        if stepped and self._logprobs is not None:
            record_logprobs(stepped, host_logprobs(self._logprobs))
            self._logprobs = None
        done: list[LiveRequest] = []
        for i, req in enumerate(stepped):
            slot = host[bs + i]
            if starts_page(len(req.slots), page):
                req.pages.extend(range(slot, slot + page))
            req.slots.append(slot)
            done += [req] if post.record_token(run, req, host[i]) else []
        firsts = host[2 * bs :]
        done += [r for r, t in zip(joining, firsts, strict=True) if post.record_token(run, r, t)]
        self._retire(run, done)

    def _retire(self, run: Run, done: list[LiveRequest]) -> None:
        """Free finished requests; one already in the prepared step leaves it,
        with the fresh page it took there."""
        scheduled = {id(r) for r in run.live}
        drop = [r for r in done if id(r) in scheduled]
        if drop:
            gone = {id(r) for r in drop}
            keep = [i for i, r in enumerate(run.live) if id(r) not in gone]
            run.batch.filter(keep)
            run.live[:] = [run.live[i] for i in keep]
            if self._prepared is not None:
                page = self.model.bundle.page_size
                for r in drop:
                    first = self._prepared.pop(r.request.rid, None)
                    if first is not None:
                        self.model.bundle.kv_alloc.free(list(range(first, first + page)))
            if not run.live:
                self._prepared = None
        for r in done:
            self.post.free(run, r)
