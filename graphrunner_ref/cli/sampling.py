"""The command line's sampling options, for ``demo`` and ``generate``.

``--temperature``, ``--top-k``, ``--top-p`` and ``--min-p`` set every
request's :class:`~graphrunner.sampling.SamplingParams` (greedy by default:
temperature 0); ``--seed`` is the run seed of :class:`Engine`, from which a
request without a seed of its own derives one (with its request id). A
JSON-lines prompt of ``generate`` may carry its own ``"max_new_tokens"``,
``"temperature"``, ``"top_k"``, ``"top_p"``, ``"min_p"`` and ``"seed"``
(:mod:`graphrunner_ref.cli.text`); its values override the flags.
``generate --logprobs N`` adds each token's log-probability and the top N to
the JSON lines. A run in which no request samples and no log-probability is
asked keeps the plain (argmax) runner.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from graphrunner.sampling import SamplingParams
from graphrunner_ref.cli.common import UsageError, check_range, json_line
from graphrunner_ref.engine.results import TokenLogprobs
from graphrunner_ref.engine.sampling import MAX_LOGPROBS
from graphrunner_ref.engine.serving import penalized, samples
from graphrunner_ref.engine.workload import Request

__all__ = [
    "FLAGS",
    "LINE_FIELDS",
    "apply",
    "check_bias",
    "check_line",
    "check_modes",
    "flag_params",
    "output_line",
    "prompt_object",
    "settle_seed",
]

#: The sampling flags by SamplingParams field.
FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p"}
#: The largest top-k: the sampling buffers hold int64.
MAX_TOP_K = 2**63 - 1
#: Penalties and logit bias a JSON-lines prompt may set (vLLM's and OpenAI's).
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
#: What a JSON-lines prompt may set besides its ``"prompt"``.
LINE_FIELDS = ("max_new_tokens", *FLAGS, "seed", *PENALTIES)


def _reason(e: ValueError) -> str:
    """What a SamplingParams error expected (after its ``name=value; ``)."""
    return str(e).split("; ", 1)[-1]


def flag_params(args: argparse.Namespace) -> SamplingParams:
    """The flags' parameters; :class:`UsageError` naming the flag and the value."""
    for name, flag in FLAGS.items():
        value = getattr(args, name)
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            raise UsageError(f"{flag} {value}: {_reason(e)}") from None
    if args.top_k > MAX_TOP_K:
        raise UsageError(f"--top-k {args.top_k}: expected an int in 0..{MAX_TOP_K} (0: no limit)")
    check_range("--logprobs", getattr(args, "logprobs", 0), 0, MAX_LOGPROBS)
    return SamplingParams(**{name: getattr(args, name) for name in FLAGS})


def check_line(fields: Mapping[str, Any], where: str, limit: int) -> None:
    """A JSON-lines prompt's fields besides ``"prompt"`` (:data:`LINE_FIELDS`)
    checked: :class:`UsageError` naming ``where`` and the field. ``limit``
    bounds ``max_new_tokens``."""
    unknown = [k for k in fields if k not in LINE_FIELDS]
    if unknown:
        raise UsageError(
            f'{where}: unknown field {unknown[0]!r}; expected "prompt" and any of '
            + ", ".join(f'"{k}"' for k in LINE_FIELDS)
        )
    if "max_new_tokens" in fields:
        n = fields["max_new_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
            raise UsageError(f"{where}: max_new_tokens={n!r}; expected an int in 1..{limit}")
    try:
        SamplingParams(**_params_of(fields))
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None
    if fields.get("top_k", 0) > MAX_TOP_K:
        raise UsageError(
            f"{where}: top_k={fields['top_k']}; expected an int in 0..{MAX_TOP_K} (0: no limit)"
        )


def _params_of(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A line's SamplingParams fields; ``logit_bias`` keys (JSON strings) as
    token ids (a ValueError naming it when one is not)."""
    out = {n: fields[n] for n in (*FLAGS, "seed", *PENALTIES) if n in fields}
    bias = out.get("logit_bias")
    if isinstance(bias, dict):
        try:
            out["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias={bias!r}; expected token ids as keys") from None
    return out


def apply(
    trace: Sequence[Request], base: SamplingParams, lines: Sequence[Mapping[str, Any]] = ()
) -> list[Request]:
    """``trace`` with each request's sampling: ``base`` overridden by its
    line's fields (``lines[rid]``, checked already); greedy ones keep None."""
    out = []
    for r in trace:
        fields = lines[r.rid] if r.rid < len(lines) else {}
        params = dataclasses.replace(base, **_params_of(fields))
        budget = fields.get("max_new_tokens", r.max_new_tokens)
        sampling = None if params.greedy and not params.penalized else params
        out.append(dataclasses.replace(r, max_new_tokens=budget, sampling=sampling))
    return out


def check_bias(trace: Sequence[Request], vocab: int) -> None:
    """Every request's ``logit_bias`` token ids in ``[0, vocab)``, or a
    :class:`UsageError` naming the request."""
    for r in trace:
        if r.sampling is not None:
            try:
                r.sampling.check_vocab(vocab)
            except ValueError as e:
                raise UsageError(f"prompt {r.rid}: {e}") from None


def settle_seed(args: argparse.Namespace, trace: Sequence[Request], command: str) -> None:
    """Sampling without ``--seed``: draw a fresh run seed and say it on stderr,
    so the run can be repeated (``--seed N``); the same seed then also makes
    the embedded model's weights, as ``--seed N`` will."""
    if getattr(args, "seed_given", True) or not samples(trace):
        return
    args.seed = secrets.randbelow(2**31)
    print(
        f"{command}: sampling with seed {args.seed} (drawn; --seed {args.seed} repeats this run)",
        file=sys.stderr,
    )


def check_modes(args: argparse.Namespace, trace: Sequence[Request], command: str) -> None:
    """Refuse ``--speculative`` with sampling in ``demo`` or with ``--check``:
    both compare with plain decoding token for token, and sampled speculative
    decoding draws other random numbers (it equals plain sampling in
    distribution only). ``--overlap`` draws plain sampling's tokens exactly,
    so it is compared with it. Penalties and logit bias are refused with
    ``--speculative`` or ``--check`` (their steps apply none)."""
    if penalized(trace):
        check = getattr(args, "check", False)
        mode = "--speculative" if args.speculative else "--check" if check else None
        if mode is not None:
            raise UsageError(
                f"{command} {mode} with repetition_penalty, presence_penalty, "
                "frequency_penalty or logit_bias: its steps apply none; expected neutral values"
            )
    if not (args.speculative and samples(trace)):
        return
    if command == "demo" or getattr(args, "check", False):
        raise UsageError(
            f"{command} --speculative{' --check' if command != 'demo' else ''} with sampling "
            "(temperature > 0): it compares with plain decoding token for token, which "
            "sampled speculative decoding equals in distribution only; expected temperature 0"
        )


def prompt_object(line: str, where: str, limit: int) -> dict[str, Any]:
    """A JSON-object prompt line: its ``"prompt"`` (token ids or text) and
    fields, checked (:func:`check_line`; ``limit`` bounds ``max_new_tokens``)."""
    obj = json_line(line, where)
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    if not isinstance(prompt, (list, str)):
        raise UsageError(
            f"{where}: expected a non-empty JSON list of token ids, or an object with a "
            f'"prompt" (token ids or text); got {line[:60]!r}'
        )
    check_line({k: v for k, v in obj.items() if k != "prompt"}, where, limit)
    return dict(obj)


def output_line(
    rid: int, tokens: list[int], logprobs: Mapping[int, list[TokenLogprobs]] | None
) -> dict[str, Any]:
    """``generate``'s JSON line of request ``rid``: ``{"index", "token_ids"}``,
    and ``"logprobs"`` (one ``{"token", "logprob", "top": [[id, logprob],
    ...]}`` per token) when the run collected them."""
    line: dict[str, Any] = {"index": rid, "token_ids": tokens}
    if logprobs:
        line["logprobs"] = [
            {"token": t, "logprob": lp, "top": [list(pair) for pair in top]}
            for t, (lp, top) in zip(tokens, logprobs[rid], strict=True)
        ]
    return line
