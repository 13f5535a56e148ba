"""How the commands present themselves: a one-line summary, a description
and examples per command, plain text throughout (their options are
:mod:`graphrunner_ref.cli.options`')."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

__all__ = ["COMMANDS", "add_command"]

#: Each command's one-line summary, description and examples (shown by its --help).
COMMANDS: dict[str, tuple[str, str, list[str]]] = {
    "demo": (
        "serve a synthetic trace on a captured runner, every step checked against eager",
        "Serves a seeded synthetic trace of requests with continuous batching, every "
        "decode step replayed (padded) from a captured graph and compared with the eager "
        "forward. Exits 1 on any mismatch or, with --check-padding, any padding violation.",
        [
            "graphrunner demo",
            "graphrunner demo --runner eager --steps 50 --temperature 0.8 --seed 3",
            "graphrunner demo --speculative eagle --draft self --draft-tokens 4",
        ],
    ),
    "generate": (
        "answer text or token-id prompts with a checkpoint or an embedded model",
        "Answers prompts (--prompt, or --prompts FILE / - for stdin) with continuous "
        "batching on a captured runner: text through the checkpoint's tokenizer (and chat "
        "template with --chat), or token ids. Greedy by default; --temperature and the "
        "other sampling options sample inside the captured step.",
        [
            "graphrunner generate --model smollm2/ --chat --prompt 'Name a colour.'",
            "graphrunner generate --prompts prompts.jsonl --temperature 0.8 --top-p 0.95 --seed 7",
            "graphrunner generate --model model.gguf --prompts - --json < questions.txt",
            "graphrunner generate --model smollm2/ --tp 2 --prompts questions.txt",
        ],
    ),
    "serve": (
        "serve a model over HTTP with OpenAI's completions and chat API",
        "Serves the model over HTTP in OpenAI's shapes (/v1/models, /v1/completions, "
        "/v1/chat/completions, streamed or not, /health, /metrics) with continuous batching "
        "on a captured runner: one thread steps the engine, the HTTP side only validates, "
        "queues and streams. SIGTERM or Ctrl-C finishes the requests in flight and exits 0.",
        [
            "graphrunner serve",
            "graphrunner serve smollm2/ --port 8080 --api-key secret",
            "graphrunner serve model.gguf --quantize int4 --max-bs 8 --max-waiting 64",
        ],
    ),
    "sizes": (
        "choose the capture sizes that minimise padding for a served trace",
        "Reads the batch sizes a run served (demo --batch-sizes-out) and picks at most "
        "--graphs capture sizes minimising the padded rows; --plot draws the result.",
        ["graphrunner sizes --trace sizes.json --graphs 4 --output list.txt --plot sizes.png"],
    ),
    "convert": (
        "write a Llama GGUF file as a Hugging Face checkpoint directory",
        "Dequantizes a Llama GGUF file into a Hugging Face checkpoint (config.json, "
        "float32 safetensors, tokenizer files) that --model takes.",
        ["graphrunner convert --gguf model.gguf --out model/"],
    ),
}


def add_command(sub: Any, name: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` on ``sub`` with its summary, description and examples."""
    summary, description, examples = COMMANDS[name]
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=textwrap.fill(description, 78),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser
