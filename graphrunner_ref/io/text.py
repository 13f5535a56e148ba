"""Text in, text out: a checkpoint's own tokenizer and chat template.

The tokenizer is the checkpoint's ``tokenizer.json`` / ``tokenizer_config.json``
loaded by transformers' ``AutoTokenizer`` (imported on first use: the token-id
paths never pay for it, nor need the ``[text]`` extra); the chat template is the one in
``tokenizer_config.json`` (or ``chat_template.jinja``), rendered as
transformers' ``apply_chat_template`` renders it, in a bounded sandbox
(:mod:`graphrunner_ref.io.chat_template`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from graphrunner.util import needs_extra
from graphrunner_ref.io.stop import cut_at_stop
from graphrunner_ref.model.config import CheckpointError

__all__ = [
    "TOKENIZER_FILES",
    "NoTokenizerError",
    "StreamPrinter",
    "TextCodec",
    "TokenizerVocabError",
    "has_tokenizer",
]

#: Any of these in a checkpoint directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class NoTokenizerError(ValueError):
    """Text was given for a model without a tokenizer (or without a chat template)."""


class TokenizerVocabError(CheckpointError):
    """A checkpoint's tokenizer makes token ids its model has no embedding for."""


def has_tokenizer(checkpoint: Path | None) -> bool:
    """Whether checkpoint directory ``checkpoint`` holds tokenizer files
    (None, the embedded random model, has none)."""
    return checkpoint is not None and any((checkpoint / f).is_file() for f in TOKENIZER_FILES)


class TextCodec:
    """Encode prompts, apply the chat template and decode outputs with one
    checkpoint's tokenizer.

    Args:
        tokenizer: a transformers tokenizer (what ``AutoTokenizer`` returns).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def load(
        cls,
        checkpoint: Path | None,
        *,
        what: str,
        vocab_size: int | None = None,
        named: str | None = None,
    ) -> TextCodec:
        """The tokenizer of ``checkpoint``; :class:`NoTokenizerError` naming
        ``what`` (the argument that needs it) when there is none. With
        ``vocab_size`` (the model's), a tokenizer that makes ids past it is
        refused here, before any run: :class:`TokenizerVocabError` names the
        tokenizer file, its size and the model's. ``named``: how the caller
        named the checkpoint in messages (``--model DIR``; default its path)."""
        if checkpoint is None or not has_tokenizer(checkpoint):
            model = (named or str(checkpoint)) if checkpoint else "the embedded random model"
            raise NoTokenizerError(
                f"{what} needs a tokenizer: {model} has none (expected one of "
                f"{', '.join(TOKENIZER_FILES)}); give token ids instead (a JSON list per line)"
            )
        with needs_extra("text", what):
            from transformers import AutoTokenizer

        _refuse_remote_code(checkpoint, named or str(checkpoint))
        # Never the checkpoint's own Python: an `auto_map` in its tokenizer
        # config would otherwise make transformers ask on stdin, then run it.
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(checkpoint), local_files_only=True, trust_remote_code=False
            )
        except Exception as e:  # transformers raises OSError, ValueError, JSON errors...
            raise NoTokenizerError(f"{named or checkpoint}: tokenizer not loadable: {e}") from None
        codec = cls(tokenizer)
        if vocab_size is not None and codec.vocab_size > vocab_size:
            file = next(checkpoint / f for f in TOKENIZER_FILES if (checkpoint / f).is_file())
            raise TokenizerVocabError(
                f"tokenizer {file}: a vocabulary of {codec.vocab_size} tokens (ids 0.."
                f"{codec.vocab_size - 1}), more than the model's vocab_size {vocab_size}; "
                f"expected at most {vocab_size}: ids past {vocab_size - 1} have no embedding"
            )
        return codec

    @property
    def vocab_size(self) -> int:
        """How many token ids the tokenizer can make: its largest id + 1, added
        tokens included."""
        ids = self.tokenizer.get_vocab().values()
        return max(len(self.tokenizer), max(ids, default=-1) + 1)

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token id, or None when the tokenizer names none."""
        eos = self.tokenizer.eos_token_id
        return None if eos is None else int(eos)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, with the special tokens the tokenizer adds (a
        BOS) unless ``special_tokens`` is False."""
        encoded = self.tokenizer(text, add_special_tokens=special_tokens)
        return [int(i) for i in encoded["input_ids"]]

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (``Ġthe``, ``<s>``)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def chat(self, text: str) -> list[int]:
        """The ids of a one-turn conversation (``text`` as the user's message)
        with the generation prompt appended, as ``apply_chat_template`` gives them."""
        return self.chat_messages([{"role": "user", "content": text}], what="--chat")

    def chat_messages(
        self,
        messages: list[dict[str, Any]],
        *,
        what: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of the conversation ``messages`` (``{"role", "content"}``
        each) with the generation prompt appended, as ``apply_chat_template``
        gives them, ``tools`` (function tools) handed to the template;
        :class:`NoTokenizerError` naming ``what`` when the checkpoint has no
        chat template or its template fails."""
        if self.tokenizer.chat_template is None:
            raise NoTokenizerError(f"{what}: the checkpoint's tokenizer has no chat template")
        with needs_extra("text", what):
            from graphrunner_ref.io.chat_template import ChatTemplateError, render_chat
        tokens = self.tokenizer.special_tokens_map
        try:
            text = render_chat(self.tokenizer.chat_template, messages, tokens, tools)
        except ChatTemplateError as e:
            raise NoTokenizerError(f"{what}: the checkpoint's chat template: {e}") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``, special tokens (the end token) left out unless
        ``skip_special_tokens`` is False."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


class StreamPrinter:
    """Print the answers as text while they are generated, in prompt order.

    Each answer is one block ``[rid] text`` and a blank line, where ``text`` is
    ``codec.decode(tokens).strip()``. Wire :meth:`token` to the engine's
    per-token hook and the printer itself to its finish hook: the first
    unfinished request of ``rids`` streams its text as its tokens arrive (the
    trailing whitespace and an incomplete character held back until more
    follows); a later one prints, caught up at once, when every request before
    it has finished. Without the token hook, each answer prints whole.
    :meth:`close` prints what is left (requests no hook reported).

    Args:
        codec: the checkpoint's tokenizer.
        rids: the request ids, in the order their answers print.
        out: where to print (default: ``sys.stdout`` at the time of printing).
        stops: stop strings: each answer ends before its first one, and a
            stream holds back what could be the start of one.
    """

    def __init__(
        self,
        codec: TextCodec,
        rids: Sequence[int],
        out: TextIO | None = None,
        stops: Sequence[str] = (),
    ) -> None:
        self.codec, self.out, self.stops = codec, out, list(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.order = list(rids)
        self.tokens: dict[int, list[int]] = {r: [] for r in self.order}
        self.shown: dict[int, str] = {}  # text printed so far, by request
        self.done: set[int] = set()
        self.printed: set[int] = set()  # whole blocks printed
        self._head = 0

    def token(self, rid: int, token: int) -> None:
        """One more token of request ``rid``."""
        self.tokens[rid].append(token)
        if self._head < len(self.order) and rid == self.order[self._head]:
            self._show(rid, final=False)

    def __call__(self, rid: int, tokens: list[int]) -> None:
        """Request ``rid`` finished with ``tokens``."""
        self.tokens[rid] = list(tokens)
        self.done.add(rid)
        while self._head < len(self.order) and self.order[self._head] in self.done:
            self._show(self.order[self._head], final=True)
            self._head += 1
        if self._head < len(self.order) and self.tokens[self.order[self._head]]:
            self._show(self.order[self._head], final=False)  # the new head catches up

    def end_line(self) -> None:
        """End a block cut short (a run interrupted while it streamed) as every
        block ends, with its blank line, so each record printed is whole and
        what is printed after starts a line of its own."""
        head = self.order[self._head] if self._head < len(self.order) else None
        if head in self.shown and head not in self.printed:
            out = self.out if self.out is not None else sys.stdout
            out.write("\n\n")
            out.flush()
            self.printed.add(head)

    def close(self, outputs: dict[int, list[int]]) -> None:
        """Print every answer not printed yet, ``outputs`` by request id."""
        for rid in self.order:
            if rid not in self.done:
                self(rid, outputs[rid])

    def _show(self, rid: int, *, final: bool) -> None:
        text, stop = cut_at_stop(self.codec.decode(self.tokens[rid]).lstrip(), self.stops)
        if not final and stop is None and self._hold:
            text = text[: -self._hold]  # it may be where a stop string starts
        text = text.rstrip() if final else text.rstrip().rstrip("\ufffd")
        shown = self.shown.get(rid)
        if shown is None and not text and not final:
            return  # the header waits for text: it and its first text print as one write
        new = ("" if shown is not None else f"[{rid}] ") + text[len(shown or "") :]
        self.shown[rid] = text if text.startswith(shown or "") else shown or ""
        if final:
            new += "\n\n"
            self.printed.add(rid)
        if new:
            out = self.out if self.out is not None else sys.stdout
            out.write(new)
            out.flush()


def _refuse_remote_code(checkpoint: Path, named: str) -> None:
    """A tokenizer config whose ``auto_map`` points at code in the checkpoint
    is refused in one line naming the file (transformers would ask to run it,
    or refuse in words of its own); no code of the checkpoint ever runs."""
    config = checkpoint / "tokenizer_config.json"
    if not config.is_file():
        return
    try:
        auto_map = json.loads(config.read_text()).get("auto_map")
    except (ValueError, AttributeError):
        return  # not JSON (or not an object): transformers' own error names it
    if auto_map:
        raise NoTokenizerError(
            f"{named}: {config} maps its tokenizer to code in the checkpoint (auto_map "
            f"{auto_map!r}); graphrunner runs no checkpoint code: expected a tokenizer "
            "transformers builds itself (tokenizer.json)"
        )
