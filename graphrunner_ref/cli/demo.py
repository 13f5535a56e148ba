"""``graphrunner demo``: a seeded synthetic trace served on the embedded
model (or a checkpoint), every decode step through a captured runner and
checked against the eager forward; exits 1 on any mismatch (or, with
``--check-padding``, on any padding violation).

With ``--speculative``, ``--overlap`` or ``--steps-per-launch N`` the demo
serves the trace that way, then plain decoding on the same pools
(:func:`~graphrunner_ref.engine.serving.baseline`), and compares their tokens
(a run cut by ``--steps`` holds a prefix of them) and their speed.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from graphrunner import GraphRunner
from graphrunner.sizing import CaptureReport
from graphrunner_ref.cli import checks as cli_checks
from graphrunner_ref.cli import report as cli_report
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import sizes as cli_sizes
from graphrunner_ref.cli import text as cli_text
from graphrunner_ref.cli.common import MAX_STEPS, UsageError, check_range
from graphrunner_ref.cli.options import config_of
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.loop import EngineResult
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.spec_stats import SpeculativeResult
from graphrunner_ref.engine.workload import Request, synthetic_trace
from graphrunner_ref.model import ModelConfig

__all__ = ["DEMO_BATCHED_TOKENS", "run"]

#: The demo's tokens per engine step (``--max-num-batched-tokens`` unless given).
DEMO_BATCHED_TOKENS = 32


def run(args: argparse.Namespace) -> int:
    """Check every option, build the model, serve the trace, report; the exit status."""
    sizes, kind, shape = (
        cli_checks.capture_sizes(args),
        cli_checks.check_common(args),
        cli_checks.model_config(args),
    )
    check_range("--steps", args.steps, 1, MAX_STEPS)
    params = cli_sampling.flag_params(args)
    cli_sizes.check_run_outputs(args)
    model_context = cli_text.context_limit(args, shape)
    check_range("--page-size", args.page_size, 1, model_context, cli_text.limit_why(args))
    config = config_of(args, kind, sizes)
    trace = cli_sampling.apply(_trace(args, shape, model_context, config.extra_context), params)
    cli_sampling.check_modes(args, trace, "demo")
    context = cli_text.run_context(args, trace, config.extra_context, model_context)
    max_prompt_len = max(len(r.prompt) for r in trace)
    cli_checks.check_fits(
        args, shape, sizes, context, max_prompt_len=max_prompt_len, kind=kind, check=True
    )
    bundle = serving.build(config, sizes[-1], context)
    if config.max_num_batched_tokens is None and serving.token_budget(config, bundle) is not None:
        # The demo's prompts (up to 48 tokens) are longer than its budget, so
        # its checked run prefills some of them in chunks.
        config = dataclasses.replace(config, max_num_batched_tokens=DEMO_BATCHED_TOKENS)
    cli_report.header(args, kind, shape, context)
    with cli_sizes.profiled(args):
        if config.speculative or config.overlap or config.steps_per_launch > 1:
            return _against_plain(args, config, bundle, trace)
        checked = dataclasses.replace(config, check=True)
        outcome = serving.serve(
            checked, bundle, trace, progress=True, on_capture=_printer(sizes, full=True)
        )
    return _report(args, outcome)


def _trace(args: argparse.Namespace, shape: ModelConfig, context: int, extra: int) -> list[Request]:
    """The seeded synthetic trace, its requests short enough to leave the
    ``extra`` slots a speculative round takes."""
    if extra >= context:
        raise UsageError(
            f"--max-context-len {context}: expected more than the {extra} slots "
            "a speculative round takes"
        )
    # Arrivals every ~4 steps against ~36-token budgets keep the batch size moving.
    return synthetic_trace(
        num_requests=args.steps,
        vocab_size=shape.vocab_size,
        max_context_len=context - extra,
        seed=args.seed,
        prompt_len=(4, 48),
        new_tokens=(8, 64),
        mean_gap=4.0,
    )


def _report(args: argparse.Namespace, outcome: serving.Outcome) -> int:
    """The checked run's outputs and lines; exits 1 on any mismatch."""
    result, runner = outcome.result, outcome.runner
    if not isinstance(result, EngineResult) or runner is None:
        raise TypeError(f"outcome={outcome!r}: expected a decode runner's engine result")
    cli_sizes.write_outputs(args, runner, tokens=outcome.token_runner)
    cli_report.report(result)
    cli_report.report_sanitizer(args, result.stats)
    return 1 if result.stats.mismatches else 0


def _printer(sizes: list[int], steps: int = 1, *, full: bool = False) -> serving.OnCapture:
    """Prints a capture's line (``full``: and its report) as it ends."""

    def show(runner: GraphRunner, capture: CaptureReport) -> None:
        print(cli_report.capture_line(runner, sizes, capture, steps))
        if full:
            print(capture.format())

    return show


def _against_plain(
    args: argparse.Namespace,
    config: EngineConfig,
    bundle: ServingBundle,
    trace: Sequence[Request],
) -> int:
    """The mode's run, then plain decoding on the same pools (greedy, or
    sampled with the same seeds): the same tokens, and the speed of each.
    Exits 1 on any difference."""
    sizes = list(config.capture_sizes)
    multi = not (config.speculative or config.overlap)  # --steps-per-launch N alone
    shown = _printer(sizes, config.steps_per_launch) if multi else None
    outcome = serving.serve(config, bundle, trace, progress=True, on_capture=shown)
    plain = serving.baseline(
        config,
        bundle,
        trace,
        progress=True,
        run_progress=multi,
        on_capture=_printer(sizes) if multi else None,
    )
    result, plain_tps = outcome.result, plain.result.stats.tokens_per_second
    diff = cli_report.differing(result.outputs, plain.result.outputs)
    if isinstance(result, SpeculativeResult):
        cli_report.speculative_report(args, result, plain_tps, diff)
    elif config.overlap:
        cli_report.overlap_report(args, result, plain_tps, diff, cli_report.plain_name(trace))
    else:
        cli_report.multistep_report(args, result, plain_tps, diff)
    return 1 if diff else 0
