"""vLLM's special-token fields over a stand-in tokenizer whose special
tokens show: the utility routes (:mod:`graphrunner_ref.serve.tokenize`):
``add_special_tokens`` reaches the tokenizer, ``/detokenize`` keeps what
``/tokenize`` added; and an answer's text (``TextStream``) with
``skip_special_tokens`` and ``include_stop_str_in_output``."""

from __future__ import annotations

from typing import Any

import pytest

from graphrunner.sampling import SamplingParams
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.app import TextStream
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.protocol import Limits
from graphrunner_ref.serve.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

BOS = 1


class _Tokenizer:
    """Characters a..z as ids 2..27, BOS 1 in front when asked."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [ord(c) - 95 for c in text]
        return {"input_ids": ([BOS] if add_special_tokens else []) + ids}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["<s>" if i == BOS else chr(i + 95) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(
            "" if i == BOS and skip_special_tokens else self.convert_ids_to_tokens([i])[0]
            for i in ids
        )


class _Codec(TextCodec):
    def __init__(self) -> None:
        self.tokenizer: Any = _Tokenizer()


LIMITS = Limits(
    context=64, vocab_size=32, max_logprobs=0, sampling=SamplingParams(), codec=_Codec()
)


def test_special_tokens_are_added_unless_asked_not_to() -> None:
    body = TokenizeRequest(prompt="abc", return_token_strs=True)
    assert tokenize(body, LIMITS) == {
        "count": 4,
        "max_model_len": 64,
        "tokens": [BOS, 2, 3, 4],
        "token_strs": ["<s>", "a", "b", "c"],
    }
    plain = tokenize(TokenizeRequest(prompt="abc", add_special_tokens=False), LIMITS)
    assert plain["tokens"] == [2, 3, 4] and plain["token_strs"] is None


def test_detokenize_keeps_the_special_tokens_tokenize_added() -> None:
    assert detokenize(DetokenizeRequest(tokens=[BOS, 2, 3]), LIMITS) == {"prompt": "<s>ab"}


def test_messages_without_a_chat_template_are_a_400_naming_messages() -> None:
    body = TokenizeRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(APIError, match="messages: .*no chat template"):
        tokenize(body, LIMITS)


def test_an_answer_keeps_its_special_tokens_when_asked() -> None:
    for skip, expected in ((True, "ab"), (False, "<s>ab")):
        stream = TextStream(_Codec(), [], skip_special=skip)
        assert stream.add([BOS, 2, 3], last=True) == expected and stream.text() == expected


def test_an_answer_ends_before_or_after_its_stop_string() -> None:
    for include, expected in ((False, "ab"), (True, "abc")):
        stream = TextStream(_Codec(), ["c"], include_stop=include)
        streamed = stream.add([2, 3]) + stream.add([4, 5], last=True)
        assert streamed == expected == stream.text()
