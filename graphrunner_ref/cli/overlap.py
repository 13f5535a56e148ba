"""The command line's overlap scheduling: ``--overlap`` on ``demo`` and ``generate``."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from graphrunner import FutureMap
from graphrunner_ref.bridge import TransformersBundle
from graphrunner_ref.cli import multistep as cli_multistep
from graphrunner_ref.cli import report as cli_report
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli.groups import Options
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model.build import ModelBundle

__all__ = ["add_arguments", "report", "run_overlap", "validate"]


def add_arguments(p: Options) -> None:
    p.add_argument(
        "--overlap",
        action="store_true",
        help="overlap scheduling: prepare step N+1 on the host while step N runs "
        "(input tokens as future references resolved on the device); with "
        "--steps-per-launch N, launch i+1 while launch i runs",
    )


def validate(args: argparse.Namespace, error: type[Exception]) -> None:
    if args.overlap and args.speculative:
        raise error("--overlap with --speculative: expected one of them (not combined yet)")


def run_overlap(
    args: argparse.Namespace,
    bundle: ModelBundle | TransformersBundle,
    trace: Sequence[Request],
    kind: str,
    sizes: list[int],
    mechanism_options: dict[str, Any],
    *,
    end_token: int | None = None,
    max_steps: int | None = None,
    logprobs: int = 0,
    progress: bool = True,
    on_token: Callable[[int, int], None] | None = None,
    on_finish: Callable[[int, list[int]], None] | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
) -> EngineResult:
    """Serve ``trace`` with overlap scheduling, ``--steps-per-launch`` decode
    steps per launch (``logprobs``, the streaming hooks and ``stop`` as
    :class:`~graphrunner.Engine` takes them)."""
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=sizes,
        check_padding=args.check_padding,
        future_map=future,
        show_progress=progress,
        **mechanism_options,
        **cli_sampling.runner_options(args, trace),
        **cli_multistep.options(args, end_token),
    )
    runner.capture()
    engine = Engine(
        bundle,
        runner,
        end_token=end_token,
        overlap=True,
        seed=args.seed,
        logprobs=logprobs,
        on_token=on_token,
        on_finish=on_finish,
        stop=stop,
        steps_per_launch=args.steps_per_launch,
    )
    return engine.run(trace, max_steps=max_steps, progress=progress)


def report(
    args: argparse.Namespace,
    result: EngineResult,
    plain_tps: float,
    diff: int,
    plain: str = "plain greedy",
) -> None:
    """The overlap demo's lines: the run, its launches, its speed against
    ``plain`` decoding, the outputs compared and (``--check-padding``) the
    sanitizer's."""
    s = result.stats
    ratio = s.tokens_per_second / plain_tps if plain_tps else 0.0
    print(
        f"overlap: {s.steps} steps, {s.decode_tokens} tokens; prefill: {s.prefills} "
        f"requests; finished {len(result.finished)} requests"
    )
    print(f"steps per launch {args.steps_per_launch}: {cli_report.launches(s)}")
    print(
        f"tokens/s (engine loop): overlap {s.tokens_per_second:,.0f}, plain "
        f"{plain_tps:,.0f}, ratio {ratio:.2f}x"
    )
    print(f"outputs equal to {plain}: {len(result.outputs) - diff} of {len(result.outputs)}")
    print(f"mismatches: {diff}")
    cli_report.report_sanitizer(args, s)
