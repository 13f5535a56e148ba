"""The token-batch phase: a step of any mix of prompt chunks and decode rows, padded on two axes,
tokens and requests.

Uniform decode pads one axis (requests). A token batch holds ``T`` tokens belonging to ``R``
requests (a decode row is a request of one token, a prompt chunk a request of many), and pads both:
tokens up to the captured token count, requests up to ``min(T, max_requests)``. Its buffers are
declared once on their axis (:class:`~graphrunner.declare.buffers.Axis`) with the pad rule of each,
and the one populate writes both:

=========  =========================  ===========  ==============================
axis       buffer                     live         padded
=========  =========================  ===========  ==============================
token      ``input_ids``              copied       0
token      ``positions``              copied       0
token      ``out_cache_loc``          copied       0 (the KV sink)
token      ``token_req_pool_indices`` copied       0 (the reserved request row)
request    ``req_pool_indices``       copied       0 (the reserved row)
request    ``seq_lens``               copied       the backend's fill (1)
request    ``extend_lens``            copied       0 (a padded request owns no token)
request    ``last_token_index``       copied       0 (read, never sampled)
request    ``seq_lens_cpu`` (host)    copied       the same fill
request    ``extend_lens_cpu`` (host) copied       0
=========  =========================  ===========  ==============================

A request's tokens are consecutive on the token axis, in request order (``extend_lens`` of them, at
positions ``seq_lens - extend_lens .. seq_lens - 1``, their slots already recorded in
``req_to_token``). Padded tokens belong to the reserved request row 0, sit at position 0 and write
only KV slot 0; padded requests own no token. Outputs are declared per request (each request's last
token, e.g. its logits; a chunk that does not finish its prompt is simply not sampled by its
engine) or, with ``OutputSpec(axis=Axis.TOKEN)``, per token.

The runner's sizes count tokens (``capture_sizes`` are token counts, as the defaults of
:func:`~graphrunner.sizing.default_token_sizes`); a step above the largest, or of more than
``max_requests`` requests, runs eagerly and is counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch

from graphrunner.core.phase import Phase
from graphrunner.declare.buffers import Axis, BufferSpec, Index, PadRule
from graphrunner.declare.decode import (
    INPUT_IDS,
    OUT_CACHE_LOC,
    POSITIONS,
    REQ_POOL_INDICES,
    SEQ_LENS,
    host_seq_lens_spec,
)
from graphrunner.declare.hooks import BaseGraphBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.declare.sealed import SealKey, seal_key
from graphrunner.mechanisms.base import ForwardFn
from graphrunner.phases.base import SpecBatch

__all__ = [
    "EXTEND_LENS",
    "LAST_TOKEN_INDEX",
    "TOKEN_REQ_POOL_INDICES",
    "token_batch_inputs",
    "token_batch_phase",
    "token_batch_specs",
]

_I64 = torch.int64
#: Tokens each request owns in the step (its chunk's length; 1 for a decode row).
EXTEND_LENS = "extend_lens"
#: Each request's last token's row on the token axis (the row its logits come from).
LAST_TOKEN_INDEX = "last_token_index"
#: Each token's request row of ``req_to_token`` (for attention that runs per token).
TOKEN_REQ_POOL_INDICES = "token_req_pool_indices"


def token_batch_specs(*, seq_len_fill_value: int = 1, host_layout: bool = True) -> list[BufferSpec]:
    """The token batch's buffers with the pad rules of the module's table.

    ``host_layout`` adds the host buffers ``seq_lens_cpu`` and
    ``extend_lens_cpu``, from which an attention that runs per request plans
    its ranges on the host (no device read).
    """
    token = Axis.TOKEN
    specs = [
        BufferSpec(INPUT_IDS, _I64, PadRule.ZERO, index=True, indexes=Index.TOKEN, axis=token),
        BufferSpec(POSITIONS, _I64, PadRule.ZERO, index=True, indexes=Index.POSITION, axis=token),
        BufferSpec(
            OUT_CACHE_LOC, _I64, PadRule.ZERO, index=True, indexes=Index.KV_SLOT, axis=token
        ),
        BufferSpec(TOKEN_REQ_POOL_INDICES, _I64, PadRule.ZERO, index=True, axis=token),
        BufferSpec(REQ_POOL_INDICES, _I64, PadRule.ZERO, index=True, indexes=Index.REQUEST_ROW),
        BufferSpec(
            SEQ_LENS,
            _I64,
            PadRule.FILL,
            fill_value=seq_len_fill_value,
            backend_fill=True,
            indexes=Index.LENGTH,
        ),
        BufferSpec(EXTEND_LENS, _I64, PadRule.ZERO, indexes=Index.TOKEN_COUNT),
        BufferSpec(LAST_TOKEN_INDEX, _I64, PadRule.ZERO, index=True, indexes=Index.TOKEN_ROW),
    ]
    if host_layout:
        specs += [
            host_seq_lens_spec(seq_len_fill_value),
            BufferSpec(f"{EXTEND_LENS}_cpu", _I64, PadRule.ZERO, host=True),
        ]
    return specs


def token_batch_phase(
    forward: ForwardFn,
    *,
    max_requests: int,
    outputs: OutputsDecl | None = None,
    backend: BaseGraphBackend | None = None,
    host_layout: bool = True,
) -> Phase:
    """The token-batch phase of ``forward``.

    Args:
        forward: the step, called with a :class:`~graphrunner.BufferView` of
            the buffers of :func:`token_batch_specs`: token-axis ones of
            ``T`` rows, request-axis ones of ``R`` rows (``T`` the captured
            token count, ``R = min(T, max_requests)``; on the eager path the
            live counts). It returns, by default, one row per request
            (e.g. logits ``[R, vocab]`` of each request's last token).
        max_requests: the most requests one step holds (its request axis).
        outputs: the outputs' layout (default: one row per request).
        backend: the attention backend's hooks (None: none needed); its
            metadata hooks receive the step's
            :class:`~graphrunner.declare.buffers.StepSize`.
        host_layout: declare the host buffers ``seq_lens_cpu`` and
            ``extend_lens_cpu`` (see :func:`token_batch_specs`).
    """
    fill = 1 if backend is None else backend.seq_len_fill_value
    specs = token_batch_specs(seq_len_fill_value=fill, host_layout=host_layout)
    return Phase(
        "token_batch",
        forward,
        tuple(specs),
        outputs=outputs,
        backend=backend,
        max_requests=max_requests,
    )


def token_batch_inputs(
    *,
    input_ids: Sequence[int] | torch.Tensor,
    out_cache_loc: Sequence[int] | torch.Tensor,
    req_pool_indices: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    extend_lens: Sequence[int] | torch.Tensor,
    device: torch.device | str = "cpu",
) -> SpecBatch:
    """A token batch's inputs, from what a scheduler knows on the host.

    Request ``i`` owns the next ``extend_lens[i]`` (>= 1) of ``input_ids``
    and ``out_cache_loc`` (its tokens' ids and KV slots, already recorded in
    ``req_to_token``), and holds ``seq_lens[i]`` tokens once the step ran:
    its tokens sit at positions ``seq_lens[i] - extend_lens[i] ..
    seq_lens[i] - 1``. Derives ``positions``, ``token_req_pool_indices``
    and ``last_token_index``, and returns them with the rest and the host
    mirrors as a :class:`~graphrunner.phases.SpecBatch` on ``device``,
    sealed: checked here, once, so a token-batch runner skips its per-field
    checks (as for a decode batch). Raises ValueError naming the argument
    whose values disagree.
    """
    host = {
        name: torch.as_tensor(value, dtype=_I64).reshape(-1).cpu()
        for name, value in (
            (INPUT_IDS, input_ids),
            (OUT_CACHE_LOC, out_cache_loc),
            (REQ_POOL_INDICES, req_pool_indices),
            (SEQ_LENS, seq_lens),
            (EXTEND_LENS, extend_lens),
        )
    }
    lens, seqs, rows = host[EXTEND_LENS], host[SEQ_LENS], host[REQ_POOL_INDICES]
    _check_layout(host, lens, seqs, rows)
    starts = torch.cumsum(lens, 0) - lens
    token_of = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
    j = torch.arange(int(lens.sum())) - starts[token_of]
    derived = {
        POSITIONS: seqs[token_of] - lens[token_of] + j,
        TOKEN_REQ_POOL_INDICES: rows[token_of],
        LAST_TOKEN_INDEX: starts + lens - 1,
    }
    tensors = {k: v.to(device) for k, v in {**host, **derived}.items()}
    batch = SpecBatch(
        req_pool_indices_cpu=rows,
        seq_lens_cpu=seqs,
        extend_lens_cpu=lens,
        **tensors,
    )
    # Every field is int64, 1-D, of the rows _check_layout proved, on one
    # device: the layouts of token_batch_specs() by construction (checked once).
    batch.made(_made_key(tensors[INPUT_IDS].device))
    return batch


@cache
def _made_key(device: torch.device) -> SealKey:
    return seal_key(token_batch_specs(), device)


def _check_layout(
    host: dict[str, torch.Tensor], lens: torch.Tensor, seqs: torch.Tensor, rows: torch.Tensor
) -> None:
    requests = lens.shape[0]
    if requests < 1:
        raise ValueError("extend_lens is empty; a token batch holds at least one request")
    for name in (REQ_POOL_INDICES, SEQ_LENS):
        if host[name].shape[0] != requests:
            raise ValueError(
                f"{name} has {host[name].shape[0]} values; expected one per request "
                f"({requests}, as extend_lens)"
            )
    if int(lens.min()) < 1:
        i = int((lens < 1).nonzero()[0, 0])
        raise ValueError(f"extend_lens[{i}]={int(lens[i])}; expected >= 1 (a request owns a token)")
    if bool((seqs < lens).any()):
        i = int((seqs < lens).nonzero()[0, 0])
        raise ValueError(
            f"seq_lens[{i}]={int(seqs[i])} < extend_lens[{i}]={int(lens[i])}; expected the "
            f"request's length after the step, at least its tokens in it"
        )
    if int(rows.min()) < 1:
        i = int((rows < 1).nonzero()[0, 0])
        raise ValueError(f"req_pool_indices[{i}]=0; expected >= 1 (0 is the padding row)")
    tokens = int(lens.sum())
    for name in (INPUT_IDS, OUT_CACHE_LOC):
        if host[name].shape[0] != tokens:
            raise ValueError(
                f"{name} has {host[name].shape[0]} values; expected {tokens} "
                f"(the sum of extend_lens)"
            )
