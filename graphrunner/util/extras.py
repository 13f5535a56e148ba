"""Optional dependencies: which extra brings each, and the error when one is missing.

The core install (torch, nvtx, tqdm, safetensors, numpy) runs the library and
the CLI on token ids. Text, GGUF, the Triton kernels and the plots import
their packages only where they are used, inside :func:`needs_extra`, so a
missing one is a :class:`MissingExtraError` that names the extra to install,
never an ``ImportError`` at ``import graphrunner``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["EXTRAS", "MissingExtraError", "needs_extra"]

#: The modules each extra of ``pyproject.toml`` installs.
EXTRAS: dict[str, tuple[str, ...]] = {
    "text": ("transformers", "tokenizers", "jinja2"),
    "gguf": ("gguf", "tokenizers"),
    "cuda": ("triton",),
    "plots": ("matplotlib",),
    "structured": ("xgrammar",),
}


class MissingExtraError(ImportError):
    """A feature needs an optional package that is not installed; the message
    names the feature, the package and the ``pip install`` that brings it."""


@contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Within: a ``ModuleNotFoundError`` for one of ``extra``'s modules becomes
    a :class:`MissingExtraError` naming ``feature`` and
    ``pip install 'graphrunner[extra]'``; any other error passes unchanged."""
    if extra not in EXTRAS:
        raise ValueError(f"needs_extra: extra={extra!r}; expected one of {sorted(EXTRAS)}")
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top not in EXTRAS[extra]:
            raise
        raise MissingExtraError(
            f"{feature} needs the {top!r} package, which is not installed: "
            f"pip install 'graphrunner[{extra}]'"
        ) from e
