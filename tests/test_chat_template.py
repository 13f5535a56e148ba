"""Hostile chat templates end in one ChatTemplateError, quickly and in bounded
memory; a well-behaved template renders exactly as transformers renders it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gguf_world import tiny_text_checkpoint
from graphrunner_ref.io.chat_template import ChatTemplateError, render_chat
from graphrunner_ref.io.text import NoTokenizerError, TextCodec

USER = [{"role": "user", "content": "hi"}]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("chat") / "hf"
    tiny_text_checkpoint(path)
    return AutoTokenizer.from_pretrained(path)


def test_the_checkpoints_template_renders_as_transformers_renders_it(tokenizer: Any) -> None:
    theirs = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    ours = render_chat(tokenizer.chat_template, USER, tokenizer.special_tokens_map)
    assert ours == theirs and "hi" in ours


#: Every helper transformers gives a chat template, in one template.
HELPERS_TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if loop.index > 1 %}{% break %}{% endif %}"
    "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
    "{{ dict(a=1, b='é') | tojson(indent=1) }}{{ dict.fromkeys(['k']) | tojson }}"
    "{% endfor %}{{ ns.n }} {{ strftime_now('%Y') }}{{ bos_token }}"
    "{% if add_generation_prompt %}<go>{% endif %}"
)


def test_each_template_helper_renders_as_transformers_renders_it(tokenizer: Any) -> None:
    """raise_exception aside (below), each of transformers' helpers:
    namespace, loopcontrols, the generation tag, tojson keeping non-ASCII and
    HTML characters, dict, strftime_now."""
    chat = [{"role": "user", "content": "héllo <b>&"}, {"role": "assistant", "content": "x"}]
    theirs = tokenizer.apply_chat_template(
        chat, chat_template=HELPERS_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    ours = render_chat(HELPERS_TEMPLATE, chat, tokenizer.special_tokens_map)
    assert ours == theirs and '"héllo <b>&"' in ours and ours.endswith("<go>")


#: Templates that must end in one ChatTemplateError: (template, what it names).
HOSTILE_TEMPLATES = [
    # 10**8, not the 10**10 of the report: were the bound gone, 100 MB is
    # what a failing run allocates.
    ("{{ 'a' * 10**8 }}", "at most"),
    ("{{ 10**8 * 'a' }}", "at most"),
    ("{% set s = 'a' * 1000000 %}{{ s + s }}", "at most"),
    ("{{ 2 ** 100000000 }}", "exponent"),
    (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "range loops ran past",
    ),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output past"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages.append(1) }}", "SecurityError"),
    ("{% for %}", "TemplateSyntaxError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% set ns = namespace(_x=1) %}", "may not start with '_'"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "may not start with '_'"),
]


@pytest.mark.parametrize("template, message", HOSTILE_TEMPLATES)
def test_a_hostile_template_is_one_error_naming_what_went_wrong(
    template: str, message: str
) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(template, USER, TOKENS)
    assert time.monotonic() - start < 30  # bounded: the loops above would run for hours


#: A loop that only the timer stops (5 s).
TIMED_TEMPLATE = (
    "{% set s = 'ab' * 300000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
)


def test_a_loop_no_other_bound_sees_ends_on_the_timer() -> None:
    with pytest.raises(ChatTemplateError, match="longer than"):
        render_chat(TIMED_TEMPLATE, USER, TOKENS)


def test_the_codec_reports_a_bad_template_as_a_tokenizer_error(tokenizer: Any) -> None:
    tokenizer.chat_template = "{{ 'a' * 10**8 }}"
    with pytest.raises(NoTokenizerError, match="--chat: the checkpoint's chat template: a value"):
        TextCodec(tokenizer).chat("hi")


def test_bounds_leave_room_for_real_templates(tokenizer: Any, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] * 1000 }}{% endfor %}"
    assert render_chat(template, USER, TOKENS) == "hi" * 1000
