"""Command line: ``python -m graphrunner demo`` and ``python -m graphrunner generate``.

``demo`` serves a seeded synthetic trace on the embedded default model (or a
checkpoint), every decode step through a captured runner and checked against
the eager forward; exits 1 on any mismatch (or, with ``--check-padding``, on
any padding violation). ``generate`` serves text prompts (``--prompt``, or
lines of ``--prompts``, through the checkpoint's tokenizer and, with
``--chat``, its chat template) or token-id prompts (JSON lists) and prints
the greedy answers, as text when the checkpoint has a tokenizer
(:mod:`graphrunner.cli.text`). ``convert`` writes a GGUF file as a Hugging
Face checkpoint (:mod:`graphrunner.cli.convert`); ``--checkpoint`` also
takes a ``.gguf``, converted once into the cache.

Every number is bounded by what the machine can hold, before any work: out of
range, the CLI names the argument, the value and the allowed range, and exits 2.
Sizes that allocate (the largest batch size, the KV page size, the context they
imply) are checked against the available memory through
:func:`memory_estimate`, computed from shapes alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from graphrunner.cli import convert as cli_convert
from graphrunner.cli import model_args as cli_model
from graphrunner.cli import overlap as cli_overlap
from graphrunner.cli import sizes as cli_sizes
from graphrunner.cli import spec as cli_spec
from graphrunner.cli import ssm as cli_ssm
from graphrunner.cli import text as cli_text
from graphrunner.cli.common import (
    MAX_STEPS,
    UsageError,
    check_range,
    read_prompts,
    resolve_device,
    write_atomically,
)
from graphrunner.core.runner import GraphRunner
from graphrunner.engine.loop import Engine, EngineResult, create_model_runner
from graphrunner.engine.memory import MAX_KV_SLOTS, available_memory, memory_estimate
from graphrunner.engine.speculative import SpeculativeResult
from graphrunner.engine.workload import requests_from_prompts, synthetic_trace
from graphrunner.io import load_any, read_config, resolve_checkpoint
from graphrunner.model import (
    ModelBundle,
    ModelConfig,
    default_model,
)
from graphrunner.pools import whole_pages
from graphrunner.sanitizer.padding import PaddingViolation
from graphrunner.sizing.sizes import default_capture_sizes

__all__ = [
    "UsageError",
    "available_memory",
    "main",
    "memory_estimate",
    "read_prompts",
    "resolve_device",
]

#: --seed: torch.Generator.manual_seed takes -2**63..2**64-1, but a negative seed
#: aliases the top half (-1 seeds as 2**64-1); 0..2**63-1 is one range, each seed
#: its own generator state, that fits an int64 wherever it is stored.
MAX_SEED = 2**63 - 1
#: --max-bs and every --capture-sizes entry, before the memory check (which
#: needs the capture-size list, itself as long as the largest size / 32).
MAX_BATCH_SIZE = 1_000_000


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"graphrunner {args.command}: error: {e}", file=sys.stderr)
        return 2
    except PaddingViolation as e:
        print(f"graphrunner {args.command}: padding violation: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphrunner", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="engine loop on the embedded model, checked vs eager")
    _common(demo)
    demo.add_argument(
        "--steps", type=int, default=300, help=f"decode steps to run, 1..{MAX_STEPS} (300)"
    )
    cli_sizes.add_run_outputs(demo)
    demo.set_defaults(func=_demo)
    gen = sub.add_parser("generate", help="greedy answers to text or token-id prompts")
    _common(gen)
    cli_text.add_generate_arguments(gen)
    gen.add_argument("--output", type=Path, help="write JSON lines here (default stdout)")
    gen.add_argument("--max-new-tokens", type=int, default=16, help="1..the model's context (16)")
    gen.add_argument(
        "--arrive-every",
        type=int,
        default=0,
        metavar="K",
        help=f"prompt i arrives at engine step i*K, 0..{MAX_STEPS} (0: all at once)",
    )
    gen.add_argument("--end-token", type=int, help="a token id that ends a request")
    gen.add_argument("--check", action="store_true", help="check each step against eager")
    cli_sizes.add_run_outputs(gen)
    gen.set_defaults(func=_generate)
    cli_sizes.add_parser(sub)
    cli_convert.add_parser(sub)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        help="cpu or cuda[:N] (default: the runner's: cuda for --runner cuda, cpu for "
        "--runner cpu or eager; with neither given, cuda when available, else cpu)",
    )
    p.add_argument(
        "--runner",
        choices=["cuda", "cpu", "eager"],
        help="default: the device's (cuda on a CUDA device, else cpu); eager runs on any device",
    )
    cli_model.add_arguments(p)  # --compile/--no-compile, --model, --dtype
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="Hugging Face-layout directory (default: the embedded random model)",
    )
    p.add_argument(
        "--max-bs",
        type=int,
        help="largest captured batch size (default 16; generate: at most the number of prompts); "
        "refused past what the pools and graphs can take in the free memory",
    )
    p.add_argument(
        "--capture-sizes",
        help="comma-separated, e.g. 1,2,4,8 (default: graphrunner's policy up to --max-bs)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the embedded model's weights and of the demo's synthetic trace "
        "(no effect on a --checkpoint's weights or on generate's prompts); 0..2**63-1",
    )
    p.add_argument(
        "--check-padding",
        action="store_true",
        help="run the padding sanitizer around every replay (debug mode, slower)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=1,
        help="KV page size in token slots, 1..the run's context (1: one slot per token)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads, 1..this machine's cores (1: the small models here gain "
        "nothing from more)",
    )

    cli_text.add_context_argument(p)
    cli_spec.add_arguments(p)
    cli_overlap.add_arguments(p)


def _cores() -> int:
    return os.cpu_count() or 1


def _check_common(args: argparse.Namespace) -> str:
    """Validate the arguments every command shares; returns the runner kind.
    (``--page-size`` and the batch sizes are checked against the context and
    the memory once the run's context is known: :func:`_check_fits`.)"""
    check_range("--threads", args.threads, 1, _cores(), "this machine's cores")
    check_range("--seed", args.seed, 0, MAX_SEED)
    cli_spec.validate(args, UsageError)
    cli_overlap.validate(args, UsageError)
    kind = _runner_kind(args)
    args.compile = cli_model.resolve_compile(args, kind)
    cli_model.check_attention(args)
    if args.checkpoint is not None and args.model != "default":
        raise UsageError(f"--model {args.model}: an embedded model, not with --checkpoint")
    return kind


def _capture_sizes(args: argparse.Namespace, default_max_bs: int = 16) -> list[int]:
    if args.max_bs is not None:
        check_range("--max-bs", args.max_bs, 1, MAX_BATCH_SIZE)
    if args.capture_sizes is None:
        return default_capture_sizes(default_max_bs if args.max_bs is None else args.max_bs)
    try:
        sizes = sorted({int(s) for s in args.capture_sizes.split(",")})
    except ValueError:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected comma-separated ints"
        ) from None
    if not 1 <= sizes[0] <= sizes[-1] <= MAX_BATCH_SIZE:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected sizes in 1..{MAX_BATCH_SIZE}"
        )
    if args.max_bs is not None and args.max_bs != sizes[-1]:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected sizes whose "
            f"largest equals --max-bs {args.max_bs}"
        )
    return sizes


def _runner_kind(args: argparse.Namespace) -> str:
    """Resolve ``args.device`` in place (the rest of the CLI reads it); returns the kind."""
    kind, args.device = resolve_device(args.runner, args.device, torch.cuda.is_available())
    # Read off the string: torch.device parses the index as int8 (cuda:128 is -128)
    # and raises on a longer one.
    _, _, index = args.device.partition(":")
    if index and int(index) >= (count := torch.cuda.device_count()):
        raise UsageError(f"--device {args.device}: expected cuda:N with N < {count} devices")
    return kind


def _model_config(args: argparse.Namespace) -> ModelConfig:
    if args.checkpoint is None:
        return cli_model.embedded_config(args)
    try:
        # A .gguf file is converted once into the cache; the rest reads that directory.
        args.checkpoint = resolve_checkpoint(args.checkpoint)
        return read_config(args.checkpoint)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check_fits(
    args: argparse.Namespace,
    config: ModelConfig,
    sizes: list[int],
    context: int,
    *,
    max_prompt_len: int,
    kind: str,
    check: bool,
) -> None:
    """Refuse (UsageError) a --page-size past ``context``, or pools and graphs that
    would not fit the memory available on ``args.device`` or index KV slots past
    int32; the batch size gets the range that fits."""
    check_range("--page-size", args.page_size, 1, context, "the context of this run")
    options: dict[str, Any] = {
        "context": context,
        "page_size": args.page_size,
        "max_prompt_len": max_prompt_len,
        "pool_copies": int(check) + int(args.check_padding),
        "cuda_graphs": kind == "cuda",
        "dtype_bytes": cli_model.dtype(args).itemsize,
    }
    free, source = available_memory(args.device)

    def up_to(bs: int) -> list[int]:
        return [s for s in sizes if s < bs] + [bs]

    def fits(bs: int) -> bool:
        slots = bs * whole_pages(context, args.page_size) + args.page_size
        return (
            slots <= MAX_KV_SLOTS
            and memory_estimate(config, capture_sizes=up_to(bs), **options) <= free
        )

    if fits(sizes[-1]):
        return
    lo, hi = 0, sizes[-1]  # fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    need = memory_estimate(config, capture_sizes=sizes, **options)
    why = (
        f"memory: this run needs about {_gib(need)}, {_gib(free)} is free per {source}"
        if need > free
        else f"int32 KV slot indices allow {MAX_KV_SLOTS} slots"
    )
    if lo == 0:
        model = f"--checkpoint {args.checkpoint}" if args.checkpoint else "the embedded model"
        raise UsageError(f"{model} at context {context}: no batch size fits ({why})")
    if args.capture_sizes is not None:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected sizes in 1..{lo} ({why})"
        )
    raise UsageError(f"--max-bs {sizes[-1]}: expected 1..{lo} ({why})")


def _build(args: argparse.Namespace, max_requests: int, context: int) -> ModelBundle:
    return cli_model.with_attention(args, _build_model(args, max_requests, context))


def _build_model(args: argparse.Namespace, max_requests: int, context: int) -> ModelBundle:
    if args.checkpoint is None:
        return default_model(
            max_requests=max_requests,
            max_context_len=context,
            device=args.device,
            dtype=cli_model.dtype(args),
            seed=args.seed,
            page_size=args.page_size,
            config=None if args.model == "default" else cli_model.embedded_config(args),
        )
    try:
        bundle = load_any(
            args.checkpoint,
            max_requests=max_requests,
            max_context_len=context,
            device=args.device,
            dtype=cli_model.dtype(args),
            page_size=args.page_size,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not isinstance(bundle, ModelBundle):  # read_config refused it before
        raise UsageError(f"--checkpoint {args.checkpoint}: expected a Llama-family model")
    return bundle


def _capture(
    bundle: ModelBundle,
    kind: str,
    sizes: list[int],
    *,
    check_padding: bool = False,
    compile: bool = False,
) -> GraphRunner:
    runner = create_model_runner(
        bundle,
        kind,
        capture_sizes=sizes,
        show_progress=True,
        check_padding=check_padding,
        **cli_model.compile_option(compile),
    )
    report = runner.capture()
    print(f"capture ({runner.mechanism.label}): sizes {sizes}, {report.total_seconds:.1f} s")
    print(report.format())
    return runner


def _demo(args: argparse.Namespace) -> int:
    sizes, kind, config = _capture_sizes(args), _check_common(args), _model_config(args)
    check_range("--steps", args.steps, 1, MAX_STEPS)
    cli_sizes.check_run_outputs(args)
    model_context = cli_text.context_limit(args, config)
    check_range("--page-size", args.page_size, 1, model_context, cli_text.limit_why(args))
    torch.set_num_threads(args.threads)
    # Arrivals every ~4 steps against ~36-token budgets keep the batch size moving.
    extra = cli_spec.extra_context(args)  # a speculative round's fresh slots
    if extra >= model_context:
        raise UsageError(
            f"--max-context-len {model_context}: expected more than the {extra} slots "
            "a speculative round takes"
        )
    trace = synthetic_trace(
        num_requests=args.steps,
        vocab_size=config.vocab_size,
        max_context_len=model_context - extra,
        seed=args.seed,
        prompt_len=(4, 48),
        new_tokens=(8, 64),
        mean_gap=4.0,
    )
    context = cli_text.run_context(args, trace, extra, model_context)
    max_prompt_len = max(len(r.prompt) for r in trace)
    _check_fits(args, config, sizes, context, max_prompt_len=max_prompt_len, kind=kind, check=True)
    bundle = _build(args, sizes[-1], context)
    source = args.checkpoint or f"embedded default (random, seed {args.seed})"
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
    with cli_sizes.profiled(args):
        if args.speculative or args.overlap:
            return _demo_against_plain(args, bundle, trace, kind, sizes)
        runner = _capture(
            bundle, kind, sizes, check_padding=args.check_padding, compile=args.compile
        )
        engine = Engine(bundle, runner, check=True, atol=cli_model.check_atol(args))
        result = engine.run(trace, max_steps=args.steps, progress=True)
    cli_sizes.write_outputs(args, runner)
    _report(result)
    _report_sanitizer(runner)
    return 1 if result.stats.mismatches else 0


def _demo_against_plain(
    args: argparse.Namespace, bundle: ModelBundle, trace: list[Any], kind: str, sizes: list[int]
) -> int:
    """Speculative or overlap serving, then plain greedy on the same pools: the
    same tokens (a run cut by ``--steps`` holds a prefix of them)."""
    options = cli_model.compile_option(args.compile)
    result = _serve_mode(args, bundle, trace, kind, sizes, options, max_steps=args.steps)
    plain, plain_tps = cli_spec.plain_greedy(
        bundle, trace, kind, sizes, options, max_steps=args.steps
    )
    diff = cli_spec.differing(result.outputs, plain)
    if isinstance(result, SpeculativeResult):
        cli_spec.report(args, result, plain_tps, diff)
    else:
        cli_overlap.report(result, plain_tps, diff)
    return 1 if diff else 0


def _serve_mode(
    args: argparse.Namespace,
    bundle: ModelBundle,
    trace: list[Any],
    kind: str,
    sizes: list[int],
    options: dict[str, Any],
    **kwargs: Any,
) -> SpeculativeResult | EngineResult:
    """The run of ``--speculative`` or ``--overlap``."""
    run = cli_spec.run_speculative if args.speculative else cli_overlap.run_overlap
    return run(args, bundle, trace, kind, sizes, options, **kwargs)


def _report(result: EngineResult) -> None:
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
    print(
        f"padded rows: {s.padded_fraction:.1%} ({s.padded_rows} of {s.padded_rows + s.live_rows})"
    )
    print(
        f"checked steps: {s.checked_steps}, max |logit diff| {s.max_logit_diff:.2e}, "
        f"max |kv diff| {s.max_kv_diff:.2e}, near-tie token flips {s.token_flips}"
    )
    print(f"mismatches: {s.mismatches}")


def _report_sanitizer(runner: GraphRunner) -> None:
    if runner.sanitizer is not None:
        s = runner.sanitizer.stats
        print(
            f"padding sanitizer: {s.replays_checked} replays checked, no violation "
            f"({s.seconds:.2f} s of checks)"
        )


def _generate(args: argparse.Namespace) -> int:
    if cli_ssm.is_state_space_checkpoint(args.checkpoint):  # Mamba / Jamba: own bundle
        return cli_ssm.generate(args, _check_common(args), _capture_sizes)
    kind, config = _check_common(args), _model_config(args)
    model_context, inputs = cli_text.check_generate(args, config)
    prompts = inputs.prompts
    # No graph larger than the prompt count: each size costs a compile on the CPU.
    sizes = _capture_sizes(args, default_max_bs=min(16, len(prompts)))
    trace = requests_from_prompts(
        prompts, max_new_tokens=args.max_new_tokens, arrive_every=args.arrive_every
    )
    context = cli_text.run_context(args, trace, cli_spec.extra_context(args), model_context)
    max_prompt_len = max(len(p) for p in prompts)
    _check_fits(
        args, config, sizes, context, max_prompt_len=max_prompt_len, kind=kind, check=args.check
    )
    torch.set_num_threads(args.threads)
    bundle = _build(args, sizes[-1], context)
    # Reports go to stderr: stdout carries the answers.
    with cli_sizes.profiled(args, file=sys.stderr):
        outputs, mismatches = _generate_outputs(args, bundle, trace, kind, sizes, inputs)
    text = inputs.render(outputs, [r.rid for r in trace])
    if args.output is None:
        sys.stdout.write(text)
    else:
        try:
            write_atomically(args.output, text)
        except OSError as e:
            print(f"graphrunner generate: error: --output {args.output}: {e}", file=sys.stderr)
            return 1
    if args.check:
        print(f"mismatches: {mismatches}", file=sys.stderr)
    return 1 if mismatches else 0


def _generate_outputs(
    args: argparse.Namespace,
    bundle: ModelBundle,
    trace: list[Any],
    kind: str,
    sizes: list[int],
    inputs: cli_text.Inputs,
) -> tuple[dict[int, list[int]], int]:
    """Greedy outputs by request, and the mismatches ``--check`` found: steps
    off the eager forward, or (speculative) requests off plain greedy."""
    options = cli_model.compile_option(args.compile)
    end = inputs.end_token
    if args.speculative or args.overlap:
        result = _serve_mode(args, bundle, trace, kind, sizes, options, end_token=end)
        if not args.check:
            return result.outputs, 0
        expected, _ = cli_spec.plain_greedy(bundle, trace, kind, sizes, options, end_token=end)
        return result.outputs, cli_spec.differing(result.outputs, expected)
    runner = create_model_runner(
        bundle, kind, capture_sizes=sizes, check_padding=args.check_padding, **options
    )
    runner.capture()
    engine = Engine(
        bundle,
        runner,
        check=args.check,
        end_token=end,
        on_finish=inputs.on_finish,
        atol=cli_model.check_atol(args),
    )
    greedy = engine.run(trace)
    cli_sizes.write_outputs(args, runner, file=sys.stderr)
    return greedy.outputs, greedy.stats.mismatches
