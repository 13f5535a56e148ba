"""A checkpoint's chat template rendered in a bounded sandbox.

The template is the checkpoint's own code: transformers renders it in jinja's
immutable sandbox, which refuses unsafe attributes but bounds neither time nor
size, so ``{{ 'a' * 10**10 }}`` exhausts memory and nested ``range`` loops
never end. Here the same template runs in the same kind of sandbox, with the
helpers transformers documents for chat templates (``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, ``dict``, a
``namespace`` that refuses underscore names, ``loopcontrols`` and the
``{% generation %}`` tag), plus bounds:

* a string, list or tuple made by ``*`` or ``+`` holds at most
  :data:`MAX_CHARS` items, and ``**`` takes exponents up to 64;
* ``range`` yields at most :data:`MAX_LOOP_STEPS` items over the whole render;
* the output holds at most :data:`MAX_CHARS` characters;
* the render ends after :data:`MAX_SECONDS` (a timer, on the main thread).

Anything the template does wrong (a sandbox violation, a template error,
``raise_exception``, a bound exceeded) is one :class:`ChatTemplateError`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

__all__ = ["MAX_CHARS", "MAX_LOOP_STEPS", "MAX_SECONDS", "ChatTemplateError", "render_chat"]

MAX_CHARS = 1 << 20
MAX_LOOP_STEPS = 1_000_000
MAX_SECONDS = 5.0
_MAX_EXPONENT = 64


class ChatTemplateError(ValueError):
    """The chat template failed or went past a bound; the message says which."""


class _Budget:
    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_LOOP_STEPS:
            raise ChatTemplateError(f"range loops ran past {MAX_LOOP_STEPS:,} steps")
        if self.steps % 4096 == 0 and time.monotonic() > self.deadline:
            raise ChatTemplateError(f"rendering took longer than {MAX_SECONDS} s")


def _size(x: object) -> int | None:
    return len(x) if isinstance(x, str | list | tuple) else None


def _too_big(items: int) -> str:
    return f"a value of {items:,} items (at most {MAX_CHARS:,})"


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with ``*``, ``+`` and ``**`` bounded."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
            raise ChatTemplateError(f"an exponent of {right} (at most {_MAX_EXPONENT})")
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                n = _size(seq)
                if n is not None and isinstance(times, int) and n * times > MAX_CHARS:
                    raise ChatTemplateError(
                        f"a value of {n * times:,} items (at most {MAX_CHARS:,})"
                    )
        if op == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > MAX_CHARS:
                raise ChatTemplateError(_too_big(a + b))
        return super().call_binop(context, op, left, right)


def _bounded_range(budget: _Budget, env: ImmutableSandboxedEnvironment) -> Any:
    plain: Any = env.globals["range"]

    def bounded(*args: int) -> Iterator[int]:
        for i in plain(*args):  # the sandbox's own range: one range under 100,000 items
            budget.step()
            yield i

    return bounded


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise ChatTemplateError after ``seconds`` on the main thread (a loop the
    other bounds cannot see, e.g. over a long string's characters)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise ChatTemplateError(f"rendering took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text
    for training masks; rendering a prompt keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(Namespace):
    """jinja's ``namespace`` without underscore names: no path to an object's
    internals through an attribute the template sets."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature: self may be a key
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing
    them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not jinja's own tojson, which escapes HTML characters a prompt must keep.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment(budget: _Budget) -> _BoundedSandbox:
    # Never compile a template in another environment: jinja folds constants
    # at compile time, and only our sandbox keeps `*` from folding.
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
        range=_bounded_range(budget, env),
    )
    return env


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    tokens: Mapping[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """``template`` rendered for ``messages`` with the generation prompt, as
    transformers' ``apply_chat_template(tokenize=False)`` renders it;
    ``tokens`` are the tokenizer's special tokens (``bos_token``, ...);
    ``tools`` the request's function tools (None: none).

    Raises:
        ChatTemplateError: the template is invalid, raised, broke the sandbox,
            or went past a bound (see the module docstring).
    """
    budget = _Budget()
    try:
        with _deadline(MAX_SECONDS):
            env = _environment(budget)
            parts, total = [], 0
            compiled = env.from_string(template)
            kwargs = {**tokens, "tools": tools, "documents": None}
            for part in compiled.generate(messages=messages, add_generation_prompt=True, **kwargs):
                total += len(part)
                if total > MAX_CHARS:
                    raise ChatTemplateError(f"output past {MAX_CHARS:,} characters")
                parts.append(part)
            return "".join(parts)
    except ChatTemplateError:
        raise
    except (TemplateError, MemoryError, RecursionError, TypeError, ValueError) as e:
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from None
