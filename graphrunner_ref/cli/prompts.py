"""``generate``'s prompt files: ``--prompts FILE`` (``-``: stdin) read as
``--prompts-format``.

- ``text``: every non-blank line is one text prompt.
- ``ids``: every non-blank line is a JSON list of token ids.
- ``jsonl``: every non-blank line is a JSON object: ``"prompt"`` (text, which
  may hold newlines, or a list of token ids) and any of ``"max_new_tokens"``,
  ``"temperature"``, ``"top_k"``, ``"top_p"``, ``"min_p"``, ``"seed"``
  (:mod:`graphrunner_ref.cli.sampling`).
- ``auto`` (the default): a line that starts with ``[`` is token ids and one
  that starts with ``{`` an object, as above; any other line is text. When the
  model has a tokenizer (text can be served), a ``[`` or ``{`` line that is not
  valid JSON, or JSON of another shape (``[INST] What is 2+2? [/INST]``), is
  text, never an error; without one it is an error naming the line.

In ``ids`` and ``jsonl`` a bad line is an error naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli.common import UsageError, json_line, read_source

__all__ = ["FORMATS", "PromptLine", "read_lines"]

FORMATS = ("auto", "text", "ids", "jsonl")


@dataclass(frozen=True, slots=True)
class PromptLine:
    """One prompt of a file: ``where`` names it (``FILE:LINE``); ``prompt`` is
    text or a JSON list (token ids, checked by the caller); ``fields`` its
    JSON-lines fields besides ``"prompt"`` (checked)."""

    where: str
    prompt: str | list[Any]
    fields: dict[str, Any] = field(default_factory=dict)
    from_object: bool = False

    @property
    def is_ids_line(self) -> bool:
        """A bare JSON list (token ids), no object around it."""
        return isinstance(self.prompt, list) and not self.from_object


def read_lines(
    path: Path, fmt: str, *, lenient: bool, limit: int
) -> tuple[str, str, list[PromptLine]]:
    """The source's name and text, and its non-blank lines read as ``fmt``
    (``lenient``: ``auto`` reads a bad ``[``/``{`` line as text). ``limit``
    bounds a line's ``max_new_tokens``."""
    name, text = read_source(path)
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError(f"prompts file {name!r} has no prompts")
    return name, text, [_line(line, f"{name}:{n}", fmt, lenient, limit) for n, line in lines]


def _line(line: str, where: str, fmt: str, lenient: bool, limit: int) -> PromptLine:
    if fmt == "text":
        return PromptLine(where, line)
    if fmt == "jsonl" or (fmt == "auto" and line[:1] == "{"):
        if fmt == "auto" and lenient and not _is_object(line):
            return PromptLine(where, line)
        if fmt == "jsonl" and line[:1] != "{":
            raise UsageError(
                f'{where}: expected a JSON object with a "prompt" (--prompts-format jsonl), '
                f"got {line[:60]!r}"
            )
        obj = cli_sampling.prompt_object(line, where, limit)
        return PromptLine(where, obj.pop("prompt"), obj, from_object=True)
    if fmt == "ids" or line[:1] == "[":
        if fmt == "auto" and lenient and not _is_ids(line):
            return PromptLine(where, line)
        value = json_line(line, where)
        if not isinstance(value, list):
            raise UsageError(
                f"{where}: expected a non-empty JSON list of token ids, got {line[:60]!r}"
            )
        return PromptLine(where, value)
    return PromptLine(where, line)


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def _is_ids(line: str) -> bool:
    """Whether ``line`` is a JSON list of ints (the shape of token ids)."""
    value = _loads(line)
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _is_object(line: str) -> bool:
    """Whether ``line`` is a JSON object with a text or token-id ``"prompt"``."""
    value = _loads(line)
    return isinstance(value, dict) and isinstance(value.get("prompt"), (str, list))
