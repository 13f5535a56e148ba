"""``graphrunner generate``: answers to text or token-id prompts.

Text prompts (``--prompt``, or lines of ``--prompts``) go through the
checkpoint's tokenizer and, with ``--chat``, its chat template; prompt files
are read as ``--prompts-format`` (:mod:`graphrunner_ref.cli.prompts`). Answers are
greedy or sampled by ``--temperature``, ``--top-k``, ``--top-p``, ``--min-p``
and ``--seed`` (:mod:`graphrunner_ref.cli.sampling`), up to ``--max-new-tokens``
(128 by default; text stops at the end-of-sequence token), and printed as text
streamed token by token, or as one JSON record per request
(:mod:`graphrunner_ref.cli.answers`). Every model kind the registry knows is
served the same way (:mod:`graphrunner_ref.engine.serving`); ``--check``
checks each step against the eager forward, or a speculative or overlapped
run against plain decoding.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from graphrunner_ref.cli import answers as cli_answers
from graphrunner_ref.cli import checks as cli_checks
from graphrunner_ref.cli import report as cli_report
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import sizes as cli_sizes
from graphrunner_ref.cli import text as cli_text
from graphrunner_ref.cli.options import config_of
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.results import EngineStats
from graphrunner_ref.engine.workload import Request, requests_from_prompts

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Serve ``args``' prompts; print or write the answers; the exit status."""
    kind = cli_checks.check_common(args)
    model = cli_checks.model_kind(args)
    shape = model.shape(config_of(args))
    params = cli_sampling.flag_params(args)
    model_context, inputs = cli_text.check_generate(args, shape)
    prompts = inputs.prompts
    # No graph larger than the prompt count (padding it would never use).
    sizes = cli_checks.capture_sizes(args, default_max_bs=min(16, len(prompts)))
    trace = cli_sampling.apply(
        requests_from_prompts(
            prompts, max_new_tokens=args.max_new_tokens, arrive_every=args.arrive_every
        ),
        params,
        inputs.fields,
    )
    cli_sampling.check_modes(args, trace, "generate")
    cli_sampling.check_bias(trace, shape.vocab_size)
    cli_sampling.settle_seed(args, trace, "generate")
    config = config_of(args, kind, sizes)
    context = cli_text.run_context(args, trace, config.extra_context, model_context)
    if model.memory_checked:
        max_prompt_len = max(len(p) for p in prompts)
        cli_checks.check_fits(
            args, shape, sizes, context, max_prompt_len=max_prompt_len, kind=kind, check=args.check
        )
    bundle = serving.build(config, sizes[-1], context)
    # Reports go to stderr: stdout carries the answers.
    with cli_sizes.profiled(args, file=sys.stderr):
        served = _serve(args, config, bundle, trace, inputs)
    if cli_answers.emit(args, inputs, served):
        return 1
    if args.check:
        print(f"mismatches: {served.mismatches}", file=sys.stderr)
    return 1 if served.mismatches else 0


def _serve(
    args: argparse.Namespace,
    config: EngineConfig,
    bundle: ServingBundle,
    trace: Sequence[Request],
    inputs: cli_text.Inputs,
) -> cli_answers.Served:
    """The run: outputs by request, the mismatches ``--check`` found (steps
    off the eager forward, or (speculative, overlap) requests off plain
    decoding), the log-probabilities ``--logprobs`` asked for, the summary's
    numbers."""
    bars = cli_answers.progress(args)
    hooks = serving.Hooks(
        end_token=inputs.end_token,
        on_token=inputs.on_token,
        on_finish=inputs.on_finish,
        stop=inputs.stop,
    )
    # Text streaming to a terminal is the run's progress: no bar to break its lines.
    streaming = inputs.on_token is not None and sys.stdout.isatty()
    try:
        outcome = serving.serve(
            config, bundle, trace, hooks=hooks, progress=bars, run_progress=bars and not streaming
        )
    except BaseException:  # Ctrl-C mid-answer: its line ends before the exit's message
        if inputs.printer is not None:
            inputs.printer.end_line()
        raise
    result, stats = outcome.result, outcome.result.stats
    mismatches = stats.mismatches if isinstance(stats, EngineStats) else 0
    if config.check and (config.speculative or config.overlap):
        plain = serving.baseline(config, bundle, trace, end_token=inputs.end_token, progress=bars)
        mismatches = cli_report.differing(result.outputs, plain.result.outputs)
    if outcome.runner is not None and not config.overlap:
        cli_sizes.write_outputs(args, outcome.runner, sys.stderr, outcome.token_runner)
    saved = "" if outcome.runner is None else cli_report.saved_program_note(outcome.runner)
    if saved and not args.quiet:
        print(f"generate: {saved.removeprefix('; ')}", file=sys.stderr)
    engine_stats = stats if isinstance(stats, EngineStats) else None  # speculative: its own
    return cli_answers.Served(
        result.outputs,
        mismatches,
        result.logprobs,
        stats.tokens_per_second,
        engine_stats.padded_fraction if engine_stats and not config.overlap else None,
        outcome.capture if not config.overlap else None,
        engine_stats,
        cli_report.prefix_cache_part(stats),
    )
