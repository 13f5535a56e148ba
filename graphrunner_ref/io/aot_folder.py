"""Where ``generate`` and ``serve`` keep the CPU step's saved program.

``--aot-cache DIR`` names the folder; without it the folder is
``$GRAPHRUNNER_AOT_CACHE`` when set, else ``<cache root>/aot`` (the cache
root of :mod:`~graphrunner_ref.io.gguf_cache`), so a restarted run loads
its program instead of compiling it again, as vLLM keeps its compile cache
(of a sampled step, a server's, the model is saved and the sampler runs
after it: :class:`graphrunner.mechanisms.base.SplitForward`).
``none`` (flag or variable) turns saving off. The key of each program
(:mod:`graphrunner.mechanisms.aot`) tells the models, sizes, dtypes, torch
versions and CPUs apart, so one folder serves them all.
"""

from __future__ import annotations

import os

from graphrunner_ref.io.gguf_cache import cache_root

__all__ = ["AOT_ENV", "AUTO", "NONE", "aot_folder"]

#: The environment variable that names the default folder (or ``none``).
AOT_ENV = "GRAPHRUNNER_AOT_CACHE"
#: The flag's default: the variable's folder, else the per-user one.
AUTO = "auto"
#: No saved program: the step compiles at every start.
NONE = "none"


def aot_folder(flag: str | None) -> str | None:
    """The folder ``--aot-cache flag`` means: None for ``none`` (or no flag,
    the demo's default), the per-user default for ``auto``, else ``flag``."""
    if flag is None:
        return None
    if flag == AUTO:
        flag = os.environ.get(AOT_ENV) or str(cache_root() / "aot")
    if flag.strip() == "":
        raise ValueError(f"--aot-cache: {flag!r} is empty; expected a folder, auto or none")
    return None if flag == NONE else flag
