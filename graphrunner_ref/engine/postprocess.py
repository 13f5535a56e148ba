"""The postprocess: what a step gave, recorded.

:class:`Postprocess` takes a step's :class:`~graphrunner_ref.engine.results.StepResult`
and, for each request, appends its new tokens, decides whether it finished
(its budget, the end token or a stop token, its grammar's end, the ``stop``
hook, an abort), frees a finished request's row and pages (its full pages
stay in the prefix cache), merges the requests whose prefill completed into
the running batch, and owes each request its :class:`~graphrunner_ref.engine.results.RequestOutput`.
The callbacks (``on_token``, ``on_finish``) run last, once every row and page
is recorded. The overlap variants, which record a step's tokens inside their
run (:mod:`~graphrunner_ref.engine.overlap_schedule`), use the same
:meth:`~Postprocess.record_token`, :meth:`~Postprocess.free` and
:meth:`~Postprocess.join`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from graphrunner import DecodeBatch
from graphrunner.pools import CachedKVAllocator
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.results import (
    FinishReason,
    LiveRequest,
    RequestOutput,
    Run,
    StepResult,
)

__all__ = ["Outputs", "Postprocess"]


class Outputs:
    """The request API's books: the outputs owed by the next ``step()``, in
    the order of their events, the request each is of, and the running
    requests aborted (cut after their next token)."""

    def __init__(self) -> None:
        self.owed: dict[int, RequestOutput] = {}
        self.owner: dict[int, LiveRequest] = {}
        self.aborted: set[int] = set()

    def clear(self) -> None:
        self.owed, self.owner, self.aborted = {}, {}, set()


class Postprocess:
    """Records a step's tokens, ends, frees and joins (see the module doc).

    Args:
        bundle: the model's pools (a finished request's row and pages freed there).
        outputs: the books the outputs go to.
        end_token: a token that finishes its request (kept in the output).
        prefix_cache: where a finished request's full pages stay cached, or None.
        on_token: called with ``(rid, token)`` as each token is recorded.
        on_finish: called with ``(rid, tokens)`` as each request finishes.
        stop: called with ``(rid, tokens)`` after each recorded token; True
            finishes the request there.
    """

    def __init__(
        self,
        bundle: ServingBundle,
        outputs: Outputs,
        *,
        end_token: int | None,
        prefix_cache: CachedKVAllocator | None,
        on_token: Callable[[int, int], None] | None = None,
        on_finish: Callable[[int, list[int]], None] | None = None,
        stop: Callable[[int, list[int]], bool] | None = None,
    ) -> None:
        self.bundle, self.outputs = bundle, outputs
        self.end_token, self.prefix_cache = end_token, prefix_cache
        self.on_token, self.on_finish, self.stop = on_token, on_finish, stop
        # A step's callbacks, called after its bookkeeping (fire_callbacks).
        self.callbacks: list[Callable[[], object]] = []

    def process(self, run: Run, result: StepResult) -> None:
        """Record ``result``: each decoded row's tokens (a row that finished
        leaves the batch, its row and pages freed), each completed prompt's
        first token (one that goes on joins the batch), then the callbacks."""
        steps = result.steps
        done = [req for req, tokens in result.decoded if self.record_row(run, req, tokens, steps)]
        if done:
            gone = {id(r) for r in done}
            keep = [i for i, r in enumerate(run.live) if id(r) not in gone]
            run.batch.filter(keep)
            run.live[:] = [run.live[i] for i in keep]
            for req in done:
                self.free(run, req)
        stay = []
        for j, (req, token) in enumerate(result.completed):
            if self.record_token(run, req, token):
                self.free(run, req)
            else:
                stay.append(j)
        if stay:
            assert result.first_ids is not None
            self.join(run, [result.completed[j][0] for j in stay], result.first_ids[stay])
        self.fire_callbacks()

    def record_row(self, run: Run, req: LiveRequest, tokens: list[int], steps: int) -> bool:
        """Record the tokens a decoded row took in a launch of ``steps`` decode
        steps (all of them unless it finished inside); whether it finished. The ``stop`` hook
        (a stop string, a cancelled request) may end it inside a launch: its
        later tokens are dropped, their KV freed with it."""
        done = False
        for k, token in enumerate(tokens):
            done = self.record_token(run, req, token)
            if done and k != len(tokens) - 1:
                if token != self.end_token:
                    return True  # the stop hook ended it here
                raise RuntimeError(
                    f"request {req.request.rid} finished at step {k} of the launch but the "
                    f"runner kept it for {len(tokens)}: its end token differs from the engine's"
                )
        if not done and len(tokens) != steps:
            raise RuntimeError(
                f"request {req.request.rid} took {len(tokens)} of {steps} steps and did not finish"
            )
        return done

    def record_token(self, run: Run, req: LiveRequest, token: int) -> bool:
        """Append ``token``; when the budget, the end token, the ``stop`` hook
        or an abort ends the request, record it as finished. Returns whether
        it is done (not freed: :meth:`free`)."""
        rid = req.request.rid
        req.tokens.append(token)
        books = self.outputs
        out = books.owed.get(rid)
        if out is None:
            out = books.owed[rid] = RequestOutput(rid)
            books.owner[rid] = req
        out.tokens.append(token)
        if req.matcher is not None and not req.matcher.accept_token(token):
            raise RuntimeError(
                f"request {rid}: token {token} drawn outside its grammar; the step's "
                "token_bitmask should have masked it"
            )
        if self.on_token is not None:
            self.callbacks.append(functools.partial(self.on_token, rid, token))
        reason = self._finish_reason(req, token)
        if reason is None:
            return False
        out.finish_reason = reason
        run.finished.add(rid)
        if self.on_finish is not None:
            self.callbacks.append(functools.partial(self.on_finish, rid, req.tokens))
        return True

    def _finish_reason(self, req: LiveRequest, token: int) -> FinishReason | None:
        """Why ``req`` finishes at its last token ``token``, or None (the
        request's own ``stop`` and the engine's ``stop`` hook are asked only
        when nothing else ends it)."""
        request = req.request
        rid = request.rid
        if rid in self.outputs.aborted:
            return "abort"
        if req.matcher is not None and req.matcher.is_terminated():
            return "stop"
        if token == self.end_token and not request.ignore_eos:
            return "stop"
        if token in request.stop_token_ids:
            return "stop"
        if len(req.tokens) >= request.max_new_tokens:
            return "length"
        if request.stop is not None and request.stop(req.tokens):
            return "stop"
        if self.stop is not None and self.stop(rid, req.tokens):
            return "stop"
        return None

    def free(self, run: Run, req: LiveRequest) -> None:
        """Free ``req``'s request row and KV pages; a finished one's full
        pages (its prompt's and its output's) stay cached for later prompts."""
        del run.held[req.request.rid]
        self.bundle.req_pool.free([req.req_index])
        cache = self.prefix_cache
        if cache is not None and req.request.rid in run.finished:
            written = (*req.request.prompt, *req.tokens)[: len(req.slots)]
            cache.insert(written, req.slots)
        self.bundle.kv_alloc.free(req.pages)

    def join(self, run: Run, joining: Sequence[LiveRequest], first_ids: torch.Tensor) -> None:
        """Merge ``joining`` (prefilled; ``first_ids`` their first tokens on the
        device, or future references) into the running batch."""
        new = DecodeBatch.from_requests(
            [r.req_index for r in joining],
            [len(r.request.prompt) for r in joining],
            first_ids,
            device=self.bundle.device,
            max_context_len=self.bundle.max_context_len,
        )
        run.batch.merge(new)
        run.live.extend(joining)

    def fire_callbacks(self) -> None:
        """The step's ``on_token`` / ``on_finish`` calls, in order, once its
        bookkeeping is done: one that raises (or a Ctrl-C inside it) leaves
        every request's rows and KV pages recorded, so the run frees them all."""
        callbacks, self.callbacks = self.callbacks, []
        for call in callbacks:
            call()
