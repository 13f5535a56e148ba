"""Per-request sampling parameters: the user-facing value and the declared
buffers that carry it into a captured step.

:class:`SamplingParams` is validated where it is made. :data:`SAMPLING_FIELDS`
declares one ``[bs]`` buffer per parameter with a pad rule under which a
padded row samples finite numbers (temperature 1, top-k 1, top-p 1, min-p 0,
seed 0: a plain one-token draw whose token the runner discards).
:func:`sampling_tensors` builds the live rows of those buffers for a batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from graphrunner.declare.buffers import BufferSpec, PadRule

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_SEED",
    "SAMPLING_FIELDS",
    "SAMPLING_FIELD_NAMES",
    "SamplingParams",
    "check_logit_bias",
    "check_seed",
    "request_seed",
    "sampling_tensors",
]

#: The most (token, bias) pairs one request's ``logit_bias`` holds (OpenAI
#: allows 300; the step carries this many columns per row).
MAX_LOGIT_BIAS = 64
#: The range of each ``logit_bias`` value (OpenAI's and vLLM's).
MAX_BIAS = 100.0
#: The range of ``presence_penalty`` and ``frequency_penalty`` (vLLM's).
MAX_PENALTY = 2.0

#: Seeds are ints in ``[0, MAX_SEED)``: they fit an int64 buffer unsigned-alike.
MAX_SEED = 2**63


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_seed(name: str, value: object) -> int:
    """``value`` as a sampling seed (an int in ``[0, 2**63)``), or a
    ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SEED:
        raise ValueError(f"{name}={value!r}; expected an int in [0, 2**63)")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens.

    Args:
        temperature: logits are divided by it; 0 is greedy (exactly
            ``argmax``, bit for bit). Finite, >= 0.
        top_k: keep the ``top_k`` most probable tokens (ties with the k-th
            kept too); 0 means no limit. An int >= 0.
        top_p: then keep the smallest set of most probable tokens whose
            probability reaches ``top_p`` (at least one). In (0, 1].
        min_p: then drop tokens below ``min_p`` times the most probable
            one's probability. In [0, 1].
        seed: the request's seed, an int in [0, 2**63); None lets the engine
            derive one (from the run seed and the request id).
        repetition_penalty: vLLM's: over the tokens of the prompt and the
            output so far, a positive logit is divided by it and a negative
            one multiplied. Finite, > 0; 1 is none.
        presence_penalty: OpenAI's: subtracted from the logit of each token
            the output holds. In [-2, 2]; 0 is none.
        frequency_penalty: OpenAI's: times a token's count in the output,
            subtracted from its logit. In [-2, 2]; 0 is none.
        logit_bias: OpenAI's: ``{token id: bias}`` added to the logits
            (before the penalties), at most :data:`MAX_LOGIT_BIAS` pairs,
            each bias in [-100, 100]; kept as ``((token, bias), ...)`` sorted
            by token. Token ids are checked against a vocabulary by
            :meth:`check_vocab` (the engine's).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r}; expected a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}; expected an int >= 0 (0: no limit)")
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r}; expected a number in (0, 1]")
        m = self.min_p
        if not _is_real(m) or not 0 <= m <= 1:
            raise ValueError(f"min_p={m!r}; expected a number in [0, 1]")
        if self.seed is not None:
            check_seed("seed", self.seed)
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty={r!r}; expected a finite number > 0 (1: none)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(v := getattr(self, name)) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name}={v!r}; expected a number in [-2, 2] (0: none)")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0)."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """True when a penalty or a logit bias changes the logits."""
        neutral = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) == (
            1,
            0,
            0,
        )
        return not neutral or bool(self.logit_bias)

    def check_vocab(self, vocab: int) -> None:
        """A ValueError naming ``logit_bias`` when a token id is not in ``[0, vocab)``."""
        bad = [t for t, _ in dict(self.logit_bias).items() if t >= vocab]
        if bad:
            raise ValueError(
                f"logit_bias: token ids {bad} are not in the vocabulary; expected ids in "
                f"[0, {vocab})"
            )


def check_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping or (token, bias) pairs) checked: pairs
    sorted by token, or a ValueError naming ``logit_bias``."""
    try:
        pairs = dict(bias)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias={bias!r}; expected a mapping of token id to bias") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: {len(pairs)} entries; expected at most {MAX_LOGIT_BIAS}")
    for t, v in pairs.items():
        if not _is_int(t) or t < 0 or not _is_real(v) or not -MAX_BIAS <= v <= MAX_BIAS:
            raise ValueError(
                f"logit_bias: {t!r}: {v!r}; expected token ids >= 0 and biases in [-100, 100]"
            )
    return tuple(sorted((t, float(v)) for t, v in pairs.items()))


#: The per-request sampling buffers (each ``[bs]``), with the pad rules of the
#: design table: a padded row computes finite values and its token is discarded.
SAMPLING_FIELDS: tuple[BufferSpec, ...] = (
    BufferSpec("temperature", torch.float32, PadRule.FILL, fill_value=1.0),
    BufferSpec("top_k", torch.int64, PadRule.FILL, fill_value=1),
    BufferSpec("top_p", torch.float32, PadRule.FILL, fill_value=1.0),
    BufferSpec("min_p", torch.float32, PadRule.ZERO),
    BufferSpec("sampling_seed", torch.int64, PadRule.ZERO),
)
SAMPLING_FIELD_NAMES: tuple[str, ...] = tuple(s.name for s in SAMPLING_FIELDS)


def sampling_tensors(
    params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The live rows of :data:`SAMPLING_FIELDS` for a batch of ``n`` requests.

    ``seeds[i]`` is request ``i``'s resolved seed (its own ``params[i].seed``
    or one the engine derived); it is what the random stream reads.

    Returns: name -> tensor ``[n]`` on ``device``: ``temperature``, ``top_p``,
    ``min_p`` float32; ``top_k``, ``sampling_seed`` int64.
    """
    if len(params) != len(seeds):
        raise ValueError(
            f"sampling_tensors: {len(params)} params but {len(seeds)} seeds; expected one each"
        )
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}]={p!r}; expected a SamplingParams")
    checked = [check_seed(f"seeds[{i}]", s) for i, s in enumerate(seeds)]
    columns: dict[str, list[float] | list[int]] = {
        "temperature": [p.temperature for p in params],
        "top_k": [p.top_k for p in params],
        "top_p": [p.top_p for p in params],
        "min_p": [p.min_p for p in params],
        "sampling_seed": checked,
    }
    return {
        s.name: torch.tensor(columns[s.name], dtype=s.dtype, device=device) for s in SAMPLING_FIELDS
    }


def request_seed(run_seed: int, rid: int) -> int:
    """The seed of request ``rid`` in a run seeded ``run_seed`` (when the
    request gives none): a SplitMix64 mix of the two, in ``[0, 2**63)``, so
    it depends on nothing but the run seed and the request id."""
    check_seed("run_seed", run_seed)
    mask = (1 << 64) - 1
    x = (run_seed * 0x9E3779B97F4A7C15 + (rid & mask) + 0x632BE59BD9B4E019) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 1
