"""``graphrunner convert --gguf FILE --out DIR``: a GGUF file to the Hugging Face layout."""

from __future__ import annotations

import argparse
from collections import Counter

from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.io.gguf_import import GGUFImportError, convert_gguf, open_gguf
from graphrunner_ref.io.text import has_tokenizer

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Convert ``--gguf`` into ``--out``; say what was written."""
    try:
        types = Counter(t.tensor_type.name for t in open_gguf(args.gguf).tensors)
        out = convert_gguf(args.gguf, args.out)
    except GGUFImportError as e:
        raise UsageError(f"--gguf {args.gguf}: {e}") from None
    kinds = ", ".join(f"{n} {k}" for k, n in types.most_common())
    tokenizer = "with its tokenizer" if has_tokenizer(out) else "no tokenizer (token ids only)"
    print(f"wrote {out}: {sum(types.values())} tensors ({kinds}) as float32, {tokenizer}")
    return 0
