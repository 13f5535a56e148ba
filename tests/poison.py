"""Stale values for the padded tail of static buffers, pointing at live state."""

from __future__ import annotations

from graphrunner import GraphRunner
from graphrunner.batch import DecodeBatch
from graphrunner.testing import ToyWorld


def stale_values(world: ToyWorld, batch: DecodeBatch) -> dict[str, int]:
    """What a previous, larger batch leaves in the tail: indices of live state.

    ``out_cache_loc`` points at a bystander's cached token and
    ``req_pool_indices`` at a live request, so a padded row that keeps them
    writes over another request's KV and reads a live row.
    """
    bystander = min(world.req_pool.allocated() - set(batch.req_pool_indices_cpu.tolist()))
    bystander_slot = int(world.req_pool.req_to_token[bystander, 0])
    return {
        "input_ids": (int(batch.input_ids[0]) + 1) % world.cfg.vocab,
        "req_pool_indices": int(batch.req_pool_indices_cpu[0]),
        "seq_lens": world.cfg.max_context_len,
        "out_cache_loc": bystander_slot,
        "positions": world.cfg.max_context_len - 1,
    }


def poison_tails(runner: GraphRunner, raw_bs: int, values: dict[str, int]) -> None:
    """Fill every static buffer past ``raw_bs`` rows with its stale value."""
    bufs = runner.buffers
    for spec in bufs.specs:
        bufs.tensors[spec.name][bufs.rows(spec, raw_bs) :].fill_(values[spec.name])
