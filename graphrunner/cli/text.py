"""The command line's text and context options.

``--max-context-len N`` (demo and generate) sizes the request rows and the KV
pool for N tokens whatever the checkpoint declares, and refuses a prompt whose
tokens plus its new tokens exceed N before any work, naming the prompt.

``generate`` reads prompts from ``--prompt TEXT`` (repeatable) and
``--prompts FILE``: a line that starts with ``[`` is a JSON list of token ids,
one that starts with ``{`` a JSON object: ``"prompt"`` (token ids or text)
and any of ``"max_new_tokens"``, ``"temperature"``, ``"top_k"``, ``"top_p"``,
``"min_p"``, ``"seed"`` (overriding the flags for that prompt,
:mod:`graphrunner.cli.sampling`); any other line is text. A file of token-id
lines only is read exactly as before (:func:`~graphrunner.cli.common.read_prompts`). Text goes
through the checkpoint's tokenizer, with ``--chat`` through its chat template;
generation stops at the tokenizer's end-of-sequence token unless
``--ignore-eos``; with a tokenizer, answers print as text, each as soon as its
request finishes (``--json`` keeps the JSON lines of token ids).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphrunner.cli import sampling as cli_sampling
from graphrunner.cli import sizes as cli_sizes
from graphrunner.cli.common import (
    MAX_STEPS,
    UsageError,
    check_output,
    check_range,
    json_line,
    read_prompts,
)
from graphrunner.engine.results import TokenLogprobs
from graphrunner.engine.workload import Request
from graphrunner.io.text import (
    NoTokenizerError,
    StreamPrinter,
    TextCodec,
    TokenizerVocabError,
    has_tokenizer,
)
from graphrunner.model import ModelConfig

__all__ = [
    "Inputs",
    "add_context_argument",
    "add_generate_arguments",
    "check_generate",
    "context_limit",
    "limit_why",
    "read_inputs",
    "run_context",
]


def add_context_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-context-len",
        type=int,
        metavar="N",
        help="size request rows and the KV pool for N tokens, 1..the model's context "
        "(default: what the workload needs); a prompt plus its new tokens past N is refused",
    )


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "--prompts",
        type=Path,
        help="file of prompts, one per line: a JSON list of token ids, or text",
    )
    gen.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt (repeatable; needs a checkpoint with a tokenizer)",
    )
    gen.add_argument(
        "--chat", action="store_true", help="apply the checkpoint's chat template to text prompts"
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print JSON lines of token ids (the default without a tokenizer)",
    )
    gen.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the tokenizer's end-of-sequence token",
    )


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
    ``fields[i]`` its JSON-lines fields besides ``"prompt"`` (checked)."""

    prompts: list[list[int]]
    labels: list[str]
    codec: TextCodec | None
    end_token: int | None
    as_text: bool
    printer: StreamPrinter | None = field(default=None)
    fields: list[dict[str, Any]] = field(default_factory=list)

    @property
    def on_finish(self) -> Callable[[int, list[int]], None] | None:
        return self.printer

    def render(
        self,
        outputs: dict[int, list[int]],
        rids: Sequence[int],
        logprobs: dict[int, list[TokenLogprobs]] | None = None,
    ) -> str:
        """The output of the whole run: JSON lines (with ``"logprobs"`` when
        given), or the text blocks not yet streamed."""
        if not self.as_text or self.codec is None:
            return "".join(
                json.dumps(cli_sampling.output_line(r, outputs[r], logprobs)) + "\n" for r in rids
            )
        done = self.printer.printed if self.printer is not None else set()
        return "".join(
            f"[{r}] {self.codec.decode(outputs[r]).strip()}\n\n" for r in rids if r not in done
        )


def check_generate(args: argparse.Namespace, config: ModelConfig) -> tuple[int, Inputs]:
    """``generate``'s checks, every one before any model is built (Llama and
    state-space checkpoints alike): the context limit, ``--max-new-tokens``,
    ``--arrive-every``, ``--end-token``, the output paths; then the prompts.
    Returns the limit and the prompts read."""
    limit = context_limit(args, config)
    check_range("--max-new-tokens", args.max_new_tokens, 1, limit, limit_why(args))
    check_range("--arrive-every", args.arrive_every, 0, MAX_STEPS)
    if args.end_token is not None and not 0 <= args.end_token < config.vocab_size:
        raise UsageError(
            f"--end-token {args.end_token}: expected a token id in 0..{config.vocab_size - 1}"
        )
    if args.output is not None:
        check_output(args.output)
    cli_sizes.check_run_outputs(args)
    return limit, read_inputs(args, config, limit, stream=args.output is None)


def read_inputs(
    args: argparse.Namespace, config: ModelConfig, limit: int, *, stream: bool
) -> Inputs:
    """Every prompt as token ids, checked against the vocabulary and ``limit``
    (:class:`UsageError` naming the prompt); the tokenizer loaded when the
    checkpoint has one or text needs one, and refused when it makes ids past
    the model's vocabulary. ``stream``: print text answers as
    requests finish (stdout output)."""
    if args.prompts is None and not args.prompt:
        raise UsageError("generate needs --prompts FILE or --prompt TEXT")
    file_lines = _file_lines(args.prompts)
    objects = {
        n: cli_sampling.prompt_object(line, f"{args.prompts}:{n}", limit)
        for n, line in file_lines
        if line[:1] == "{"
    }
    texts_in_file = any(not _is_ids(line) for _, line in file_lines) or any(
        isinstance(o["prompt"], str) for o in objects.values()
    )
    codec = None
    if has_tokenizer(args.checkpoint) or args.prompt or texts_in_file or args.chat:
        what = "--prompt" if args.prompt else "--chat" if args.chat else f"{args.prompts} (text)"
        try:
            codec = TextCodec.load(args.checkpoint, what=what, vocab_size=config.vocab_size)
        except (NoTokenizerError, TokenizerVocabError) as e:
            raise UsageError(str(e)) from None
    prompts: list[list[int]] = []
    labels: list[str] = []
    fields: list[dict[str, Any]] = []
    for i, text in enumerate(args.prompt):
        prompts.append(_encode(codec, text, args.chat, f"--prompt {i}"))
        labels.append(f"--prompt {i} ({text[:40]!r})")
    if args.prompts is not None and not texts_in_file and not objects:
        # Token ids only: the file is read, and its errors worded, as ever.
        prompts += read_prompts(args.prompts, config, args.max_new_tokens)
        labels += [f"{args.prompts}:{n}" for n, _ in file_lines]
    else:
        for n, line in file_lines:
            where = f"{args.prompts}:{n}"
            obj = objects.get(n)
            if obj is None:
                ids = _ids(line, config, where) if _is_ids(line) else None
                prompts.append(ids if ids is not None else _encode(codec, line, args.chat, where))
                fields.append({})
            else:
                prompt = obj.pop("prompt")
                own = isinstance(prompt, list)
                prompts.append(
                    _ids(prompt, config, where) if own else _encode(codec, prompt, args.chat, where)
                )
                fields.append(obj)
            labels.append(where)
    fields = [{} for _ in range(len(prompts) - len(fields))] + fields  # --prompt, id lines
    _check_lengths(args, prompts, labels, limit, fields)
    end = args.end_token
    if end is None and codec is not None and not args.ignore_eos:
        end = codec.eos_token_id
    as_text = codec is not None and not args.json and not getattr(args, "logprobs", 0)
    printer = StreamPrinter(codec) if as_text and stream and codec is not None else None
    return Inputs(prompts, labels, codec, end, as_text, printer, fields)


def _file_lines(path: Path | None) -> list[tuple[int, str]]:
    """Non-blank lines of ``path`` with their numbers (the file checks are
    :func:`read_prompts`' when it reads the file)."""
    if path is None:
        return []
    if not path.is_file():
        raise UsageError(f"prompts file {str(path)!r} not found")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading BOM is not part of line 1
    except UnicodeDecodeError:
        return [(0, "[")]  # token-id mode: read_prompts names the bad line
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError(f"prompts file {str(path)!r} has no prompts")
    return lines


def _is_ids(line: str) -> bool:
    return line[:1] in ("[", "{")


def _ids(line: str | list[Any], config: ModelConfig, where: str) -> list[int]:
    """Token ids from a JSON line (or an object's ``"prompt"`` list), checked."""
    ids = json_line(line, where) if isinstance(line, str) else line
    ok = isinstance(ids, list) and ids and all(type(t) is int for t in ids)
    if not ok or not all(0 <= t < config.vocab_size for t in ids):
        shown = line if isinstance(line, str) else json.dumps(line)
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
