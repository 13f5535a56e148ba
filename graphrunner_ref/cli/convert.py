"""``graphrunner convert --gguf FILE --out DIR``: a GGUF file to the Hugging Face layout."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.cli.groups import add_command
from graphrunner_ref.io.gguf_import import GGUFImportError, convert_gguf, open_gguf
from graphrunner_ref.io.text import has_tokenizer

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    conv = add_command(sub, "convert")
    conv.add_argument("--gguf", type=Path, required=True, help="the .gguf file to read")
    conv.add_argument(
        "--out", type=Path, required=True, help="directory to write (must not exist, or be empty)"
    )
    conv.set_defaults(func=_convert)


def _convert(args: argparse.Namespace) -> int:
    try:
        types = Counter(t.tensor_type.name for t in open_gguf(args.gguf).tensors)
        out = convert_gguf(args.gguf, args.out)
    except GGUFImportError as e:
        raise UsageError(f"--gguf {args.gguf}: {e}") from None
    kinds = ", ".join(f"{n} {k}" for k, n in types.most_common())
    tokenizer = "with its tokenizer" if has_tokenizer(out) else "no tokenizer (token ids only)"
    print(f"wrote {out}: {sum(types.values())} tensors ({kinds}) as float32, {tokenizer}")
    return 0
