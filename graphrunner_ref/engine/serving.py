"""The one engine path: build the model an :class:`EngineConfig` names,
serve a trace on it, and hand back what a report reads.

``demo``, ``generate`` and ``serve`` run through here whatever the mode: :func:`build`
asks the model registry for the config's kind (its refusals first) and
loads it; :func:`serve` captures a decode runner (the sampled step when a
request samples or log-probabilities are asked, N steps a launch, a future
map for overlap) and runs :class:`~graphrunner_ref.engine.loop.Engine` over
it, or the speculative engine with ``config.speculative``;
:func:`open_engine` builds the same engine for requests added one at a time
(``graphrunner serve``);
:func:`baseline` is plain decoding of the same trace, what the other modes
are compared with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphrunner import FutureMap, GraphRunner
from graphrunner.sizing import CaptureReport
from graphrunner_ref.engine.admission import extends_prefix
from graphrunner_ref.engine.bundle import (  # registers the built-in kinds
    create_decode_runner,
    create_token_runner,
    takes_token_batches,
)
from graphrunner_ref.engine.config import DEFAULT_BATCHED_TOKENS, EngineConfig, UsageError
from graphrunner_ref.engine.loop import Engine, EngineResult
from graphrunner_ref.engine.registry import ModelKind, ServingBundle, kind_for
from graphrunner_ref.engine.spec_factory import caches_prefix, speculative_engine
from graphrunner_ref.engine.spec_stats import SpeculativeResult
from graphrunner_ref.engine.workload import Request, check_penalties
from graphrunner_ref.model.build import ModelBundle

__all__ = [
    "Hooks",
    "OnCapture",
    "Outcome",
    "baseline",
    "build",
    "model_kind",
    "open_engine",
    "penalized",
    "samples",
    "structured_runner",
    "serve",
    "token_budget",
]

#: Called once a runner is captured, before the run (a report's capture line).
OnCapture = Callable[[GraphRunner, CaptureReport], None]


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a run calls as it goes (as :class:`Engine` takes them), and the
    token that ends a request (None: each runs to its token budget)."""

    end_token: int | None = None
    on_token: Callable[[int, int], None] | None = None
    on_finish: Callable[[int, list[int]], None] | None = None
    stop: Callable[[int, list[int]], bool] | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """A served run: its result, and the decode runner with its capture
    report (None for a speculative run, whose runners are its engine's),
    and the token-batch runner of its prompt chunks."""

    result: EngineResult | SpeculativeResult
    runner: GraphRunner | None = None
    capture: CaptureReport | None = None
    #: The token-batch runner the prompt chunks went through (None: eagerly).
    token_runner: GraphRunner | None = None


def model_kind(config: EngineConfig) -> ModelKind:
    """The registered kind that serves ``config``'s model, once it accepted
    every option (:class:`UsageError` naming the one it refuses)."""
    kind = kind_for(config)
    kind.check(config)
    return kind


def build(config: EngineConfig, max_requests: int, context: int) -> ServingBundle:
    """The model ``config`` names over pools for ``max_requests`` requests of
    ``context`` tokens, loaded by its kind (``config.threads`` set first)."""
    kind = model_kind(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    return kind.load(config, max_requests, context)


def samples(trace: Sequence[Request]) -> bool:
    """Whether any request of ``trace`` samples (temperature > 0)."""
    return any(r.samples for r in trace)


def penalized(trace: Sequence[Request]) -> bool:
    """Whether any request of ``trace`` has a penalty or a logit bias."""
    return any(r.sampling is not None and r.sampling.penalized for r in trace)


def serve(
    config: EngineConfig,
    bundle: ServingBundle,
    trace: Sequence[Request],
    *,
    hooks: Hooks | None = None,
    progress: bool = False,
    run_progress: bool | None = None,
    on_capture: OnCapture | None = None,
) -> Outcome:
    """Serve ``trace`` on ``bundle`` as ``config`` says (``config.check``:
    each step, or launch, also run eagerly; not with overlap, whose check
    is a comparison with :func:`baseline`). ``progress``: the capture's bars
    (and the run's, unless ``run_progress`` says otherwise)."""
    hooks = hooks or Hooks()
    if config.speculative:
        check_penalties(trace, False, bundle.config.vocab_size)  # refused by name
        return Outcome(_speculative(config, bundle, trace, hooks, progress))
    engine = open_engine(
        config, bundle, hooks=hooks, progress=progress, on_capture=on_capture, trace=trace
    )
    shown = progress if run_progress is None else run_progress
    result = engine.run(trace, max_steps=config.max_steps, progress=shown)
    return Outcome(result, engine.runner, engine.runner.capture_report, engine.token_runner)


def open_engine(
    config: EngineConfig,
    bundle: ServingBundle,
    *,
    hooks: Hooks | None = None,
    progress: bool = False,
    on_capture: OnCapture | None = None,
    trace: Sequence[Request] | None = None,
) -> Engine:
    """The :class:`Engine` ``config`` names over ``bundle``, its runners
    captured (``on_capture`` called for each): requests then go in through
    :meth:`Engine.add_request` and out of :meth:`Engine.step`, or a whole
    trace through :meth:`Engine.run`. ``trace``: the requests it will serve,
    when known (the plain argmax step when none samples); None: any request
    may come, so the runner samples. Not for ``config.speculative`` (its
    engine takes whole traces only)."""
    hooks = hooks or Hooks()
    if config.speculative:
        raise UsageError(f"--speculative {config.speculative}: expected a trace, not online")
    options = _runner_options(config, bundle, trace, hooks, progress)
    runner = create_decode_runner(bundle, config.runner, **options)
    capture = runner.capture()
    if on_capture is not None:
        on_capture(runner, capture)
    budget = token_budget(config, bundle)
    tokens = _token_runner(config, bundle, budget, progress)
    if tokens is not None and on_capture is not None:
        on_capture(tokens, tokens.capture_report)  # type: ignore[arg-type]
    return Engine(
        bundle,
        runner,
        check=config.check and not config.overlap,
        end_token=hooks.end_token,
        on_finish=hooks.on_finish,
        on_token=hooks.on_token,
        stop=hooks.stop,
        overlap=config.overlap,
        atol=config.atol,
        seed=config.seed,
        logprobs=config.logprobs,
        steps_per_launch=config.steps_per_launch,
        max_num_batched_tokens=budget,
        token_runner=tokens,
        prefix_caching=config.prefix_caching and extends_prefix(bundle),
    )


def baseline(
    config: EngineConfig,
    bundle: ServingBundle,
    trace: Sequence[Request],
    *,
    end_token: int | None = None,
    progress: bool = False,
    run_progress: bool = False,
    on_capture: OnCapture | None = None,
) -> Outcome:
    """Plain decoding of ``trace`` on the same pools (one step a launch, no
    overlap, no draft, no eager check): greedy, or sampled by the trace's own
    parameters from the same run seed, so an overlapped or multi-step run of
    the same trace draws the same tokens."""
    plain = dataclasses.replace(
        config,
        speculative=None,
        overlap=False,
        steps_per_launch=1,
        check=False,
        logprobs=0,
        prefix_caching=False,
    )
    hooks = Hooks(end_token=end_token)
    return serve(
        plain,
        bundle,
        trace,
        hooks=hooks,
        progress=progress,
        run_progress=run_progress,
        on_capture=on_capture,
    )


def token_budget(config: EngineConfig, bundle: ServingBundle) -> int | None:
    """The engine's ``max_num_batched_tokens`` for ``bundle``: None with
    chunked prefill off, the one given, or the default where the model's
    prefill extends a cached prefix (a Mamba / hybrid model's prompts are
    prefilled whole unless a budget was given, which the engine refuses)."""
    if not config.chunked_prefill:
        return None
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return DEFAULT_BATCHED_TOKENS if extends_prefix(bundle) else None


def _token_runner(
    config: EngineConfig, bundle: ServingBundle, budget: int | None, progress: bool
) -> GraphRunner | None:
    """The captured token-batch runner the run's prompt chunks go through:
    with chunked prefill on a model that runs token batches, sized by
    ``config.token_capture_sizes`` (empty: the library's sizes up to the
    budget); None otherwise (each chunk eagerly)."""
    if budget is None or not config.token_batches or not takes_token_batches(bundle):
        return None
    runner = create_token_runner(
        bundle,
        config.runner,
        budget,
        capture_sizes=list(config.token_capture_sizes) or None,
        show_progress=progress,
        check_padding=config.check_padding,
        **config.mechanism_options,
        **_aot_options(config),
    )
    runner.capture()
    return runner


def _aot_options(config: EngineConfig) -> dict[str, Any]:
    """The saved-program folder, for the CPU runner where one is named."""
    named = config.aot_cache is not None and config.runner == "cpu"
    return {"aot_cache": config.aot_cache} if named else {}


def _runner_options(
    config: EngineConfig,
    bundle: ServingBundle,
    trace: Sequence[Request] | None,
    hooks: Hooks,
    progress: bool,
) -> dict[str, Any]:
    """``create_decode_runner``'s options for this run: the sampled step when
    a request samples, may sample (no ``trace``: any may come) or log-probabilities are asked
    (the plain argmax step otherwise), a future map for overlap, N steps a launch (with the end
    token the rows stop at)."""
    options: dict[str, Any] = {
        "capture_sizes": list(config.capture_sizes) or None,
        "check_padding": config.check_padding,
        "show_progress": progress,
        **config.mechanism_options,
        **_aot_options(config),
    }
    if config.logprobs or trace is None or samples(trace) or penalized(trace):
        options["sampling"] = True
    # Online, any request may bring penalties; a checked run refuses them by name.
    checked = config.check and not config.overlap
    if not checked and (trace is None or penalized(trace)):
        options["penalties"] = True
    if structured_runner(config) and (trace is None or any(r.grammar for r in trace)):
        options["structured"] = options["sampling"] = True
    if config.logprobs:
        options["logprobs"] = config.logprobs
    if config.overlap:
        options["future_map"] = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    if config.steps_per_launch > 1:
        options |= {"steps_per_launch": config.steps_per_launch, "end_token": hooks.end_token}
    return options


def structured_runner(config: EngineConfig) -> bool:
    """Whether ``config``'s decode runner can mask a grammar's tokens in its
    step (structured output): one step a launch, no overlap, no check mode
    and no speculative decoding, since each step's bitmask follows the last
    step's token on the host."""
    return not (config.check or config.overlap or config.steps_per_launch > 1 or config.speculative)


def _speculative(
    config: EngineConfig,
    bundle: ServingBundle,
    trace: Sequence[Request],
    hooks: Hooks,
    progress: bool,
) -> SpeculativeResult:
    if not isinstance(bundle, ModelBundle):  # the draft heads read the native decoder
        raise UsageError(f"--speculative {config.speculative}: expected the native model")
    method = config.speculative or ""
    engine = speculative_engine(
        bundle,
        config.runner,
        method=method,
        draft=config.draft,
        k=config.draft_tokens,
        capture_sizes=list(config.capture_sizes) or None,
        seed=config.seed,
        run_seed=config.seed,
        check_padding=config.check_padding,
        show_progress=progress,
        end_token=hooks.end_token,
        logprobs=config.logprobs,
        prefix_caching=config.prefix_caching and caches_prefix(method, config.draft),
        **config.mechanism_options,
    )
    return engine.run(trace, max_steps=config.max_steps, progress=progress)
