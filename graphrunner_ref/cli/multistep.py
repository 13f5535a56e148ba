"""``--steps-per-launch N`` on ``demo`` and ``generate``: N decode steps per
runner launch (:class:`~graphrunner_ref.engine.multistep.MultiStepSchedule`), the
host out of the per-token loop. The tokens equal N = 1's; the demo checks
exactly that, against a run of the same trace at N = 1 on the same pools.
With ``--overlap`` the run is :func:`~graphrunner_ref.cli.overlap.run_overlap`'s
(the demo compares it with plain greedy at N = 1, as for N = 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from graphrunner.phases import MAX_STEPS_PER_LAUNCH
from graphrunner_ref.bridge import TransformersBundle
from graphrunner_ref.cli import report as cli_report
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import spec as cli_spec
from graphrunner_ref.cli import ssm as cli_ssm
from graphrunner_ref.cli.common import UsageError, check_range
from graphrunner_ref.cli.groups import Options
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model.build import ModelBundle

__all__ = ["add_arguments", "demo", "options", "validate"]


def add_arguments(p: Options) -> None:
    p.add_argument(
        "--steps-per-launch",
        type=int,
        default=1,
        metavar="N",
        help=f"decode steps per graph launch, 1..{MAX_STEPS_PER_LAUNCH} (1); the tokens "
        "equal N = 1's; with --overlap, launch i+1 is prepared while launch i runs; not with "
        "--speculative or a Mamba/Jamba checkpoint",
    )


def validate(args: argparse.Namespace) -> None:
    """Refuse a value out of range, or an option N > 1 does not combine with, by name."""
    n = args.steps_per_launch
    check_range("--steps-per-launch", n, 1, MAX_STEPS_PER_LAUNCH)
    if n == 1:
        return
    if args.speculative is not None:
        raise UsageError(
            f"--steps-per-launch {n} with --speculative: not supported; expected one of them"
        )
    if cli_ssm.is_state_space_checkpoint(args.checkpoint):
        raise UsageError(
            f"--steps-per-launch {n}: not supported for a Mamba or Jamba checkpoint; expected 1"
        )


def options(args: argparse.Namespace, end_token: int | None) -> dict[str, Any]:
    """``create_decode_runner`` options of N > 1 (the runner needs the end token)."""
    n = args.steps_per_launch
    return {"steps_per_launch": n, "end_token": end_token} if n > 1 else {}


def _run(
    args: argparse.Namespace,
    bundle: ModelBundle | TransformersBundle,
    trace: Sequence[Request],
    kind: str,
    sizes: list[int],
    mechanism_options: dict[str, Any],
    steps: int,
) -> EngineResult:
    multi: dict[str, Any] = {"steps_per_launch": steps} if steps > 1 else {}
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=sizes,
        check_padding=args.check_padding,
        show_progress=True,
        **mechanism_options,
        **cli_sampling.runner_options(args, trace),
        **multi,
    )
    print(cli_report.capture_line(runner, sizes, runner.capture(), steps))
    engine = Engine(bundle, runner, seed=args.seed, steps_per_launch=steps)
    return engine.run(trace, max_steps=args.steps, progress=True)


def demo(
    args: argparse.Namespace,
    bundle: ModelBundle | TransformersBundle,
    trace: Sequence[Request],
    kind: str,
    sizes: list[int],
    mechanism_options: dict[str, Any],
) -> int:
    """The trace at N steps per launch, then at N = 1 on the same pools (greedy
    or sampled alike): the same tokens, and the speed of each. Exits 1 on
    any difference (a run's ``--steps`` may cut a request: a prefix agrees)."""
    n = args.steps_per_launch
    result = _run(args, bundle, trace, kind, sizes, mechanism_options, n)
    single = _run(args, bundle, trace, kind, sizes, mechanism_options, 1)
    diff = cli_spec.differing(result.outputs, single.outputs)
    s, one = result.stats, single.stats.tokens_per_second
    ratio = s.tokens_per_second / one if one else 0.0
    print(
        f"steps per launch {n}: {cli_report.launches(s)}; finished {len(result.finished)} requests"
    )
    print(f"tokens/s: N={n} {s.tokens_per_second:,.0f}, N=1 {one:,.0f}, ratio {ratio:.2f}x")
    print(cli_report.padded_rows(s))
    print(f"outputs equal to N=1: {len(result.outputs) - diff} of {len(result.outputs)}")
    print(f"mismatches: {diff}")
    cli_report.report_sanitizer(args, s)
    return 1 if diff else 0
