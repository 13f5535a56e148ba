"""Command line: ``python -m graphrunner demo`` and ``python -m graphrunner generate``.

``demo`` serves a seeded synthetic trace on the embedded default model (or a
checkpoint), every decode step through a captured runner and checked against
the eager forward; exits 1 on any mismatch (or, with ``--check-padding``, on
any padding violation). ``generate`` serves text prompts (``--prompt``, or
lines of ``--prompts``, through the checkpoint's tokenizer and, with
``--chat``, its chat template) or token-id prompts (JSON lists, or JSON
objects with their own sampling fields) and prints the answers, greedy or
sampled by ``--temperature``, ``--top-k``, ``--top-p``, ``--min-p`` and
``--seed`` (:mod:`graphrunner_ref.cli.sampling`), as text when the checkpoint has
a tokenizer (:mod:`graphrunner_ref.cli.text`). ``convert`` writes a GGUF file as a Hugging
Face checkpoint (:mod:`graphrunner_ref.cli.convert`); ``--checkpoint`` also
takes a ``.gguf``, converted once into the cache.

Every number is bounded by what the machine can hold, before any work: out of
range, the CLI names the argument, the value and the allowed range, and exits 2.
Sizes that allocate (the largest batch size, the KV page size, the context they
imply) are checked against the available memory through
:func:`memory_estimate`, computed from shapes alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch

import graphrunner
from graphrunner import GraphRunner
from graphrunner_ref.bridge import TransformersBundle, load_transformers
from graphrunner_ref.bridge.quantize import quantize_linears
from graphrunner_ref.cli import checks as cli_checks
from graphrunner_ref.cli import convert as cli_convert
from graphrunner_ref.cli import generate as cli_generate
from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli import model_impl as cli_model_impl
from graphrunner_ref.cli import modes as cli_modes
from graphrunner_ref.cli import multistep as cli_multistep
from graphrunner_ref.cli import report as cli_report
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import sizes as cli_sizes
from graphrunner_ref.cli import spec as cli_spec
from graphrunner_ref.cli import text as cli_text
from graphrunner_ref.cli import tp as cli_tp
from graphrunner_ref.cli.arguments import add_common
from graphrunner_ref.cli.common import (
    MAX_STEPS,
    UsageError,
    check_range,
    read_prompts,
    resolve_device,
)
from graphrunner_ref.cli.exits import run_command
from graphrunner_ref.cli.groups import Groups, add_command
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.memory import available_memory, memory_estimate
from graphrunner_ref.engine.workload import synthetic_trace
from graphrunner_ref.io import load_any
from graphrunner_ref.model import (
    ModelBundle,
    default_model,
)

__all__ = [
    "UsageError",
    "available_memory",
    "main",
    "memory_estimate",
    "read_prompts",
    "resolve_device",
]


def main(argv: Sequence[str] | None = None) -> int:
    line = list(sys.argv[1:] if argv is None else argv)
    args = _parse_line(line)
    # Alone, or as --tp N ranks (spawned here, or this one of torchrun's).
    return run_command(
        f"graphrunner {args.command}",
        lambda: cli_tp.run(cli_model.resolve_model(args), line, _parse),
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, its model resolved: how a tensor-parallel rank reads it."""
    return cli_model.resolve_model(_parse_line(argv))


def _parse_line(line: list[str]) -> argparse.Namespace:
    """``line`` parsed; an unknown option is reported with its subcommand's
    usage (the top level's says nothing of the subcommand's options)."""
    parser = _parser()
    args, extra = parser.parse_known_args(line)
    if extra:
        command: argparse.ArgumentParser = parser.commands[args.command]  # type: ignore[attr-defined]
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphrunner",
        description="Capture LLM decode steps as graphs at fixed batch sizes and replay them "
        "padded: demo, generate, sizes and convert. 'graphrunner COMMAND --help' shows a "
        "command's options and examples.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {graphrunner.__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = add_command(sub, "demo")
    g = Groups.of(demo, ("trace", "the synthetic requests served"))
    add_common(g)
    g.prompts.add_argument(
        "--steps", type=int, default=300, help=f"decode steps to run, 1..{MAX_STEPS} (300)"
    )
    cli_sizes.add_run_outputs(g.output)
    demo.set_defaults(func=_demo)
    gen = cli_generate.add_parser(sub)
    gen.set_defaults(func=lambda a: cli_generate.generate(a, _build))  # _build patchable
    cli_sizes.add_parser(sub)
    cli_convert.add_parser(sub)
    parser.commands = sub.choices  # type: ignore[attr-defined]  # for _parse_line's errors
    return parser


def _build(
    args: argparse.Namespace, max_requests: int, context: int
) -> ModelBundle | TransformersBundle:
    if args.checkpoint is not None and cli_model_impl.resolve(args) == "transformers":
        return _build_transformers(args, max_requests, context)
    bundle = cli_model.with_attention(args, _build_model(args, max_requests, context))
    return cli_model.with_quantization(args, bundle)


def _build_transformers(
    args: argparse.Namespace, max_requests: int, context: int
) -> TransformersBundle:
    """The checkpoint's own transformers modules over graphrunner's pools
    (their linears compact ones with ``--quantize``)."""
    for flag, value, default in (
        ("--attention", args.attention, "auto"),
        ("--tp", getattr(args, "tp", None), None),
    ):
        if value != default and not (flag == "--tp" and value == 1):
            raise UsageError(
                f"{flag} {value}: the native model's option; --model-impl transformers runs "
                "the checkpoint's own modules (leave it out)"
            )
    bundle = load_transformers(
        args.checkpoint,
        max_requests=max_requests,
        max_context_len=context,
        device=args.device,
        dtype=cli_model.dtype(args),
        page_size=args.page_size,
    )
    if args.quantize is not None:
        try:
            count = quantize_linears(bundle.model.hf, args.quantize)
        except ValueError as e:
            raise UsageError(f"--quantize {args.quantize}: {e}") from None
        cli_model.note_quantization(args, f"{count} nn.Linear modules replaced")
    return bundle


def _build_model(args: argparse.Namespace, max_requests: int, context: int) -> ModelBundle:
    if args.checkpoint is None:
        return default_model(
            max_requests=max_requests,
            max_context_len=context,
            device=args.device,
            dtype=cli_model.dtype(args),
            seed=args.seed,
            page_size=args.page_size,
            config=None if args.model == "embedded" else cli_model.embedded_config(args),
            tp=cli_tp.place(args),
        )
    try:
        bundle = load_any(
            args.checkpoint,
            max_requests=max_requests,
            max_context_len=context,
            device=args.device,
            dtype=cli_model.dtype(args),
            page_size=args.page_size,
            tp=cli_tp.place(args),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not isinstance(bundle, ModelBundle):  # read_config refused it before
        raise UsageError(f"{cli_model.model_source(args)}: expected a Llama-family model")
    return bundle


def _capture(
    bundle: ModelBundle | TransformersBundle,
    kind: str,
    sizes: list[int],
    *,
    check_padding: bool = False,
    compile: bool = False,
    sampling: dict[str, Any] | None = None,
) -> GraphRunner:
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=sizes,
        show_progress=True,
        check_padding=check_padding,
        **cli_model.compile_option(compile),
        **(sampling or {}),
    )
    report = runner.capture()
    print(cli_report.capture_line(runner, sizes, report))
    print(report.format())
    return runner


def _demo(args: argparse.Namespace) -> int:
    sizes, kind, config = (
        cli_checks.capture_sizes(args),
        cli_checks.check_common(args),
        cli_checks.model_config(args),
    )
    check_range("--steps", args.steps, 1, MAX_STEPS)
    params = cli_sampling.flag_params(args)
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
    trace = cli_sampling.apply(trace, params)
    cli_sampling.check_modes(args, trace, "demo")
    context = cli_text.run_context(args, trace, extra, model_context)
    max_prompt_len = max(len(r.prompt) for r in trace)
    cli_checks.check_fits(
        args, config, sizes, context, max_prompt_len=max_prompt_len, kind=kind, check=True
    )
    bundle = _build(args, sizes[-1], context)
    cli_report.header(args, kind, config, context)
    with cli_sizes.profiled(args):
        if args.speculative or args.overlap:
            return cli_modes.demo_against_plain(args, bundle, trace, kind, sizes)
        if args.steps_per_launch > 1:
            options = cli_model.compile_option(args.compile)
            return cli_multistep.demo(args, bundle, trace, kind, sizes, options)
        runner = _capture(
            bundle,
            kind,
            sizes,
            check_padding=args.check_padding,
            compile=args.compile,
            sampling=cli_sampling.runner_options(args, trace),
        )
        engine = Engine(bundle, runner, check=True, atol=cli_model.check_atol(args), seed=args.seed)
        result = engine.run(trace, max_steps=args.steps, progress=True)
    cli_sizes.write_outputs(args, runner)
    cli_report.report(result)
    cli_report.report_sanitizer(args, result.stats)
    return 1 if result.stats.mismatches else 0
