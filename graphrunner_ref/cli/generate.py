"""``graphrunner generate``: answers to text or token-id prompts.

Text prompts (``--prompt``, or lines of ``--prompts``) go through the
checkpoint's tokenizer and, with ``--chat``, its chat template; prompt files
are read as ``--prompts-format`` (:mod:`graphrunner_ref.cli.prompts`). Answers are
greedy or sampled by ``--temperature``, ``--top-k``, ``--top-p``, ``--min-p``
and ``--seed`` (:mod:`graphrunner_ref.cli.sampling`), up to ``--max-new-tokens``
(128 by default; text stops at the end-of-sequence token), and printed as text
streamed token by token, or as one JSON record per request
(:mod:`graphrunner_ref.cli.answers`). A Mamba or Jamba checkpoint is served by
:mod:`graphrunner_ref.cli.ssm`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from graphrunner_ref.bridge import TransformersBundle
from graphrunner_ref.cli import answers as cli_answers
from graphrunner_ref.cli import checks as cli_checks
from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli import modes as cli_modes
from graphrunner_ref.cli import multistep as cli_multistep
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import sizes as cli_sizes
from graphrunner_ref.cli import spec as cli_spec
from graphrunner_ref.cli import ssm as cli_ssm
from graphrunner_ref.cli import text as cli_text
from graphrunner_ref.cli.arguments import add_common
from graphrunner_ref.cli.common import MAX_STEPS, UsageError
from graphrunner_ref.cli.groups import Groups, add_command
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.results import EngineStats
from graphrunner_ref.engine.workload import requests_from_prompts
from graphrunner_ref.model import ModelBundle

__all__ = ["DEFAULT_NEW_TOKENS", "Build", "add_parser", "generate"]

#: ``--max-new-tokens`` by default: room for a chat answer (text stops at EOS).
DEFAULT_NEW_TOKENS = 128

#: Builds the run's model from the arguments, the largest batch and the context.
Build = Callable[[argparse.Namespace, int, int], ModelBundle | TransformersBundle]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``generate`` subcommand's parser (its ``func`` is the caller's to set)."""
    gen = add_command(sub, "generate")
    g = Groups.of(gen)
    add_common(g)
    cli_sampling.add_logprobs_argument(g.output)
    cli_text.add_generate_arguments(g.prompts)
    cli_answers.add_arguments(g.output)  # --output, --json, --no-stream, --quiet
    g.prompts.add_argument(
        "--max-new-tokens",
        "-n",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        default=DEFAULT_NEW_TOKENS,
        help=f"1..the model's context ({DEFAULT_NEW_TOKENS}; a text answer stops earlier at "
        "the end-of-sequence token)",
    )
    g.scheduling.add_argument(
        "--arrive-every",
        type=int,
        default=0,
        metavar="K",
        help=f"prompt i arrives at engine step i*K, 0..{MAX_STEPS} (0: all at once)",
    )
    g.prompts.add_argument("--end-token", type=int, help="a token id that ends a request")
    g.runner.add_argument("--check", action="store_true", help="check each step against eager")
    cli_sizes.add_run_outputs(g.output)
    return gen


def generate(args: argparse.Namespace, build: Build) -> int:
    """Serve ``args``' prompts on the model ``build`` makes; print or write the answers."""
    if cli_ssm.is_state_space_checkpoint(args.checkpoint):  # Mamba / Jamba: own bundle
        if args.model_impl == "transformers":
            raise UsageError(
                f"--model-impl transformers: {args.checkpoint} holds a model with Mamba layers, "
                "which runs natively (--model-impl native or auto)"
            )
        return cli_ssm.generate(args, cli_checks.check_common(args), cli_checks.capture_sizes)
    kind, config = cli_checks.check_common(args), cli_checks.model_config(args)
    params = cli_sampling.flag_params(args)
    model_context, inputs = cli_text.check_generate(args, config)
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
    cli_sampling.settle_seed(args, trace, "generate")
    context = cli_text.run_context(args, trace, cli_spec.extra_context(args), model_context)
    max_prompt_len = max(len(p) for p in prompts)
    cli_checks.check_fits(
        args, config, sizes, context, max_prompt_len=max_prompt_len, kind=kind, check=args.check
    )
    torch.set_num_threads(args.threads)
    bundle = build(args, sizes[-1], context)
    # Reports go to stderr: stdout carries the answers.
    with cli_sizes.profiled(args, file=sys.stderr):
        served = _serve(args, bundle, trace, kind, sizes, inputs)
    if cli_answers.emit(args, inputs, served):
        return 1
    if args.check:
        print(f"mismatches: {served.mismatches}", file=sys.stderr)
    return 1 if served.mismatches else 0


def _serve(
    args: argparse.Namespace,
    bundle: ModelBundle | TransformersBundle,
    trace: list[Any],
    kind: str,
    sizes: list[int],
    inputs: cli_text.Inputs,
) -> cli_answers.Served:
    """The run: outputs by request, the mismatches ``--check`` found (steps
    off the eager forward, or (speculative, overlap) requests off plain decoding), the
    log-probabilities ``--logprobs`` asked for, the summary's numbers."""
    options = cli_model.compile_option(args.compile)
    end = inputs.end_token
    bars = cli_answers.progress(args)
    if args.speculative or args.overlap:
        hooks = {"on_token": inputs.on_token, "on_finish": inputs.on_finish, "stop": inputs.stop}
        result = cli_modes.serve_mode(
            args,
            bundle,
            trace,
            kind,
            sizes,
            options,
            end_token=end,
            logprobs=args.logprobs,
            progress=bars,
            **({} if args.speculative else hooks),
        )
        diff = 0
        if args.check:
            expected, _ = cli_spec.plain_run(
                bundle, trace, kind, sizes, options, seed=args.seed, end_token=end, progress=bars
            )
            diff = cli_spec.differing(result.outputs, expected)
        stats = result.stats
        return cli_answers.Served(
            result.outputs,
            diff,
            result.logprobs,
            stats.tokens_per_second,
            stats=stats if isinstance(stats, EngineStats) else None,  # speculative: its own
        )
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=sizes,
        check_padding=args.check_padding,
        show_progress=bars,
        **options,
        **cli_sampling.runner_options(args, trace),
        **cli_multistep.options(args, end),
    )
    capture = runner.capture()
    engine = Engine(
        bundle,
        runner,
        check=args.check,
        end_token=end,
        on_finish=inputs.on_finish,
        on_token=inputs.on_token,
        stop=inputs.stop,
        atol=cli_model.check_atol(args),
        seed=args.seed,
        logprobs=args.logprobs,
        steps_per_launch=args.steps_per_launch,
    )
    # Text streaming to a terminal is the run's progress: no bar to break its lines.
    streaming = inputs.on_token is not None and sys.stdout.isatty()
    result = engine.run(trace, progress=bars and not streaming)
    cli_sizes.write_outputs(args, runner, file=sys.stderr)
    s = result.stats
    return cli_answers.Served(
        result.outputs,
        s.mismatches,
        result.logprobs,
        s.tokens_per_second,
        s.padded_fraction,
        capture,
        s,
    )
