"""The tokenizer files of a GGUF's tokenizer metadata, built with ``tokenizers``.

GGUF stores a byte-level BPE tokenizer (``tokenizer.ggml.model`` ``gpt2``) as
its vocabulary in id order (tokens already in the byte-to-unicode alphabet),
its merges as ``"a b"`` strings, a type per token (3: control, 4: user
defined: both special) and the ids of its special tokens; the pre-tokenizer
is named by ``tokenizer.ggml.pre``. From these we build the ``tokenizer.json``
that ``tokenizers`` (and so transformers' ``AutoTokenizer``) loads, plus a
``tokenizer_config.json`` carrying the chat template and the special tokens.

Other tokenizer models (SentencePiece ``llama``, ...) are not built: the
weights convert without a tokenizer, and text prompts are then refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graphrunner.util import MissingExtraError, needs_extra
from graphrunner_ref.io.gguf_meta import GGUFImportError, field

__all__ = ["BYTE_LEVEL_PRE_TOKENIZERS", "write_tokenizer"]

#: ``tokenizer.ggml.pre`` values whose pre-tokenization is GPT-2's byte-level
#: split, ``smollm``'s with every digit split off first.
BYTE_LEVEL_PRE_TOKENIZERS = ("default", "gpt2", "smollm")

_SPECIAL_TYPES = (3, 4)  # gguf.TokenType.CONTROL, USER_DEFINED


def write_tokenizer(reader: Any, out: Path, *, context: int, vocab_size: int | None = None) -> bool:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out`` from
    ``reader``'s metadata. Returns False (writing nothing) when the GGUF holds
    no tokenizer or one of a kind not built here. :class:`GGUFImportError`
    when it cannot be built, or holds more tokens than ``vocab_size``."""
    model = field(reader, "tokenizer.ggml.model")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in BYTE_LEVEL_PRE_TOKENIZERS:
        return False
    tokens: list[str] = list(field(reader, "tokenizer.ggml.tokens", []))
    merges: list[str] = list(field(reader, "tokenizer.ggml.merges", []))
    types: list[int] = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if not tokens or len(types) != len(tokens):
        raise GGUFImportError(
            f"GGUF tokenizer: {len(tokens)} tokens and {len(types)} token types; "
            "expected as many of each, at least one"
        )

    def token_of(key: str) -> str | None:
        index = field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if index is None or not 0 <= index < len(tokens) else tokens[int(index)]

    if vocab_size is not None and len(tokens) > vocab_size:
        raise GGUFImportError(
            f"GGUF tokenizer: {len(tokens)} tokens, more than the model's vocabulary of "
            f"{vocab_size}: ids past {vocab_size - 1} would have no embedding"
        )
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
    try:
        tokenizer = _build(tokens, merges, types, pre=pre, bos=token_of("bos") if add_bos else None)
    except MissingExtraError:
        raise
    except Exception as e:  # tokenizers raises its own Exception for bad merges or vocab
        raise GGUFImportError(f"GGUF tokenizer cannot be built: {e}") from None
    tokenizer.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    for name in ("bos", "eos", "unk", "pad"):
        token = token_of("padding" if name == "pad" else "unknown" if name == "unk" else name)
        if token is not None:
            config[f"{name}_token"] = token
    template = field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return True


def _build(
    tokens: list[str], merges: list[str], types: list[int], *, pre: str, bos: str | None
) -> Any:
    with needs_extra("gguf", "the GGUF tokenizer"):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    tokenizer = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm"
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    if bos is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tokens.index(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in _SPECIAL_TYPES]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer
