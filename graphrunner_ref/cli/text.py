"""The command line's text and context options.

``--max-context-len N`` (demo and generate) sizes the request rows and the KV
pool for N tokens whatever the checkpoint declares, and refuses a prompt whose
tokens plus its new tokens exceed N before any work, naming the prompt.

``generate`` reads prompts from ``--prompt TEXT`` (repeatable) and
``--prompts FILE`` (``-``: stdin) in ``--prompts-format``
(:mod:`graphrunner_ref.cli.prompts`). Text goes through the checkpoint's
tokenizer, with ``--chat`` through its chat template; generation stops at the
tokenizer's end-of-sequence token unless ``--ignore-eos``; with a tokenizer,
answers print as text (:mod:`graphrunner_ref.cli.answers`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli import prompts as cli_prompts
from graphrunner_ref.cli import sizes as cli_sizes
from graphrunner_ref.cli.common import (
    MAX_STEPS,
    UsageError,
    check_output,
    check_range,
    parse_id_prompts,
)
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io.stop import StopStrings
from graphrunner_ref.io.text import (
    NoTokenizerError,
    StreamPrinter,
    TextCodec,
    TokenizerVocabError,
    has_tokenizer,
)
from graphrunner_ref.model import ModelConfig

__all__ = [
    "Inputs",
    "check_generate",
    "context_limit",
    "limit_why",
    "read_inputs",
    "run_context",
]


def context_limit(args: argparse.Namespace, config: ModelConfig) -> int:
    """``--max-context-len`` checked against the model's context, or the model's context."""
    model = config.max_position_embeddings
    if args.max_context_len is None:
        return model
    check_range("--max-context-len", args.max_context_len, 1, model, "the model's context")
    return int(args.max_context_len)


def limit_why(args: argparse.Namespace) -> str:
    """What bounds the run's context, for a range error."""
    return "the model's context" if args.max_context_len is None else "--max-context-len"


def _limit_name(args: argparse.Namespace, limit: int) -> str:
    if args.max_context_len is None:
        return f"the model's context {limit}"
    return f"--max-context-len {limit}"


def run_context(args: argparse.Namespace, trace: Sequence[Request], extra: int, limit: int) -> int:
    """The context the pools are sized for: ``--max-context-len`` when given,
    else what the trace needs (plus ``extra`` slots a speculative round takes)."""
    need = max(r.max_len for r in trace) + extra
    if need > limit:
        raise UsageError(
            f"--draft-tokens {args.draft_tokens}: the prompts need a context of {need} "
            f"with the draft tokens, longer than {_limit_name(args, limit)}"
        )
    return limit if args.max_context_len is not None else need


@dataclass(slots=True)
class Inputs:
    """The prompts of a generate run: ``prompts[i]`` (token ids) is request ``i``,
    named ``labels[i]`` in errors; ``codec`` the checkpoint's tokenizer, if any;
    ``fields[i]`` its JSON-lines fields besides ``"prompt"`` (checked);
    ``printer`` prints text answers to stdout (None: JSON records), and
    ``stream`` says whether it takes each token as it is generated;
    ``stops`` ends answers at ``--stop`` texts (None: none given)."""

    prompts: list[list[int]]
    labels: list[str]
    codec: TextCodec | None
    end_token: int | None
    printer: StreamPrinter | None = field(default=None)
    fields: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    stops: StopStrings | None = None

    @property
    def stop(self) -> Callable[[int, list[int]], bool] | None:
        return self.stops

    @property
    def on_finish(self) -> Callable[[int, list[int]], None] | None:
        return self.printer

    @property
    def on_token(self) -> Callable[[int, int], None] | None:
        return self.printer.token if self.printer is not None and self.stream else None


def check_generate(args: argparse.Namespace, config: ModelConfig) -> tuple[int, Inputs]:
    """``generate``'s checks, every one before any model is built (Llama and
    state-space checkpoints alike): the context limit, ``--max-new-tokens``,
    ``--arrive-every``, ``--end-token``, the output paths; then the prompts.
    Returns the limit and the prompts read."""
    limit = context_limit(args, config)
    check_range("--max-new-tokens", args.max_new_tokens, 1, limit, limit_why(args))
    check_range("--arrive-every", args.arrive_every, 0, MAX_STEPS)
    check_end_token(args, config.vocab_size)
    if args.output is not None:
        check_output(args.output)
    cli_sizes.check_run_outputs(args)
    return limit, read_inputs(args, config, limit, to_stdout=args.output is None)


def check_end_token(args: argparse.Namespace, vocab_size: int) -> None:
    """``--end-token`` a token id of the vocabulary, when given."""
    if args.end_token is not None and not 0 <= args.end_token < vocab_size:
        raise UsageError(
            f"--end-token {args.end_token}: expected a token id in 0..{vocab_size - 1}"
        )


def end_token_of(args: argparse.Namespace, codec: TextCodec | None) -> int | None:
    """The token that ends an answer: ``--end-token``, else the tokenizer's
    end-of-sequence token unless ``--ignore-eos``; None: none."""
    if args.end_token is not None:
        return int(args.end_token)
    return None if codec is None or args.ignore_eos else codec.eos_token_id


def read_inputs(
    args: argparse.Namespace, config: ModelConfig, limit: int, *, to_stdout: bool
) -> Inputs:
    """Every prompt as token ids, checked against the vocabulary and ``limit``
    (:class:`UsageError` naming the prompt); the tokenizer loaded when the
    checkpoint has one or text needs one, and refused when it makes ids past
    the model's vocabulary. ``to_stdout``: the answers print (no ``--output``)."""
    args.prompt = [*args.prompt, *getattr(args, "prompt_text", [])]  # positional ones too
    args.prompt_text = []
    if args.prompts is None and not args.prompt:
        raise UsageError("generate needs a prompt: PROMPT, --prompt TEXT or --prompts FILE")
    tokenizer = has_tokenizer(args.checkpoint)
    name, source, lines = "", "", list[cli_prompts.PromptLine]()
    if args.prompts is not None:
        name, source, lines = cli_prompts.read_lines(
            args.prompts, args.prompts_format, lenient=tokenizer, limit=limit
        )
    texts_in_file = any(isinstance(line.prompt, str) for line in lines)
    codec = None
    if tokenizer or args.prompt or texts_in_file or args.chat:
        what = "--prompt" if args.prompt else "--chat" if args.chat else f"{name} (text)"
        try:
            named = cli_model.model_source(args) if args.checkpoint else None
            codec = TextCodec.load(
                args.checkpoint, what=what, vocab_size=config.vocab_size, named=named
            )
        except (NoTokenizerError, TokenizerVocabError) as e:
            raise UsageError(str(e)) from None
    prompts: list[list[int]] = []
    labels: list[str] = []
    for i, text in enumerate(args.prompt):
        prompts.append(_encode(codec, text, args.chat, f"--prompt {i}"))
        labels.append(f"--prompt {i} ({text[:40]!r})")
    fields: list[dict[str, Any]] = [{} for _ in prompts]
    if lines and all(line.is_ids_line for line in lines):
        # Token ids only: the file is read, and its errors worded, as ever.
        prompts += parse_id_prompts(name, source, config, args.max_new_tokens)
        labels += [line.where for line in lines]
        fields += [{} for _ in lines]
    else:
        for line in lines:
            prompts.append(
                _ids(line.prompt, config, line.where)
                if isinstance(line.prompt, list)
                else _encode(codec, line.prompt, args.chat, line.where)
            )
            fields.append(dict(line.fields))
            labels.append(line.where)
    _check_lengths(args, prompts, labels, limit, fields)
    end = end_token_of(args, codec)
    as_text = codec is not None and not args.json and not getattr(args, "logprobs", 0)
    stops = _stop_strings(args, codec)
    printer = None
    if as_text and to_stdout and codec:
        printer = StreamPrinter(codec, range(len(prompts)), stops=stops.stops if stops else ())
    return Inputs(
        prompts, labels, codec, end, printer, fields, stream=not args.no_stream, stops=stops
    )


def _stop_strings(args: argparse.Namespace, codec: TextCodec | None) -> StopStrings | None:
    """``--stop`` texts, checked: each non-empty, a tokenizer to read answers
    with, and no ``--speculative`` (its engine takes no stop hook)."""
    stops = list(getattr(args, "stop", None) or [])
    if not stops:
        return None
    for text in stops:
        if not text:
            raise UsageError("--stop '': expected a non-empty text")
    if codec is None:
        raise UsageError(
            f"--stop {stops[0]!r}: needs the checkpoint's tokenizer to read the answers "
            "as text; expected --model DIR (or --checkpoint) with a tokenizer"
        )
    if getattr(args, "speculative", False):
        raise UsageError(f"--stop {stops[0]!r} with --speculative: expected one or the other")
    return StopStrings(codec, stops)


def _ids(ids: list[Any], config: ModelConfig, where: str) -> list[int]:
    """Token ids from a JSON line (or an object's ``"prompt"`` list), checked."""
    ok = ids and all(type(t) is int for t in ids)
    if not ok or not all(0 <= t < config.vocab_size for t in ids):
        shown = json.dumps(ids)
        raise UsageError(
            f"{where}: expected a non-empty JSON list of token ids in "
            f"0..{config.vocab_size - 1}, got {shown[:60]!r}"
        )
    return list(ids)


def _encode(codec: TextCodec | None, text: str, chat: bool, where: str) -> list[int]:
    assert codec is not None  # loaded whenever there is text
    try:
        ids = codec.chat(text) if chat else codec.encode(text)
    except NoTokenizerError as e:
        raise UsageError(str(e)) from None
    if not ids:
        raise UsageError(f"{where}: {text[:40]!r} encodes to no tokens; expected at least one")
    return ids


def _check_lengths(
    args: argparse.Namespace,
    prompts: list[list[int]],
    labels: list[str],
    limit: int,
    fields: list[dict[str, Any]],
) -> None:
    for ids, label, own in zip(prompts, labels, fields, strict=True):
        new = own.get("max_new_tokens", args.max_new_tokens)
        need = len(ids) + new - 1
        if need > limit:
            raise UsageError(
                f"{label}: prompt of {len(ids)} tokens + {new} new tokens "
                f"needs a context of {need}, longer than {_limit_name(args, limit)}"
            )
