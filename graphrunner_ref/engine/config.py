"""The engine's options in one value: :class:`EngineConfig`.

Every option of a serving run lives here (which model, how its steps run
and are captured, how requests are scheduled); the command line maps its
flags into one (:mod:`graphrunner_ref.cli.options`), and the engine path
(:mod:`graphrunner_ref.engine.serving`) and the model kinds
(:mod:`graphrunner_ref.engine.registry`) read nothing else. A request's own
sampling parameters travel with the request
(:class:`~graphrunner.sampling.SamplingParams`), not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphrunner_ref.model.parallel import SINGLE, TensorParallel

__all__ = [
    "DEFAULT_BATCHED_TOKENS",
    "DTYPES",
    "KV_DTYPES",
    "MAX_BATCHED_TOKENS",
    "TOKEN_BATCHES_ENV",
    "EngineConfig",
    "UsageError",
]

#: Tokens one engine step processes by default (chunked prefill), and the most.
DEFAULT_BATCHED_TOKENS = 2048
MAX_BATCHED_TOKENS = 1 << 20

#: Set to 0, prompt chunks run eagerly, one by one, and no token-batch runner
#: is captured (a faster start where prefill speed does not matter: tests).
TOKEN_BATCHES_ENV = "GRAPHRUNNER_TOKEN_BATCHES"


def _token_batches() -> bool:
    return os.environ.get(TOKEN_BATCHES_ENV, "1") != "0"


#: ``dtype`` names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``kv_dtype`` names: a dtype's, or int8 (:class:`graphrunner.pools.Int8KVCache`).
KV_DTYPES = {**DTYPES, "int8": torch.int8}
#: Logit / KV tolerance of ``check`` per dtype: a 16-bit model's graph and
#: eager forwards round differently (fused vs separate ops) by far more than 1e-4;
#: an int8 cache's value one float32 rounding off eager's may take the next
#: integer, 1/254 of its vector's largest value away.
_CHECK_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05, torch.int8: 0.05}


class UsageError(Exception):
    """Options or input files that cannot run, found before any work starts
    (the command line exits 2 with its message)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every option of a serving run.

    Model: ``model`` names an embedded random model (None with a
    ``checkpoint`` directory; ``source`` is how the user named that
    checkpoint, for messages; ``gguf_file`` the GGUF file it was converted
    from, if any); ``model_impl`` picks the implementation (``auto``,
    ``native``, ``transformers``); ``dtype``, ``kv_dtype`` (the KV cache's;
    None: ``dtype``), ``quantize`` (a
    :data:`~graphrunner_ref.model.quantize.QUANTIZATIONS` mode; with an
    int4 mode, ``prefill_bf16`` multiplies prompt chunks in bfloat16:
    :mod:`~graphrunner_ref.model.prompt_bf16`) and
    ``attention`` (a decode attention name or ``auto``) shape the loaded model;
    ``max_context_len`` caps the context (None: the model's); ``seed`` seeds
    the embedded weights, random draft heads and the run's sampling.

    Runner: ``runner`` (``cuda``, ``cpu``, ``eager``) on ``device``,
    ``compile`` (the CUDA runner's inductor programs), ``capture_sizes`` (empty:
    the library's policy), ``page_size`` KV slots a page, ``tp`` ranks and this
    process's ``placement`` among them, ``threads`` torch CPU threads (None:
    torch's own),
    ``check_padding`` (the sanitizer around every replay) and ``check`` (each
    step also run eagerly and compared).

    Scheduling: ``speculative`` (``eagle``, ``mtp`` or None) with ``draft``
    and ``draft_tokens``; ``overlap``; ``steps_per_launch``; ``chunked_prefill``
    with ``max_num_batched_tokens`` (the tokens one step processes, decode
    rows first, then prompt chunks; None: :data:`DEFAULT_BATCHED_TOKENS` where
    the model's prefill extends a cached prefix, each prompt whole elsewhere),
    each step's chunks one captured token batch where the model runs them
    (``token_batches``, default on unless :data:`TOKEN_BATCHES_ENV` is 0; at
    ``token_capture_sizes`` token counts, empty: the library's sizes up to
    the budget), else each chunk eagerly;
    ``prefix_caching`` (a prompt's full pages already cached are shared, not
    computed; on where the model keeps KV pages, off for Mamba / hybrid
    models and the speculative engine);
    ``logprobs`` (the top N of each token); ``max_steps`` bounds a run's
    decode steps.
    ``quiet`` keeps notes off stderr.
    """

    model: str | None = "embedded"
    checkpoint: Path | None = None
    source: str = ""
    gguf_file: Path | None = None
    model_impl: str = "auto"
    dtype: str = "float32"
    kv_dtype: str | None = None
    quantize: str | None = None
    prefill_bf16: bool = False
    attention: str = "auto"
    max_context_len: int | None = None
    seed: int = 0
    runner: str = "cpu"
    device: str = "cpu"
    compile: bool = False
    capture_sizes: tuple[int, ...] = ()
    page_size: int = 1
    tp: int | None = None
    placement: TensorParallel = field(default=SINGLE)
    threads: int | None = None
    check_padding: bool = False
    check: bool = False
    speculative: str | None = None
    draft: str = "random"
    draft_tokens: int = 2
    overlap: bool = False
    steps_per_launch: int = 1
    chunked_prefill: bool = True
    prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    token_batches: bool = field(default_factory=_token_batches)
    token_capture_sizes: tuple[int, ...] = ()
    logprobs: int = 0
    max_steps: int | None = None
    quiet: bool = False
    #: The CPU decode and token-batch runners' saved programs' folder
    #: (``--aot-cache``; None: none); speculative runners compile as without.
    aot_cache: str | None = None

    def __post_init__(self) -> None:
        # Ranges are the command line's to check, by flag, before any work.
        for name, value, names in (
            ("dtype", self.dtype, DTYPES),
            ("kv_dtype", self.kv_dtype, KV_DTYPES),
        ):
            if value is not None and value not in names:
                raise ValueError(f"{name}={value!r}; expected one of {list(names)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype | None:
        """The KV cache's dtype (None: the model's)."""
        return None if self.kv_dtype is None else KV_DTYPES[self.kv_dtype]

    @property
    def atol(self) -> float:
        """The tolerance of ``check`` for this dtype, or for the KV cache's
        where it is coarser: a graph's key one float32 rounding off eager's
        can round to the neighbouring float16, a whole float16 step apart in
        the cache and beyond float32's tolerance in the logits."""
        dtypes = (self.torch_dtype, self.torch_kv_dtype or self.torch_dtype)
        return max(_CHECK_ATOL[d] for d in dtypes)

    @property
    def mechanism_options(self) -> dict[str, Any]:
        """The runner mechanism's options (passed only when asked for, so a
        plain run makes the call every engine accepts)."""
        return {"compile": True} if self.compile else {}

    @property
    def extra_context(self) -> int:
        """Context a speculative round needs beyond a request's own tokens (0 without)."""
        return self.draft_tokens + 1 if self.speculative else 0

    @property
    def sharded(self) -> bool:
        """Whether the model runs on more than one tensor-parallel rank."""
        return (self.tp or 1) > 1
