"""The shape of a transformers checkpoint, read through transformers' own
config object rather than ``config.json``'s keys.

Architectures spell a field their own way (``n_head``, ``n_embd``,
``n_layer``, ``num_kv_heads`` ...); their config classes map the common
names onto them (``attribute_map``), so ``config.num_attention_heads``
answers for every decoder transformers ships. What the engine's early checks
read of a bridged checkpoint (vocabulary, context, the sizes a memory
estimate counts) comes from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphrunner.util import needs_extra
from graphrunner_ref.model import ModelConfig

__all__ = ["checkpoint_shape"]

#: The context assumed where a config names none.
DEFAULT_POSITIONS = 2048


def _int(config: Any, name: str) -> int | None:
    """``config.name`` when a positive int; None when absent or when reading
    it raises (a per-layer value with no one global value, e.g. Gemma 4's
    ``head_dim``, raises transformers' own error, not AttributeError)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # whatever transformers raises: no single value
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def checkpoint_shape(path: str | Path) -> ModelConfig:
    """The shape of the transformers checkpoint in directory ``path`` (its
    text config for a multimodal one), as :class:`~graphrunner_ref.model.ModelConfig`.

    Raises:
        ValueError: one line naming the file and what is missing or why
            transformers cannot read it.
    """
    with needs_extra("text", "the transformers bridge"):
        from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # whatever transformers raises, one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"{Path(path) / 'config.json'}: transformers cannot read it ({first})"
        ) from None
    text = config.get_text_config()
    need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    sizes = {name: _int(text, name) for name in need}
    missing = [name for name, value in sizes.items() if value is None]
    if missing:
        raise ValueError(
            f"{Path(path) / 'config.json'}: {type(text).__name__} has no positive "
            f"{', '.join(missing)}; the transformers bridge needs a decoder's {', '.join(need)}"
        )
    hidden, heads = int(sizes["hidden_size"] or 0), int(sizes["num_attention_heads"] or 0)
    kv_heads = _int(text, "num_key_value_heads")
    head_dim = _int(text, "head_dim")
    return ModelConfig(
        vocab_size=int(sizes["vocab_size"] or 0),
        hidden_size=hidden,
        intermediate_size=_int(text, "intermediate_size") or 4 * hidden,
        num_layers=int(sizes["num_hidden_layers"] or 0),
        num_heads=heads,
        num_kv_heads=kv_heads if kv_heads and heads % kv_heads == 0 else heads,
        head_dim=head_dim if head_dim and head_dim % 2 == 0 else 0,
        max_position_embeddings=_int(text, "max_position_embeddings") or DEFAULT_POSITIONS,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
