"""``graphrunner generate``: answers to text or token-id prompts.

Text prompts (``--prompt``, or lines of ``--prompts``) go through the
checkpoint's tokenizer and, with ``--chat``, its chat template; token-id
prompts are JSON lists, or JSON objects with their own sampling fields
(:mod:`graphrunner.cli.text`). Answers are greedy or sampled by
``--temperature``, ``--top-k``, ``--top-p``, ``--min-p`` and ``--seed``
(:mod:`graphrunner.cli.sampling`), printed as text when the checkpoint has a
tokenizer. A Mamba or Jamba checkpoint is served by :mod:`graphrunner.cli.ssm`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphrunner.cli import checks as cli_checks
from graphrunner.cli import model_args as cli_model
from graphrunner.cli import modes as cli_modes
from graphrunner.cli import sampling as cli_sampling
from graphrunner.cli import sizes as cli_sizes
from graphrunner.cli import spec as cli_spec
from graphrunner.cli import ssm as cli_ssm
from graphrunner.cli import text as cli_text
from graphrunner.cli.arguments import add_common
from graphrunner.cli.common import MAX_STEPS, write_atomically
from graphrunner.engine.loop import Engine, create_model_runner
from graphrunner.engine.results import TokenLogprobs
from graphrunner.engine.workload import requests_from_prompts
from graphrunner.model import ModelBundle

__all__ = ["Build", "add_parser", "generate"]

#: Builds the run's model from the arguments, the largest batch and the context.
Build = Callable[[argparse.Namespace, int, int], ModelBundle]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``generate`` subcommand's parser (its ``func`` is the caller's to set)."""
    gen: argparse.ArgumentParser = sub.add_parser(
        "generate", help="answers to text or token-id prompts"
    )
    add_common(gen)
    cli_sampling.add_logprobs_argument(gen)
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
    return gen


def generate(args: argparse.Namespace, build: Build) -> int:
    """Serve ``args``' prompts on the model ``build`` makes; print or write the answers."""
    if cli_ssm.is_state_space_checkpoint(args.checkpoint):  # Mamba / Jamba: own bundle
        return cli_ssm.generate(args, cli_checks.check_common(args), cli_checks.capture_sizes)
    kind, config = cli_checks.check_common(args), cli_checks.model_config(args)
    params = cli_sampling.flag_params(args)
    model_context, inputs = cli_text.check_generate(args, config)
    prompts = inputs.prompts
    # No graph larger than the prompt count: each size costs a compile on the CPU.
    sizes = cli_checks.capture_sizes(args, default_max_bs=min(16, len(prompts)))
    trace = cli_sampling.apply(
        requests_from_prompts(
            prompts, max_new_tokens=args.max_new_tokens, arrive_every=args.arrive_every
        ),
        params,
        inputs.fields,
    )
    cli_sampling.check_modes(args, trace, "generate")
    context = cli_text.run_context(args, trace, cli_spec.extra_context(args), model_context)
    max_prompt_len = max(len(p) for p in prompts)
    cli_checks.check_fits(
        args, config, sizes, context, max_prompt_len=max_prompt_len, kind=kind, check=args.check
    )
    torch.set_num_threads(args.threads)
    bundle = build(args, sizes[-1], context)
    # Reports go to stderr: stdout carries the answers.
    with cli_sizes.profiled(args, file=sys.stderr):
        outputs, mismatches, logprobs = _outputs(args, bundle, trace, kind, sizes, inputs)
    text = inputs.render(outputs, [r.rid for r in trace], logprobs)
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


def _outputs(
    args: argparse.Namespace,
    bundle: ModelBundle,
    trace: list[Any],
    kind: str,
    sizes: list[int],
    inputs: cli_text.Inputs,
) -> tuple[dict[int, list[int]], int, dict[int, list[TokenLogprobs]]]:
    """Outputs by request, the mismatches ``--check`` found (steps off the
    eager forward, or (speculative) requests off plain greedy), and the
    log-probabilities ``--logprobs`` asked for (else empty)."""
    options = cli_model.compile_option(args.compile)
    end = inputs.end_token
    if args.speculative or args.overlap:
        result = cli_modes.serve_mode(args, bundle, trace, kind, sizes, options, end_token=end)
        if not args.check:
            return result.outputs, 0, {}
        expected, _ = cli_spec.plain_greedy(bundle, trace, kind, sizes, options, end_token=end)
        return result.outputs, cli_spec.differing(result.outputs, expected), {}
    sampling = cli_sampling.runner_options(args, trace)
    runner = create_model_runner(
        bundle,
        kind,
        capture_sizes=sizes,
        check_padding=args.check_padding,
        **options,
        **sampling,
    )
    runner.capture()
    engine = Engine(
        bundle,
        runner,
        check=args.check,
        end_token=end,
        on_finish=inputs.on_finish,
        atol=cli_model.check_atol(args),
        seed=args.seed,
        logprobs=args.logprobs,
    )
    result = engine.run(trace)
    cli_sizes.write_outputs(args, runner, file=sys.stderr)
    return result.outputs, result.stats.mismatches, result.logprobs
