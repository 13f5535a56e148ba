"""What the command line shares: its error, range checks, the device rule,
and reading prompts and writing outputs safely."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from graphrunner.util import write_atomically
from graphrunner_ref.engine.config import UsageError
from graphrunner_ref.model import ModelConfig

__all__ = [
    "MAX_STEPS",
    "parse_id_prompts",
    "read_source",
    "UsageError",
    "check_output",
    "check_range",
    "read_prompts",
    "resolve_device",
    "write_atomically",
]


#: --steps, --arrive-every: engine steps. The demo builds its whole trace, one
#: request per step, before it starts: the bound keeps that wait short.
MAX_STEPS = 100_000


def check_range(flag: str, value: int, lo: int, hi: int, why: str = "") -> None:
    if not lo <= value <= hi:
        raise UsageError(f"{flag} {value}: expected {lo}..{hi}" + (f" ({why})" if why else ""))


def resolve_device(runner: str | None, device: str | None, cuda_available: bool) -> tuple[str, str]:
    """The runner kind and device of ``--runner`` and ``--device``, either or both
    absent: an absent one follows the other (eager runs on the CPU unless a device
    is given); with neither, cuda when available, else cpu."""
    if device is None:
        on_gpu = cuda_available if runner is None else runner == "cuda"
        device = "cuda" if on_gpu else "cpu"
    if re.fullmatch(r"cpu|cuda(?::(?:0|[1-9]\d*))?", device) is None:
        raise UsageError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    on_cuda = device != "cpu"
    kind = runner or ("cuda" if on_cuda else "cpu")
    if kind != "eager" and (kind == "cuda") != on_cuda:
        expected = "cuda or cuda:N" if kind == "cuda" else "cpu"
        raise UsageError(
            f"--runner {kind} does not run on --device {device}: expected --device {expected}"
        )
    if on_cuda and not cuda_available:
        if runner == "cuda":
            raise UsageError("--runner cuda: no CUDA device is available; expected cpu or eager")
        raise UsageError(f"--device {device}: no CUDA device is available; expected cpu")
    return kind, device


def check_output(path: Path) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"--output {path}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise UsageError(f"--output {path}: is a directory")


def json_line(line: str, where: str) -> Any:
    """``line`` parsed as JSON; :class:`UsageError` naming ``where`` for invalid
    JSON, an int past Python's digit limit or nesting past its recursion limit."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not valid JSON ({e.msg}): {line[:60]!r}") from None
    except (ValueError, RecursionError) as e:
        kind = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise UsageError(f"{where}: not a list of token ids ({kind}): {line[:60]!r}") from None


def read_source(path: Path) -> tuple[str, str]:
    """The name and text of prompts file ``path`` (``-``: stdin, named
    ``<stdin>``); :class:`UsageError` for a missing file or bytes that are not
    UTF-8 (naming the line). A leading BOM is not part of line 1."""
    if str(path) == "-":
        name, data = "<stdin>", sys.stdin.buffer.read()
    elif not path.is_file():
        raise UsageError(f"prompts file {str(path)!r} not found")
    else:
        name, data = str(path), path.read_bytes()
    try:
        return name, data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        # Lines counted as below: the valid text before the bad byte, split the same way.
        lineno = len((data[: e.start].decode("utf-8") + "x").splitlines())
        raise UsageError(f"{name}:{lineno}: not valid UTF-8") from None


def read_prompts(path: Path, config: ModelConfig, max_new_tokens: int) -> list[list[int]]:
    """Parse and validate a prompts file of token-id lines (``-``: stdin);
    :class:`UsageError` names the line and value."""
    return parse_id_prompts(*read_source(path), config, max_new_tokens)


def parse_id_prompts(
    name: str, text: str, config: ModelConfig, max_new_tokens: int
) -> list[list[int]]:
    """The token-id prompts of ``text`` (one JSON list a line; blank lines
    skipped) read from ``name``; :class:`UsageError` names the line and value."""
    prompts: list[list[int]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        prompt = json_line(line.strip(), where)
        if not isinstance(prompt, list) or not prompt:
            raise UsageError(
                f"{where}: expected a non-empty JSON list of token ids, got {line.strip()[:60]!r}"
            )
        for i, tok in enumerate(prompt):
            is_id = isinstance(tok, int) and not isinstance(tok, bool)
            if not is_id or not 0 <= tok < config.vocab_size:
                raise UsageError(
                    f"{where}: token {i} = {tok!r} is not a token id in 0..{config.vocab_size - 1}"
                )
        needed = len(prompt) + max_new_tokens - 1
        if needed > config.max_position_embeddings:
            raise UsageError(
                f"{where}: prompt of {len(prompt)} tokens + {max_new_tokens} new "
                f"tokens needs a context of {needed}, longer than the model's "
                f"{config.max_position_embeddings}"
            )
        prompts.append(prompt)
    if not prompts:
        raise UsageError(f"prompts file {name!r} has no prompts")
    return prompts
