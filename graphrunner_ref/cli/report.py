"""What ``demo`` prints: the device and model before a run, the engine's
statistics and the sanitizer's after it, and each mode's comparison with
plain decoding (``--speculative``, ``--overlap``, ``--steps-per-launch``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from graphrunner import GraphRunner
from graphrunner.sizing import CaptureReport
from graphrunner_ref.engine.loop import EngineResult
from graphrunner_ref.engine.results import EngineStats
from graphrunner_ref.engine.serving import samples
from graphrunner_ref.engine.spec_stats import SpeculativeResult, SpeculativeStats
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import ModelConfig

__all__ = [
    "capture_line",
    "differing",
    "header",
    "launches",
    "multistep_report",
    "overlap_report",
    "padded_rows",
    "plain_name",
    "report",
    "report_sanitizer",
    "speculative_report",
]


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
    what = f"sizes {sizes}"
    if runner.phase.token_batch:  # the prompt chunks' runner: its sizes count tokens
        per_launch, what = ", token batch", f"token sizes {runner.capture_sizes}"
    return (
        f"capture ({runner.mechanism.label}{per_launch}): {what}, "
        f"{capture.total_seconds:.1f} s{start}{saved_program_note(runner)}"
    )


def saved_program_note(runner: GraphRunner) -> str:
    """What became of the CPU step's saved program (``--aot-cache``): loaded,
    built and saved for the next start (of a sampled step, its model's), or
    not saved and why; "" without one."""
    aot = getattr(runner.mechanism, "aot", None)
    if aot is None or aot.status is None:
        return ""
    status: str = aot.status  # the program's own, unsuffixed
    # A sampled step saves its model; its sampler runs after it, in process.
    tail = getattr(runner.mechanism, "tail_in_process", False)
    part = " (the model's; the sampler after it)" if tail else ""
    if status == "loaded":
        return f"; its saved program{part} loaded from {aot.root}"
    if status.startswith("built"):
        return (
            f"; program{part} saved in {aot.root}: later starts load it (--aot-cache none: never)"
        )
    return f"; not saved ({status})"


def report(result: EngineResult) -> None:
    s = result.stats
    ratio = s.tokens_per_second / s.eager_tokens_per_second if s.eager_seconds else 0.0
    print(
        f"decode: {s.steps} steps, {s.decode_tokens} tokens; prefill: {s.prefills} "
        f"requests, {s.prefill_tokens} tokens in {s.prefill_chunks} chunks; finished "
        f"{len(result.finished)} requests; {prefix_cache_part(s)}"
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


def prefix_cache_part(stats: EngineStats | SpeculativeStats) -> str:
    """The prefix cache's share of the admitted prompt tokens."""
    hit, prompt = stats.cached_tokens, stats.cached_tokens + stats.prefill_tokens
    return f"prefix cache hit rate {stats.prefix_hit_rate:.1%} ({hit}/{prompt})"


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


def plain_name(trace: Sequence[Request]) -> str:
    """What the plain baseline ran on ``trace``: plain greedy or plain sampling."""
    return "plain sampling" if samples(trace) else "plain greedy"


def differing(a: dict[int, list[int]], b: dict[int, list[int]]) -> int:
    """Requests whose outputs disagree between two runs: neither is a prefix of
    the other (a run cut by ``--steps`` may hold fewer tokens)."""

    def agree(x: list[int], y: list[int]) -> bool:
        n = min(len(x), len(y))
        return x[:n] == y[:n]

    return sum(not agree(a[rid], b.get(rid, [])) for rid in a)


def speculative_report(
    args: argparse.Namespace, result: SpeculativeResult, plain_tps: float, diff: int
) -> None:
    """The speculative demo's lines: its rounds, acceptance, speed against
    plain greedy decoding and the outputs compared."""
    s = result.stats
    ratio = s.tokens_per_second / plain_tps if plain_tps else 0.0
    print(
        f"speculative: {args.speculative} ({args.draft} draft), K={args.draft_tokens}: "
        f"{s.steps} rounds, {s.decode_tokens} tokens; prefill: {s.prefills} requests; "
        f"finished {len(result.finished)} requests; {prefix_cache_part(s)}"
    )
    print(
        f"acceptance: {s.acceptance_rate:.1%} ({s.accepted} of {s.proposed} drafts), "
        f"{s.tokens_per_step:.2f} tokens per request per round"
    )
    print(
        f"tokens/s: speculative {s.tokens_per_second:,.0f}, plain greedy {plain_tps:,.0f}, "
        f"ratio {ratio:.2f}x"
    )
    print(f"outputs equal to plain greedy: {len(result.outputs) - diff} of {len(result.outputs)}")
    print(f"mismatches: {diff}")


def overlap_report(
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
    print(f"steps per launch {args.steps_per_launch}: {launches(s)}")
    print(
        f"tokens/s (engine loop): overlap {s.tokens_per_second:,.0f}, plain "
        f"{plain_tps:,.0f}, ratio {ratio:.2f}x"
    )
    print(f"outputs equal to {plain}: {len(result.outputs) - diff} of {len(result.outputs)}")
    print(f"mismatches: {diff}")
    report_sanitizer(args, s)


def multistep_report(
    args: argparse.Namespace, result: EngineResult, single_tps: float, diff: int
) -> None:
    """The multi-step demo's lines: its launches, its speed against N = 1
    on the same trace, the outputs compared and the sanitizer's."""
    n, s = args.steps_per_launch, result.stats
    ratio = s.tokens_per_second / single_tps if single_tps else 0.0
    print(f"steps per launch {n}: {launches(s)}; finished {len(result.finished)} requests")
    print(f"tokens/s: N={n} {s.tokens_per_second:,.0f}, N=1 {single_tps:,.0f}, ratio {ratio:.2f}x")
    print(padded_rows(s))
    print(f"outputs equal to N=1: {len(result.outputs) - diff} of {len(result.outputs)}")
    print(f"mismatches: {diff}")
    report_sanitizer(args, s)
