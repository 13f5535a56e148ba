"""What ``generate`` prints and writes.

One JSON record per request, in prompt order, with vLLM's names: ``{"index":
i, "prompt": text (with a tokenizer), "prompt_token_ids": [ids], "text": ...
(with a tokenizer), "token_ids": [ids], "finish_reason": "stop" | "length",
"prompt_tokens": n, "completion_tokens": m}``, and ``"logprobs"`` with
``--logprobs``, ``"stop_reason"`` (the text) where a ``--stop`` text ended the
answer. ``--output FILE`` writes them as JSON lines (atomically),
``--json`` prints them; without either, a checkpoint with a tokenizer prints
text answers, streamed token by token (``--no-stream``: each answer whole),
and one without prints the records. Progress bars (capture and run) and a
summary line go to stderr, the bars only when it is a terminal; ``--quiet``
drops both.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphrunner.sizing import CaptureReport
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli.common import write_atomically
from graphrunner_ref.cli.text import Inputs
from graphrunner_ref.engine.results import EngineStats, TokenLogprobs
from graphrunner_ref.io.stop import StopStrings, cut_at_stop
from graphrunner_ref.io.text import TextCodec

__all__ = [
    "Served",
    "emit",
    "finish_reason",
    "progress",
    "records",
    "summary",
    "to_lines",
]


def progress(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars: stderr is a terminal and no ``--quiet``."""
    return not args.quiet and sys.stderr.isatty()


def finish_reason(tokens: Sequence[int], end_token: int | None, stopped: bool = False) -> str:
    """``"stop"`` when the answer ends with the end token or a stop string
    ended it, else ``"length"``."""
    ended = end_token is not None and tokens and tokens[-1] == end_token
    return "stop" if ended or stopped else "length"


def records(
    prompts: Sequence[Sequence[int]],
    outputs: Mapping[int, list[int]],
    end_token: int | None,
    codec: TextCodec | None,
    logprobs: Mapping[int, list[TokenLogprobs]] | None = None,
    stops: StopStrings | None = None,
) -> list[dict[str, Any]]:
    """The record of each request ``i`` (``prompts[i]`` its prompt's ids); an
    answer a stop string ended has its text cut before it and names it in
    ``"stop_reason"``."""
    out = []
    for rid, prompt in enumerate(prompts):
        tokens = outputs[rid]
        line = cli_sampling.output_line(rid, tokens, logprobs)
        record: dict[str, Any] = {"index": rid}
        if codec is not None:
            record["prompt"] = codec.decode(list(prompt))
        record["prompt_token_ids"] = list(prompt)
        stop = None if stops is None else stops.hits.get(rid)
        if codec is not None:
            text = codec.decode(tokens)
            record["text"] = text if stops is None else cut_at_stop(text, stops.stops)[0]
        record |= {
            "token_ids": tokens,
            "finish_reason": finish_reason(tokens, end_token, stop is not None),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
        }
        if stop is not None:
            record["stop_reason"] = stop
        if "logprobs" in line:
            record["logprobs"] = line["logprobs"]
        out.append(record)
    return out


def to_lines(recs: Sequence[Mapping[str, Any]]) -> str:
    """``recs`` as JSON lines."""
    return "".join(json.dumps(r) + "\n" for r in recs)


def summary(
    prompts: Sequence[Sequence[int]],
    outputs: Mapping[int, list[int]],
    *,
    tokens_per_second: float,
    padded_fraction: float | None,
    capture: CaptureReport | None,
    stats: EngineStats | None = None,
    prefix_cache: str | None = None,
) -> str:
    """The run's summary line: requests, prompt and generated tokens, decode
    tokens/s (the replays alone; with ``stats``, also each decode step
    whole, as another engine's loop is timed), the padded-row fraction, the
    prefix cache's hit rate (``prefix_cache``, the engine's or the
    speculative engine's :func:`prefix_cache_part`), the
    capture time (with its start: cold where something compiled afresh, warm
    where the compile caches answered) and the graph launches and
    device-to-host reads per decode token (the last three when known)."""
    parts = [
        f"{len(prompts)} requests",
        f"{sum(len(p) for p in prompts)} prompt tokens",
        f"{sum(len(t) for t in outputs.values())} generated tokens",
        f"decode {tokens_per_second:,.1f} tokens/s",
    ]
    if stats is not None and stats.wall_tokens_per_second > 0:
        parts[-1] += f" ({stats.wall_tokens_per_second:,.1f} timing whole steps)"
    if padded_fraction is not None:
        parts.append(f"padded rows {padded_fraction:.1%}")
    if prefix_cache is not None:
        parts.append(prefix_cache)
    if capture is not None:
        start = "" if capture.start == "none" else f" ({capture.start} start)"
        parts.append(f"capture {capture.total_seconds:.1f} s{start}")
    if stats is not None:
        parts.append(
            f"{stats.launches_per_token:.3f} launches and {stats.syncs_per_token:.3f} syncs "
            "per token"
        )
    return "generate: " + ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Served:
    """What a generate run produced: outputs by request id, the mismatches
    ``--check`` found, the log-probabilities ``--logprobs`` asked for, and the
    numbers of the summary line (``stats``: the engine's, when the run had one)."""

    outputs: dict[int, list[int]]
    mismatches: int = 0
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    tokens_per_second: float = 0.0
    padded_fraction: float | None = None
    capture: CaptureReport | None = None
    stats: EngineStats | None = None
    prefix_cache: str | None = None


def emit(args: argparse.Namespace, inputs: Inputs, served: Served) -> int:
    """Print or write the answers of ``served``, then (unless ``--quiet``) the
    summary line on stderr. Returns 1 when ``--output`` cannot be written."""
    recs = records(
        inputs.prompts,
        served.outputs,
        inputs.end_token,
        inputs.codec,
        served.logprobs,
        inputs.stops,
    )
    if args.output is not None:
        try:
            write_atomically(args.output, to_lines(recs))
        except OSError as e:
            print(f"graphrunner generate: error: --output {args.output}: {e}", file=sys.stderr)
            return 1
    elif inputs.printer is not None:
        inputs.printer.close(served.outputs)  # what no hook printed
    else:
        sys.stdout.write(to_lines(recs))
    if not args.quiet:
        sys.stdout.flush()
        line = summary(
            inputs.prompts,
            served.outputs,
            tokens_per_second=served.tokens_per_second,
            padded_fraction=served.padded_fraction,
            capture=served.capture,
            stats=served.stats,
            prefix_cache=served.prefix_cache,
        )
        print(line, file=sys.stderr)
    return 0
