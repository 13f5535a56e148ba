"""vLLM's utility routes, as load generators and clients call them:
``POST /tokenize`` (a text, or chat messages through the checkpoint's
template: their token ids, their count and the server's context) and ``POST
/detokenize`` (token ids back to text). Bodies are strict as the completion
bodies are: an unknown field is refused by name, and so is a field vLLM
takes but graphrunner does not serve (``add_generation_prompt`` false)."""

from __future__ import annotations

from typing import Any

from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.protocol import Body, ChatMessage, Limits, chat_prompt

__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenize", "tokenize"]


class TokenizeRequest(Body):
    """``POST /tokenize``: ``prompt`` (a text) or ``messages`` (a
    conversation, rendered with the generation prompt), one of the two."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    """``POST /detokenize``: ``tokens``, ids of the served vocabulary."""

    model: str | None = None
    tokens: list[int]


def _codec(limits: Limits, field: str) -> TextCodec:
    if limits.codec is None:
        raise APIError(
            400,
            f"{field}: the served model has no tokenizer; expected a checkpoint with one "
            "(tokenizer.json)",
            param=field,
        )
    return limits.codec


def tokenize(body: TokenizeRequest, limits: Limits) -> dict[str, Any]:
    """The answer to ``POST /tokenize``: ``count``, ``max_model_len``,
    ``tokens`` and ``token_strs`` (None unless ``return_token_strs``)."""
    if (body.prompt is None) == (body.messages is None):
        given = "both" if body.prompt is not None else "neither"
        raise APIError(400, f"prompt and messages: {given} given; expected one", param="prompt")
    if body.messages is not None:
        if not body.add_generation_prompt:
            raise APIError(
                400,
                "add_generation_prompt=False: not supported: a conversation is rendered with "
                "the generation prompt; expected true",
                param="add_generation_prompt",
                code="unsupported",
            )
        codec = _codec(limits, "messages")
        ids = chat_prompt(body.messages, limits)
    else:
        codec = _codec(limits, "prompt")
        ids = codec.encode(str(body.prompt), special_tokens=body.add_special_tokens)
    strs = codec.token_strings(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": limits.context, "tokens": ids, "token_strs": strs}


def detokenize(body: DetokenizeRequest, limits: Limits) -> dict[str, Any]:
    """The answer to ``POST /detokenize``: ``prompt``, the text of the ids,
    special tokens kept (the inverse of ``/tokenize``)."""
    bad = [t for t in body.tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise APIError(
            400,
            f"tokens: token id {bad[0]}; expected ids in 0..{limits.vocab_size - 1}",
            param="tokens",
        )
    codec = _codec(limits, "tokens")
    return {"prompt": codec.decode(body.tokens, skip_special_tokens=False)}
