"""A checkpoint's chat template rendered in a bounded sandbox.

The template is the checkpoint's own code: transformers renders it in jinja's
immutable sandbox, which refuses unsafe attributes but bounds neither time nor
size, so ``{{ 'a' * 10**10 }}`` exhausts memory and nested ``range`` loops
never end. Here the same template runs in the same kind of sandbox, with the
same filters, globals and extensions as transformers gives it, plus bounds:

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
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


def _environment(budget: _Budget) -> _BoundedSandbox:
    # The filters, globals and extensions transformers gives a chat template,
    # read off the environment it compiles an empty template in, so the two
    # render alike. Never compile the checkpoint's template there: jinja folds
    # constants at compile time, and only our sandbox keeps `*` from folding.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    theirs = _compile_jinja_template("").environment
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[type(e) for e in theirs.extensions.values()],
    )
    env.filters.update(theirs.filters)
    env.globals.update({k: v for k, v in theirs.globals.items() if k != "range"})
    env.globals["range"] = _bounded_range(budget, env)
    return env


def render_chat(template: str, messages: list[dict[str, str]], tokens: Mapping[str, Any]) -> str:
    """``template`` rendered for ``messages`` with the generation prompt, as
    transformers' ``apply_chat_template(tokenize=False)`` renders it;
    ``tokens`` are the tokenizer's special tokens (``bos_token``, ...).

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
            kwargs = {**tokens, "tools": None, "documents": None}
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
