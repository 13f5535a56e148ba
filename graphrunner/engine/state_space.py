"""Engine glue for models with Mamba layers: the runner over a
:class:`~graphrunner.io.mamba_checkpoint.StateSpaceBundle`, the step inputs
that add each row's Mamba slot, and the engine that serves them.

The scheduler side is the plain :class:`~graphrunner.engine.loop.Engine`: the
bundle's request pool is a :class:`~graphrunner.pools.HybridReqToTokenPool`,
so admitting a request allocates its Mamba slot (and records its clear) and
retiring it frees the slot. The runner's pre-launch step runs the recorded
ops (:mod:`graphrunner.declare.state_ops`); a prefill runs them first itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.core.runner import GraphRunner
from graphrunner.core.runners import create_runner
from graphrunner.declare.decode import decode_buffer_specs
from graphrunner.declare.hooks import GraphBackend, NullBackend
from graphrunner.engine.loop import Engine, EngineStats
from graphrunner.io.mamba_checkpoint import StateSpaceBundle
from graphrunner.model.build import ModelBundle
from graphrunner.model.hybrid import HybridLM
from graphrunner.pools import HybridReqToTokenPool
from graphrunner.sanitizer.checks import PaddingViolation, live_ints
from graphrunner.sanitizer.padding import PaddingSanitizer

__all__ = ["MambaSanitizer", "StateSpaceEngine", "StateSpaceInputs", "create_state_space_runner"]


class StateSpaceInputs:
    """A :class:`DecodeBatch` plus each row's Mamba slot (the decode fields of
    ``decode_buffer_specs(mamba=True)``): every other attribute is the batch's.

    mamba_track_indices: int64 ``[bs]``, ``req_pool.mamba_slots`` of the rows
        (from the pool's host mapping: no device read).
    mamba_track_mask: bool ``[bs]``, all True (every live row advances).
    """

    def __init__(self, batch: DecodeBatch, req_pool: HybridReqToTokenPool) -> None:
        self._batch = batch
        slots = req_pool.mamba_slots(batch.req_pool_indices_cpu)
        host = torch.tensor(slots, dtype=torch.int64)
        self.mamba_track_indices = host.to(batch.device, non_blocking=True)
        self.mamba_track_mask = torch.ones(len(slots), dtype=torch.bool, device=batch.device)

    @property
    def batch_size(self) -> int:
        return self._batch.batch_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)


class MambaSanitizer(PaddingSanitizer):
    """The padding sanitizer that also checks each live row's Mamba slot: the
    one its request row owns, never the sink 0, and its mask True. Build it
    with :meth:`PaddingSanitizer.for_pools` over a hybrid request pool."""

    def check_live_values(self, inputs: Any, raw_bs: int) -> None:
        super().check_live_values(inputs, raw_bs)
        rows = live_ints(inputs, "req_pool_indices", raw_bs)
        slots = live_ints(inputs, "mamba_track_indices", raw_bs)
        mask = getattr(inputs, "mamba_track_mask", None)
        pool = self.req_pool
        if rows is None or slots is None or not isinstance(pool, HybridReqToTokenPool):
            return
        owned = pool.mamba_slots(rows)
        for i, (r, s, o) in enumerate(zip(rows, slots, owned, strict=True)):
            if s != o or s == 0:
                raise PaddingViolation(
                    f"mamba_track_indices live row {i} = {s}: expected {o}, the Mamba slot "
                    f"of request row {r} (never the sink 0)"
                )
        if isinstance(mask, torch.Tensor) and not bool(mask[:raw_bs].all()):
            row = int((~mask[:raw_bs]).nonzero()[0, 0])
            raise PaddingViolation(f"mamba_track_mask live row {row} is False: expected True")


def create_state_space_runner(
    bundle: StateSpaceBundle,
    kind: str,
    *,
    capture_sizes: Sequence[int] | None = None,
    max_bs: int | None = None,
    show_progress: bool = False,
    check_padding: bool = False,
    **mechanism_options: Any,
) -> GraphRunner:
    """A ``kind`` runner over the bundle's decode step with the Mamba fields,
    whose pre-launch step runs the request pool's recorded state ops.
    ``check_padding=True`` guards ``req_to_token``, the KV layers (hybrid)
    and the Mamba state with a :class:`MambaSanitizer`."""
    model = bundle.model
    backend: GraphBackend = model.attn_backend if isinstance(model, HybridLM) else NullBackend()
    specs = decode_buffer_specs(seq_len_fill_value=backend.seq_len_fill_value, mamba=True)
    sanitizer = None
    if check_padding:
        sanitizer = MambaSanitizer.for_pools(
            bundle.req_pool,
            bundle.kv_cache,
            kv_allocator=bundle.kv_alloc,
            mamba_pool=bundle.mamba_pool,
        )
    return create_runner(
        kind,
        model.forward_decode,
        specs,
        device=bundle.device,
        capture_sizes=capture_sizes,
        max_bs=max_bs,
        backend=backend,
        show_progress=show_progress,
        sanitizer=sanitizer,
        state_ops=bundle.req_pool,
        **mechanism_options,
    )


class StateSpaceEngine(Engine):
    """:class:`~graphrunner.engine.loop.Engine` over a :class:`StateSpaceBundle`:
    each decode step passes :class:`StateSpaceInputs` to the runner.

    ``check`` (an eager rerun of every step) is refused: a recurrent state
    advanced twice is not the state of one step; the transformers oracle and
    the sanitizer check these models instead.
    """

    def __init__(
        self, bundle: StateSpaceBundle, runner: GraphRunner, *, check: bool = False, **kwargs: Any
    ) -> None:
        if check:
            raise ValueError(
                "check=True: an eager rerun would advance each request's Mamba state twice; "
                "expected check=False for a model with Mamba layers"
            )
        if runner.state_ops is not bundle.req_pool:
            raise ValueError(
                "runner.state_ops is not the bundle's request pool: its recorded state ops "
                "would never run; build it with create_state_space_runner"
            )
        # The engine reads only what both bundle kinds have (pools, model
        # forward_extend / forward_decode, sizes).
        super().__init__(cast(ModelBundle, bundle), runner, **kwargs)
        self.ssm_bundle = bundle

    def _replay(self, batch: DecodeBatch) -> torch.Tensor:
        return super()._replay(cast(DecodeBatch, StateSpaceInputs(batch, self.ssm_bundle.req_pool)))

    def _checked_replay(self, batch: DecodeBatch, stats: EngineStats) -> torch.Tensor:
        raise AssertionError("unreachable: check mode is refused at construction")
