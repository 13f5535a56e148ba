"""Command line: ``python -m graphrunner demo``, ``generate``, ``serve``, ``sizes``, ``convert``.

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
takes a ``.gguf``, converted once into the cache; ``sizes`` picks capture
sizes from served traffic (:mod:`graphrunner_ref.cli.sizes`); ``serve`` answers
OpenAI's completions and chat API over HTTP (:mod:`graphrunner_ref.cli.serve`).

The options are :mod:`graphrunner_ref.cli.options`' (which maps them into the
engine's one config); ``demo`` (:mod:`graphrunner_ref.cli.demo`) and
``generate`` (:mod:`graphrunner_ref.cli.generate`) serve through the one
engine path (:mod:`graphrunner_ref.engine.serving`). With ``--tp`` (or under
``torchrun``) a command runs as tensor-parallel ranks
(:mod:`graphrunner_ref.cli.tp`).

Every number is bounded by what the machine can hold, before any work: out of
range, the CLI names the argument, the value and the allowed range, and exits 2.
Sizes that allocate (the largest batch size, the KV page size, the context they
imply) are checked against the available memory through
:func:`memory_estimate`, computed from shapes alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from graphrunner_ref.cli import convert, demo, generate, options, serve, sizes, tp
from graphrunner_ref.cli.common import UsageError, read_prompts, resolve_device
from graphrunner_ref.cli.exits import run_command
from graphrunner_ref.cli.model_args import resolve_model
from graphrunner_ref.engine.memory import available_memory, memory_estimate

__all__ = [
    "COMMANDS",
    "UsageError",
    "available_memory",
    "main",
    "memory_estimate",
    "read_prompts",
    "resolve_device",
]

#: What each command runs, given its parsed arguments; returns the exit status.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": demo.run,
    "generate": generate.run,
    "serve": serve.run,
    "sizes": sizes.run,
    "convert": convert.run,
}


def main(argv: Sequence[str] | None = None) -> int:
    line = list(sys.argv[1:] if argv is None else argv)
    args = _parse_line(line)
    return run_command(f"graphrunner {args.command}", lambda: _run(args, line))


def _run(args: argparse.Namespace, line: list[str]) -> int:
    """The command here, or as tensor-parallel ranks when ``--tp`` (or torchrun) asks."""
    args = resolve_model(args)
    if args.command == "serve" and tp.runs_ranks(args):  # one process answers HTTP
        raise UsageError(f"--tp {args.tp} with serve: not served on several ranks; expected none")
    if tp.runs_ranks(args):
        return tp.run(args, line, _parse)
    return int(args.func(args))


def _parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, its model resolved: how a tensor-parallel rank reads it."""
    return resolve_model(_parse_line(argv))


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
    """The command line (:func:`~graphrunner_ref.cli.options.parser`), each
    command's function set."""
    parser = options.parser()
    for name, command in parser.commands.items():  # type: ignore[attr-defined]
        command.set_defaults(func=COMMANDS[name])
    return parser
