"""Stale values for the padded tail of static buffers, pointing at live state."""

from __future__ import annotations

import torch

from graphrunner import GraphRunner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.testing import ToyWorld


def stale_values(world: ToyWorld, batch: DecodeBatch) -> dict[str, int]:
    """What a previous, larger batch leaves in the tail: indices of live state.

    ``out_cache_loc`` points at a live request's first cached token and
    ``req_pool_indices`` at a live request, so a padded row that keeps them
    writes over live KV and reads a live row.
    """
    first_req = int(batch.req_pool_indices_cpu[0])
    cached_slot = int(world.req_pool.req_to_token[first_req, 0])
    return {
        "input_ids": (int(batch.input_ids[0]) + 1) % world.cfg.vocab,
        "req_pool_indices": first_req,
        "seq_lens": world.cfg.max_context_len,
        "out_cache_loc": cached_slot,
        "positions": world.cfg.max_context_len - 1,
    }


def poison_tails(runner: GraphRunner, raw_bs: int, values: dict[str, int]) -> None:
    """Fill every static buffer past ``raw_bs`` rows with its stale value."""
    bufs = runner.buffers
    for spec in bufs.specs:
        bufs.tensors[spec.name][bufs.rows(spec, raw_bs) :].fill_(values[spec.name])


def state_is_bit_exact(label: str) -> bool:
    """Whether a mechanism writes live state bit-identical to the eager step.

    A CUDA program compiled by inductor fuses the projections' epilogues into
    other kernels, so its live KV rows may differ from eager in the last bits;
    every other mechanism (the CPU inductor one included) writes the same bits.
    """
    return label != "cuda+compile"


def assert_state_matches(
    after: torch.Tensor, expected: torch.Tensor, live_slots: set[int], *, exact: bool, name: str
) -> None:
    """Slots 1.. of ``after`` equal ``expected``: bit for bit outside the live
    slots always, and on the live slots too when ``exact`` (else within
    assert_close's float tolerance). Slot 0 is the sink and not compared."""
    live = torch.zeros(after.shape[0], dtype=torch.bool, device=after.device)
    live[sorted(live_slots)] = True
    live[0] = False
    idle = ~live
    idle[0] = False
    assert torch.equal(after[idle], expected[idle]), f"{name}: a slot outside the live rows changed"
    if exact:
        assert torch.equal(after[live], expected[live]), f"{name}: live slots differ from eager"
    else:
        torch.testing.assert_close(after[live], expected[live], msg=f"{name}: live slots")
