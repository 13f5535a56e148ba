"""What an engine run keeps and returns: its statistics and result, the
per-request and per-run state the step's stages share, a step's plan and
what running it gave (:class:`StepPlan`, :class:`StepResult`), and the
admission error."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch

from graphrunner import DecodeBatch
from graphrunner.sizing import BatchSizeHistogram, PaddingWaste
from graphrunner_ref.engine.grammar import GrammarMatcher
from graphrunner_ref.engine.workload import Request

__all__ = [
    "AdmissionError",
    "Chunk",
    "EngineResult",
    "EngineStats",
    "FinishReason",
    "LiveRequest",
    "RequestOutput",
    "Run",
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
]

#: One generated token's log-probabilities (unfiltered softmax): its own, and
#: the top N as ``(token id, log-probability)``, most probable first.
TokenLogprobs: TypeAlias = tuple[float, list[tuple[int, float]]]


#: Why a request finished, as vLLM and OpenAI name it: ``"stop"`` (the end
#: token or the ``stop`` hook), ``"length"`` (its token budget) or ``"abort"``
#: (:meth:`Engine.abort <graphrunner_ref.engine.loop.Engine.abort>`).
FinishReason: TypeAlias = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class RequestOutput:
    """What one :meth:`Engine.step <graphrunner_ref.engine.loop.Engine.step>`
    gave one request: its new ``tokens`` (with their ``logprobs`` when the
    engine collects them), and on its last output why it finished.

    ``tokens`` may be empty: a request aborted while it waited, or one whose
    last step produced nothing new.
    """

    rid: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    #: Its prompt tokens whose KV the prefix cache held (0 until admitted).
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AdmissionError(RuntimeError):
    """An arrived request can never be admitted: nothing is running that could
    free the rows or KV pages it needs (they are held outside the run)."""


@dataclass(slots=True)
class EngineStats:
    """What a run did. ``decode_seconds`` and ``eager_seconds`` are wall time
    around the forward calls only, with a device sync on CUDA so they measure
    the work, not the launch; ``step_seconds`` and ``prefill_seconds`` are the
    host's wall time of whole steps and of their admission."""

    steps: int = 0  # decode steps
    prefills: int = 0  # prompts whose prefill finished
    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held instead
    prefill_chunks: int = 0  # forward_extend calls: one per prompt unless chunked
    decode_tokens: int = 0  # live rows over all decode steps
    decode_seconds: float = 0.0  # in runner.replay
    step_seconds: float = 0.0  # wall time of the run's steps: admission, decode, bookkeeping
    prefill_seconds: float = 0.0  # wall time in admission: prefill chunks, first tokens
    eager_seconds: float = 0.0  # in the eager reference (check mode)
    live_rows: int = 0
    padded_rows: int = 0
    checked_steps: int = 0
    mismatches: int = 0  # checked steps outside tolerance
    token_flips: int = 0  # rows whose greedy token differs (near-ties, inside tolerance)
    max_logit_diff: float = 0.0
    max_kv_diff: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # decode launches per live bs
    launches: int = 0  # runner launches (N decode steps each with steps_per_launch=N)
    syncs: int = 0  # device-to-host reads of decode tokens
    sanitized_replays: int = 0  # replays the runner's padding sanitizer checked (0: none)
    sanitizer_seconds: float = 0.0  # host seconds those checks took

    @property
    def decode_wall_seconds(self) -> float:
        """The steps' wall time outside admission: each decode step whole
        (its batch prepared, the replay, the tokens read back and recorded,
        finished requests retired), where :attr:`decode_seconds` is the
        replays alone. On a GPU a prefill's device work may land here (it is
        waited for at the step's read back)."""
        return self.step_seconds - self.prefill_seconds

    @property
    def admitted_prompt_tokens(self) -> int:
        """Prompt tokens of the admitted requests: computed or cached."""
        return self.cached_tokens + self.prefill_tokens

    @property
    def prefix_hit_rate(self) -> float:
        """The admitted prompt tokens' share that the prefix cache held."""
        prompt = self.admitted_prompt_tokens
        return self.cached_tokens / prompt if prompt else 0.0

    @property
    def launches_per_token(self) -> float:
        return self.launches / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def syncs_per_token(self) -> float:
        return self.syncs / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def wall_tokens_per_second(self) -> float:
        """Decode tokens over :attr:`decode_wall_seconds` (each decode step
        whole, as another engine's loop is timed), where
        :attr:`tokens_per_second` counts the replays alone."""
        wall = self.decode_wall_seconds
        return self.decode_tokens / wall if wall > 0 else 0.0

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
    that reached their budget or the end token (others were cut by max_steps);
    ``logprobs``: with ``Engine(logprobs=N)``, one :data:`TokenLogprobs` per
    generated token by request id (``logprobs[rid][i]`` is
    ``outputs[rid][i]``'s), else empty."""

    outputs: dict[int, list[int]]
    finished: frozenset[int]
    stats: EngineStats
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass(slots=True)
class LiveRequest:
    """A request while it is served: its request-pool row, its KV slots and
    pages (host ints), its tokens so far, its sampling seed."""

    request: Request
    req_index: int
    slots: list[int] = field(default_factory=list)  # KV slot per position, host ints
    pages: list[int] = field(default_factory=list)  # every slot of its whole pages: to free
    tokens: list[int] = field(default_factory=list)
    seed: int = 0  # its sampling seed: its own, or derived from the run seed and its id
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per token, when asked
    prefilled: int = 0  # prompt tokens already in the KV cache (chunked prefill)
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    matcher: GrammarMatcher | None = None  # its grammar's state (structured output)


@dataclass(slots=True)
class Run:
    """The state of one :meth:`Engine.run`; ``live[i]`` is row ``i`` of ``batch``."""

    pending: deque[Request]
    batch: DecodeBatch
    live: list[LiveRequest] = field(default_factory=list)
    # Admitted, their prompt partly in the KV cache: a chunk more each step, in order.
    prefilling: list[LiveRequest] = field(default_factory=list)
    held: dict[int, LiveRequest] = field(
        default_factory=dict
    )  # by rid: pool rows / KV pages to free
    finished: set[int] = field(default_factory=set)
    stats: EngineStats = field(default_factory=EngineStats)
    clock: int = 0  # engine steps, idle ones included: what arrival_step counts
    max_steps: int | None = None  # the decode steps it may take (None: no bound)


#: One prompt chunk of a step: the request, and its prompt tokens ``start:end``.
Chunk: TypeAlias = tuple[LiveRequest, int, int]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step as the scheduler decided it
    (:meth:`~graphrunner_ref.engine.scheduler.Scheduler.plan`), before any of
    it runs.

    decode: the running requests this step decodes, row ``i`` of the batch
        ``decode[i]`` (the run's ``live`` when planned).
    chunks: the prompt chunks it prefills, in order, each attending to the
        KV its earlier chunks wrote; a chunk that ends its prompt gives its
        request's first token.
    admitted: the requests that took a request row and their prompt's KV
        pages this step (their first chunk is among ``chunks``, unless the
        token budget ran out before it).
    """

    decode: tuple[LiveRequest, ...] = ()
    chunks: tuple[Chunk, ...] = ()
    admitted: tuple[LiveRequest, ...] = ()


@dataclass(slots=True)
class StepResult:
    """What running a :class:`StepPlan` gave, read back to the host, for the
    postprocess (:class:`~graphrunner_ref.engine.postprocess.Postprocess`) to
    record: new tokens, ends, frees, joins.

    decoded: each decoded row's request and the tokens it took this step
        (host ints; a launch of several steps may give fewer than ``steps``
        to a row that ended inside it), in row order.
    completed: the requests whose prefill completed, each with its first
        token (host int), in order.
    first_ids: those first tokens on the device ``[len(completed)]``: what
        a completed request feeds its first decode step.
    steps: the decode steps the launch ran (0: no decode this step).
    """

    decoded: list[tuple[LiveRequest, list[int]]] = field(default_factory=list)
    completed: list[tuple[LiveRequest, int]] = field(default_factory=list)
    first_ids: torch.Tensor | None = None
    steps: int = 0
