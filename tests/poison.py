"""Stale values for the padded tail of static buffers, pointing at live state."""

from __future__ import annotations

from graphrunner import GraphRunner
from graphrunner.batch import DecodeBatch
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
