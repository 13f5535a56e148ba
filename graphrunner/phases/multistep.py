"""Several decode steps in one captured step: the host leaves the per-token loop.

:func:`multistep_phase` unrolls ``N`` consecutive decode steps of a model's decode forward into one
step (one graph per batch size). Between steps, everything happens on the device: each row's token
is picked (greedy ``argmax``, or :func:`~graphrunner.sampling.sample` at ``positions + 1`` exactly
as :mod:`graphrunner.phases.sampled` does, so the tokens equal ``N`` single steps bit for bit), fed
to the row's next step, ``positions`` and ``seq_lens`` advance by one, and the row takes its next
reserved KV slot.

Inputs per request: the first step's decode fields (``input_ids``, ``positions``, ``seq_lens``,
``req_pool_indices``, int64 ``[bs]``), ``out_cache_loc`` int64 ``[bs * N]`` (the ``N`` slots the
engine reserved for the launch, already recorded in ``req_to_token``; 0 for a step the row will not
take), ``steps_left`` int64 ``[bs]`` (how many of the ``N`` steps the row may take: its budget;
padded rows 0) and, with ``sampling=True``, the sampling rows
(:data:`~graphrunner.sampling.SAMPLING_FIELDS`).

A row stops at the first step that emits ``end_token`` (the token is kept) or when it has taken
``steps_left`` steps; from the next step on it is exactly a padded row: ``req_pool_indices`` 0,
``seq_lens`` the backend's fill value, ``positions`` 0, ``out_cache_loc`` 0, its tokens -1. So no
KV slot outside a live row's reserved slots changes (the padding sanitizer checks the launch).

Outputs: ``tokens`` int64 ``[bs, N]`` (-1 where the row took no step), ``count`` int64 ``[bs]``
(its valid tokens, a prefix of the row) and ``logits`` float32 ``[bs, vocab]`` of each row's last
step taken. With ``logprobs=n`` (n >= 1) also each step's chosen-token log-probability ``logprob``
float32 ``[bs, N]`` and its top ``n`` ``top_logprobs`` / ``top_ids`` ``[bs, N, n]``
(:func:`~graphrunner.sampling.logprobs` of the step's logits and token, as
:func:`~graphrunner.phases.sampled.sampled_forward` computes them; a step the row did not take
holds a padding row's values).

With overlap scheduling (a future map), ``input_ids`` may hold future references and the launch
stores each row's last valid token (``tokens[row, count - 1]``) in the map at its request-pool row,
on the device: the next launch, prepared before this one's read back, reads it.

With ``penalties`` (a :class:`~graphrunner.sampling.TokenCounts`) each step's pick is penalized and
counts its token before the next step reads the counts (a stopped row, at row 0, counts nothing):
``N`` single steps' tokens.

The backend must compute its decode metadata from the step's device tensors
(``metadata_on_device``): a backend that plans on the host per step would see only the first step's
plan, so it is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.declare.buffers import BufferSpec, Index, PadRule
from graphrunner.declare.decode import OUT_CACHE_LOC, decode_buffer_specs
from graphrunner.declare.hooks import GraphBackend, NullBackend
from graphrunner.declare.outputs import OutputSpec
from graphrunner.mechanisms.base import ForwardFn
from graphrunner.phases.base import Phase
from graphrunner.phases.sampled import pick
from graphrunner.sampling import SAMPLING_FIELDS, logprobs

if TYPE_CHECKING:
    from graphrunner.sampling.penalties import TokenCounts

__all__ = [
    "MAX_STEPS_PER_LAUNCH",
    "MULTISTEP_LOGPROB_OUTPUTS",
    "MULTISTEP_OUTPUTS",
    "STEPS_LEFT",
    "check_device_metadata",
    "check_steps_per_launch",
    "compiled_once",
    "multistep_buffer_specs",
    "multistep_forward",
    "multistep_phase",
]

#: The most decode steps one launch unrolls.
MAX_STEPS_PER_LAUNCH = 8
#: The buffer of each row's step budget for the launch.
STEPS_LEFT = "steps_left"
#: The outputs of a multi-step decode: one row per request each.
MULTISTEP_OUTPUTS: Mapping[str, OutputSpec] = {
    "tokens": OutputSpec(),
    "count": OutputSpec(),
    "logits": OutputSpec(),
}
#: :data:`MULTISTEP_OUTPUTS` with each step's log-probabilities (``logprobs=n``).
MULTISTEP_LOGPROB_OUTPUTS: Mapping[str, OutputSpec] = {
    **MULTISTEP_OUTPUTS,
    "logprob": OutputSpec(),
    "top_logprobs": OutputSpec(),
    "top_ids": OutputSpec(),
}


def check_steps_per_launch(name: str, value: object) -> int:
    """``value`` as decode steps per launch: an int in ``1..8``, or a
    ValueError naming ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_STEPS_PER_LAUNCH
    ):
        raise ValueError(
            f"{name}={value!r}; expected an int in 1..{MAX_STEPS_PER_LAUNCH} (decode steps "
            f"per launch)"
        )
    return value


def check_device_metadata(backend: object) -> None:
    """Refuse a backend that plans its decode metadata on the host per step."""
    if getattr(backend, "metadata_on_device", False) is not True:
        raise ValueError(
            f"backend {type(backend).__name__} does not declare metadata_on_device=True: it may "
            f"plan its decode metadata on the host per step (init_replay_metadata), which a "
            f"multi-step launch runs once for all its steps; expected a backend that computes "
            f"its metadata from the step's device tensors (e.g. TorchPagedBackend)"
        )


def multistep_buffer_specs(
    steps: int,
    *,
    seq_len_fill_value: int = 1,
    sampling: bool = False,
    future: bool = False,
    penalties: bool = False,
) -> list[BufferSpec]:
    """The decode fields with ``out_cache_loc`` at ``steps`` rows per request
    (reserved slots, pad 0), ``steps_left`` (int64 ``[bs]``, pad 0) and, with
    ``sampling``, the sampling fields (``penalties``: and the penalty fields);
    ``future=True`` lets ``input_ids`` hold future references (overlap scheduling)."""
    check_steps_per_launch("steps", steps)
    specs = [
        dataclasses.replace(s, rows_per_request=steps, indexes=Index.RESERVED_KV_SLOT)
        if s.name == OUT_CACHE_LOC
        else s
        for s in decode_buffer_specs(seq_len_fill_value=seq_len_fill_value, future=future)
    ]
    specs.append(BufferSpec(STEPS_LEFT, torch.int64, PadRule.ZERO))
    if sampling and penalties:
        from graphrunner.sampling.penalties import PENALTY_FIELDS

        return [*specs, *SAMPLING_FIELDS, *PENALTY_FIELDS]
    return [*specs, *SAMPLING_FIELDS] if sampling else specs


@dataclass(frozen=True, slots=True)
class _Step:
    """One unrolled step's decode inputs (int64 ``[bs]`` each)."""

    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor


def multistep_forward(
    forward: ForwardFn,
    steps: int,
    *,
    seq_len_fill_value: int = 1,
    end_token: int | None = None,
    sampling: bool = False,
    logprobs_n: int = 0,
    future_tokens: torch.Tensor | None = None,
    compile_step_once: bool = False,
    penalties: TokenCounts | None = None,
) -> ForwardFn:
    """``steps`` decode steps of ``forward`` (one step's logits ``[bs, vocab]``)
    in one forward over :func:`multistep_buffer_specs`; ``logprobs_n`` >= 1
    adds each step's log-probabilities; ``future_tokens`` (a future map's
    int64 ``[rows]``) receives each row's last valid token at its request-pool
    row, on the device (padded rows write 0 to row 0); ``compile_step_once``:
    a compiler builds the model's step once and calls it ``steps`` times
    (:func:`compiled_once`) instead of compiling each unrolled copy;
    ``penalties``: see the module."""
    check_steps_per_launch("steps", steps)
    if isinstance(logprobs_n, bool) or not isinstance(logprobs_n, int) or logprobs_n < 0:
        raise ValueError(f"logprobs={logprobs_n!r}; expected an int >= 0 (0: none)")
    fill = seq_len_fill_value
    if compile_step_once:
        forward = compiled_once(forward)

    def step(b: Any) -> dict[str, torch.Tensor]:
        ids, pos, lens, rows = b.input_ids, b.positions, b.seq_lens, b.req_pool_indices
        bs = ids.shape[0]
        slots = b.out_cache_loc.view(bs, steps)
        left = getattr(b, STEPS_LEFT)
        alive = left > 0
        zero, pad_len, invalid = (
            torch.zeros_like(ids),
            torch.full_like(lens, fill),
            -ids.new_ones(()),
        )
        tokens: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        lps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for j in range(steps):
            inputs = _Step(
                input_ids=torch.where(alive, ids, zero),
                req_pool_indices=torch.where(alive, rows, zero),
                seq_lens=torch.where(alive, lens, pad_len),
                out_cache_loc=torch.where(alive, slots[:, j], zero),
                positions=torch.where(alive, pos, zero),
            )
            out = forward(inputs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"a multi-step decode needs the forward's logits tensor [bs, vocab]; got "
                    f"{type(out).__name__}"
                )
            token = (
                pick(out, b, inputs.req_pool_indices, inputs.positions + 1, penalties)
                if sampling
                else out.argmax(-1)
            )
            tokens.append(torch.where(alive, token, invalid))
            if logprobs_n:
                lp = logprobs(out, token, logprobs_n)
                lps.append((lp.chosen, lp.top, lp.top_ids))
            # each row's last step taken: a stopped row keeps the logits it had
            logits.append(out if j == 0 else torch.where(alive[:, None], out, logits[-1]))
            stop = left <= j + 1
            if end_token is not None:
                stop = stop | (token == end_token)
            alive = alive & ~stop
            ids, pos, lens = token, pos + 1, lens + 1
        taken = torch.stack(tokens, 1)
        count = (taken >= 0).sum(1)
        if future_tokens is not None:  # the next launch's input ids, before any read back
            last = taken.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
            future_tokens.index_copy_(0, rows, torch.where(count > 0, last, zero))
        result = {"tokens": taken, "count": count, "logits": logits[-1]}
        if logprobs_n:
            chosen, top, ids = (torch.stack(t, 1) for t in zip(*lps, strict=True))
            result |= {"logprob": chosen, "top_logprobs": top, "top_ids": ids}
        return result

    return step


def compiled_once(forward: ForwardFn) -> ForwardFn:
    """``forward`` over one step's five decode tensors as a nested compile
    region (``torch.compiler.nested_compile_region``): ``torch.compile``
    traces and compiles it once and calls the one program at every unrolled
    step. A trade, so not the runners' default: on the CPU a cold capture of
    the embedded model at N = 8 compiles 3x faster, but each launch runs
    1.25x slower (``bench/results/multistep-capture-cpu.md``). Eager
    calls run ``forward`` itself; a torch without regions gets ``forward``."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:
        return forward

    # The tensors as arguments (not the step object): the region is keyed on them.
    @region
    def one_step(
        input_ids: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        positions: torch.Tensor,
    ) -> Any:
        return forward(_Step(input_ids, req_pool_indices, seq_lens, out_cache_loc, positions))

    def step(b: Any) -> Any:
        return one_step(b.input_ids, b.req_pool_indices, b.seq_lens, b.out_cache_loc, b.positions)

    return step


def multistep_phase(
    forward: ForwardFn,
    steps: int,
    *,
    backend: GraphBackend | None = None,
    end_token: int | None = None,
    sampling: bool = False,
    logprobs: int = 0,
    future_tokens: torch.Tensor | None = None,
    compile_step_once: bool = False,
    penalties: TokenCounts | None = None,
) -> Phase:
    """``steps`` decode steps of ``forward`` per launch (see the module);
    ``end_token`` stops a row inside the launch (None: only its budget does);
    ``logprobs=n`` adds each step's log-probabilities and top ``n``;
    ``future_tokens`` (a :class:`~graphrunner.FutureMap`'s ``tokens``, overlap
    scheduling): ``input_ids`` may hold future references and each launch
    stores each row's last token there; ``compile_step_once``: see
    :func:`multistep_forward`; ``penalties`` (with ``sampling``): see the module.

    Raises:
        ValueError: ``steps`` not in ``1..8``, or a backend that plans on the host.
    """
    check_steps_per_launch("steps", steps)
    if penalties is not None and not sampling:
        raise ValueError("penalties: token counts need sampling=True (the sampled step)")
    hooks = NullBackend() if backend is None else backend
    check_device_metadata(hooks)
    fill = hooks.seq_len_fill_value
    future = future_tokens is not None
    specs = multistep_buffer_specs(
        steps,
        seq_len_fill_value=fill,
        sampling=sampling,
        future=future,
        penalties=penalties is not None,
    )
    step = multistep_forward(
        forward,
        steps,
        seq_len_fill_value=fill,
        end_token=end_token,
        sampling=sampling,
        logprobs_n=logprobs,
        future_tokens=future_tokens,
        compile_step_once=compile_step_once,
        penalties=penalties,
    )
    return Phase(
        f"multistep{steps}",
        step,
        tuple(specs),
        outputs=MULTISTEP_LOGPROB_OUTPUTS if logprobs else MULTISTEP_OUTPUTS,
        backend=backend,
        width=steps if steps > 1 else None,
        steps=steps,
        end_token=end_token,
        token_counts=penalties,
    )
