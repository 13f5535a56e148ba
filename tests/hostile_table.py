"""The machinery of the hostile-inputs table (``tests/test_hostile_inputs.py``).

A :class:`Case` runs the real code on one hostile input through one entry
point (``graphrunner_ref.cli.main.main`` in-process, or a library call) and
returns its :class:`Outcome`: the exit status or the exception type, and the
first line of the error. The test fails a case whose outcome is not the one
expected (a traceback, a plain exception, exit 1 instead of 2, an error that
no longer names what it should); the table is written from the outcomes.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import graphrunner_ref.cli.main as cli


@dataclass(frozen=True)
class Outcome:
    """``kind``: ``exit N``, an exception type, ``exit N (Type)`` for both, or
    ``ok`` (handled without an error); ``text``: the error's first line (the
    CLI's one stderr line), or what was observed when there is no error."""

    kind: str
    text: str


@dataclass(frozen=True)
class Case:
    """One hostile input: ``run`` gives its outcome, whose kind must match the
    regular expression ``kind`` in full and whose text must contain a match
    of ``text``."""

    group: str
    name: str
    entry: str
    run: Callable[[World], Outcome]
    kind: str
    text: str


class World:
    """Fresh folders under ``root``, and the checkpoints several cases share,
    built on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made = 0

    def dir(self, name: str) -> Path:
        self._made += 1
        path = self.root / f"{self._made:03d}-{name}"
        path.mkdir()
        return path

    @cached_property
    def text_checkpoints(self) -> tuple[Path, Path]:
        """(a tiny checkpoint with its own tokenizer, a vocab-256 model
        carrying that larger tokenizer)."""
        from test_tokenizer_vocab import oversized_tokenizer_checkpoint

        return oversized_tokenizer_checkpoint(self.dir("text"))

    @cached_property
    def prompts(self) -> Path:
        """A file of two token-id prompts."""
        path = self.dir("prompts") / "prompts.jsonl"
        path.write_text("[1, 2, 3]\n[4, 5]\n")
        return path


def first_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return lines[0] if lines else ""


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``graphrunner ARGV`` in-process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def cli_outcome(argv: list[str]) -> Outcome:
    """The exit status of ``graphrunner ARGV`` and its last stderr line (the
    one line every way a command stops prints)."""
    code, _, err = run_cli(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    return Outcome(f"exit {code}", lines[-1] if lines and code else "")


def api_outcome(call: Callable[[], Any]) -> Outcome:
    """The type and first line of what ``call()`` raised, or ``ok``."""
    try:
        call()
    except Exception as e:  # its type is the outcome: the table names it
        return Outcome(type(e).__name__, first_line(e))
    return Outcome("ok", "")


def both(call: Callable[[], Any], argv: list[str]) -> Outcome:
    """The CLI's exit status with the type the library call raised."""
    api, command = api_outcome(call), cli_outcome(argv)
    return Outcome(f"{command.kind} ({api.kind})", command.text or api.text)


@contextlib.contextmanager
def environ(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def check(case: Case, outcome: Outcome) -> str:
    """'' when ``outcome`` is what ``case`` expects; else what differs."""
    if not re.fullmatch(case.kind, outcome.kind):
        return f"outcome {outcome.kind!r}, expected {case.kind!r}: {outcome.text}"
    if not re.search(case.text, outcome.text):
        return f"text {outcome.text!r} does not match {case.text!r}"
    return ""


def _cell(text: str, root: Path, limit: int = 160) -> str:
    """``text`` for a table cell, the same in every run: the case's folder
    and thread numbers left out, pipes escaped, cut to ``limit``."""
    text = re.sub(r"<tmp>/\d{3}-[\w-]+", "<tmp>", text.replace(str(root), "<tmp>"))
    text = re.sub(r"'Thread-\d+", "'Thread-N", text)
    text = text.replace("|", "\\|").replace("`", "'")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def table(rows: list[tuple[Case, Outcome]], root: Path, header: list[str]) -> str:
    lines = [*header, "", "| # | case | entry point | outcome | error (first line) |"]
    lines.append("|---|---|---|---|---|")
    group = None
    for i, (case, outcome) in enumerate(rows, 1):
        if case.group != group:
            group = case.group
            lines.append(f"| | **{group}** | | | |")
        text = _cell(outcome.text, root) or "—"
        entry = _cell(case.entry, root, 120)
        lines.append(f"| {i} | {_cell(case.name, root)} | `{entry}` | {outcome.kind} | {text} |")
    groups = {c.group for c, _ in rows}
    lines.append(f"| | **{len(rows)} cases in {len(groups)} groups, each as expected** | | | |")
    return "\n".join(lines) + "\n"
