"""The command line's speculative decoding: ``--speculative {eagle,mtp}
--draft-tokens K [--draft {random,self,wrong}]`` on ``demo`` and ``generate``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from graphrunner_ref.bridge import TransformersBundle
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli.groups import Options
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.spec_factory import DRAFTS, METHODS, speculative_engine
from graphrunner_ref.engine.speculative import SpeculativeResult
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model.build import ModelBundle

__all__ = [
    "add_arguments",
    "differing",
    "extra_context",
    "plain_name",
    "plain_run",
    "report",
    "run_speculative",
    "validate",
]

#: Draft tokens per round at most (each one is a verify column).
MAX_DRAFT_TOKENS = 16


def add_arguments(p: Options) -> None:
    p.add_argument(
        "--speculative",
        choices=METHODS,
        help="chain speculative decoding with an EAGLE or a frozen-KV MTP draft head",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=2,
        metavar="K",
        help=f"draft tokens per round, 1..{MAX_DRAFT_TOKENS} (2); the verify runs K + 1",
    )
    p.add_argument(
        "--draft",
        choices=DRAFTS,
        default="random",
        help="random: a seeded random head built to fit the target (default); self: the "
        "target drafts for itself (every draft accepted); wrong: no draft ever accepted",
    )


def validate(args: argparse.Namespace, error: type[Exception]) -> None:
    """Refuse speculative options that cannot run, before any work."""
    if args.speculative is None:
        return
    if not 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS:
        raise error(f"--draft-tokens {args.draft_tokens}: expected 1..{MAX_DRAFT_TOKENS}")
    if args.page_size != 1:
        raise error(
            f"--page-size {args.page_size} with --speculative: expected 1 (speculative "
            f"decoding runs one KV slot per token)"
        )


def extra_context(args: argparse.Namespace) -> int:
    """Context a speculative round needs beyond a request's own tokens (0 without)."""
    return args.draft_tokens + 1 if args.speculative else 0


def run_speculative(
    args: argparse.Namespace,
    bundle: ModelBundle,
    trace: Sequence[Request],
    kind: str,
    sizes: list[int],
    mechanism_options: dict[str, Any],
    *,
    end_token: int | None = None,
    max_steps: int | None = None,
    logprobs: int = 0,
    progress: bool = True,
) -> SpeculativeResult:
    engine = speculative_engine(
        bundle,
        kind,
        method=args.speculative,
        draft=args.draft,
        k=args.draft_tokens,
        capture_sizes=sizes,
        seed=args.seed,
        run_seed=args.seed,
        check_padding=args.check_padding,
        show_progress=progress,
        end_token=end_token,
        logprobs=logprobs,
        **mechanism_options,
    )
    return engine.run(trace, max_steps=max_steps, progress=progress)


def plain_run(
    bundle: ModelBundle | TransformersBundle,
    trace: Sequence[Request],
    kind: str,
    sizes: list[int],
    mechanism_options: dict[str, Any],
    *,
    seed: int = 0,
    end_token: int | None = None,
    max_steps: int | None = None,
    progress: bool = True,
) -> tuple[dict[int, list[int]], float]:
    """Plain decoding's outputs through a captured runner (one step a launch,
    no overlap, no draft), and its tokens per second: greedy, or sampled by
    the trace's own parameters from the run seed ``seed``, so an overlapped
    run of the same trace and seed draws the same tokens; ``progress``: the
    capture's bar."""
    sampled: dict[str, Any] = {"sampling": True} if cli_sampling.samples(trace) else {}
    runner = create_decode_runner(
        bundle, kind, capture_sizes=sizes, show_progress=progress, **mechanism_options, **sampled
    )
    runner.capture()
    engine = Engine(bundle, runner, end_token=end_token, seed=seed)
    result = engine.run(trace, max_steps=max_steps)
    return result.outputs, result.stats.tokens_per_second


def plain_name(trace: Sequence[Request]) -> str:
    """What :func:`plain_run` ran on ``trace``: plain greedy or plain sampling."""
    return "plain sampling" if cli_sampling.samples(trace) else "plain greedy"


def differing(a: dict[int, list[int]], b: dict[int, list[int]]) -> int:
    """Requests whose outputs disagree between two runs: neither is a prefix of
    the other (a run cut by ``--steps`` may hold fewer tokens)."""

    def agree(x: list[int], y: list[int]) -> bool:
        n = min(len(x), len(y))
        return x[:n] == y[:n]

    return sum(not agree(a[rid], b.get(rid, [])) for rid in a)


def report(
    args: argparse.Namespace, result: SpeculativeResult, plain_tps: float, diff: int
) -> None:
    s = result.stats
    ratio = s.tokens_per_second / plain_tps if plain_tps else 0.0
    print(
        f"speculative: {args.speculative} ({args.draft} draft), K={args.draft_tokens}: "
        f"{s.steps} rounds, {s.decode_tokens} tokens; prefill: {s.prefills} requests; "
        f"finished {len(result.finished)} requests"
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
