"""What ``demo`` prints: the device and model before a run, the engine's
statistics and the sanitizer's after it."""

from __future__ import annotations

import argparse

import torch

from graphrunner import GraphRunner
from graphrunner.sizing import CaptureReport
from graphrunner_ref.engine.loop import EngineResult
from graphrunner_ref.engine.results import EngineStats
from graphrunner_ref.model import ModelConfig

__all__ = ["capture_line", "header", "launches", "padded_rows", "report", "report_sanitizer"]


def header(args: argparse.Namespace, kind: str, config: ModelConfig, context: int) -> None:
    """The device, runner, torch and model of the run."""
    source = args.checkpoint or f"{args.model} (random, seed {args.seed})"
    print(
        f"device: {args.device}   runner: {kind}   torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)"
        + (f"   KV pages of {args.page_size} slots" if args.page_size > 1 else "")
    )
    print(
        f"model: {source}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads}/{config.num_kv_heads} heads, vocab {config.vocab_size}, "
        f"context {context}"
    )


def capture_line(
    runner: GraphRunner, sizes: list[int], capture: CaptureReport, steps: int = 1
) -> str:
    """What a capture took: the mechanism, the sizes (and the decode steps a
    launch, past one), the seconds, and whether it started cold or warm."""
    per_launch = f", {steps} steps a launch" if steps > 1 else ""
    start = "" if capture.start == "none" else f"; {capture.describe_start()}"
    return (
        f"capture ({runner.mechanism.label}{per_launch}): sizes {sizes}, "
        f"{capture.total_seconds:.1f} s{start}"
    )


def report(result: EngineResult) -> None:
    s = result.stats
    ratio = s.tokens_per_second / s.eager_tokens_per_second if s.eager_seconds else 0.0
    print(
        f"decode: {s.steps} steps, {s.decode_tokens} tokens; prefill: {s.prefills} "
        f"requests, {s.prefill_tokens} tokens; finished {len(result.finished)} requests"
    )
    print(f"batch sizes (live bs: steps): {dict(sorted(s.batch_sizes.items()))}")
    print(
        f"tokens/s: graphs {s.tokens_per_second:,.0f}, eager {s.eager_tokens_per_second:,.0f}"
        f", ratio {ratio:.2f}x"
    )
    print(padded_rows(s))
    print(
        f"checked steps: {s.checked_steps}, max |logit diff| {s.max_logit_diff:.2e}, "
        f"max |kv diff| {s.max_kv_diff:.2e}, near-tie token flips {s.token_flips}"
    )
    print(f"mismatches: {s.mismatches}")


def padded_rows(stats: EngineStats) -> str:
    """The padded share of the rows the graphs computed (at N steps a launch,
    of the row steps: a row's steps after it stopped inside a launch count)."""
    s = stats
    computed = s.padded_rows + s.live_rows
    return f"padded rows: {s.padded_fraction:.1%} ({s.padded_rows} of {computed})"


def launches(stats: EngineStats) -> str:
    """The run's graph launches and device-to-host reads, in all and per decode token."""
    s = stats
    return (
        f"{s.launches} launches, {s.syncs} syncs, {s.decode_tokens} tokens "
        f"({s.launches_per_token:.3f} launches, {s.syncs_per_token:.3f} syncs per token)"
    )


def report_sanitizer(args: argparse.Namespace, stats: EngineStats) -> None:
    """The sanitizer's line of a run under ``--check-padding`` (a violation
    raises before a run ends: reaching here means none)."""
    if args.check_padding:
        print(
            f"padding sanitizer: {stats.sanitized_replays} replays checked, no violation "
            f"({stats.sanitizer_seconds:.2f} s of checks)"
        )
