"""populate: host time per call and device operations per call, per batch size;
and the input checks a replay runs (validation once): in full, for a sealed
``DecodeBatch``, and for a foreign input object seen before.

Measured under ``no_grad``, as replay calls it (with grad on, populate enters
``no_grad`` itself, about 2 µs more).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.conftest import BASELINES, FACTS, record
from graphrunner import decode_buffer_specs
from graphrunner.core.input_check import InputGate
from graphrunner.declare import StaticBuffers
from graphrunner.declare.hooks import NullBackend
from graphrunner.sizing import pad_to
from graphrunner.testing import ToyWorld, ToyWorldConfig
from graphrunner.writers import populate

# Live batch sizes: one unpadded (1), the rest one short of a captured size.
RAW_SIZES = [1, 3, 7, 15, 31, 63]
CAPTURED = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]


@pytest.fixture(scope="module")
def world() -> ToyWorld:
    return ToyWorld(cfg=ToyWorldConfig(num_reqs=80, kv_slots=8192))


@pytest.mark.parametrize("raw_bs", RAW_SIZES)
def bench_populate(benchmark: object, world: ToyWorld, raw_bs: int) -> None:
    bufs = StaticBuffers(decode_buffer_specs(), CAPTURED[-1], world.device)
    batch = world.make_batch(raw_bs, seed=raw_bs)
    bs = pad_to(CAPTURED, raw_bs)
    with torch.no_grad():
        ops = benchmark(populate, bufs, batch, raw_bs, bs)  # type: ignore[operator]
    FACTS[("populate", raw_bs)] = {"padded_to": bs, "device_ops": ops}
    record(benchmark, "populate", raw_bs, "populate")


CHECK_SIZES = [1, 7, 63]
MIRRORS = ("req_pool_indices_cpu", "seq_lens_cpu")


@pytest.mark.parametrize("raw_bs", CHECK_SIZES)
@pytest.mark.parametrize("path", ["full", "sealed batch", "foreign, seen before"])
def bench_input_checks(benchmark: object, world: ToyWorld, raw_bs: int, path: str) -> None:
    """What a replay checks before it writes: every field and mirror in full
    (first sight, sanitizer), a sealed DecodeBatch, a foreign object seen before."""
    bufs = StaticBuffers(decode_buffer_specs(), CAPTURED[-1], world.device)
    batch = world.make_batch(raw_bs, seed=raw_bs)
    names = [*(s.name for s in bufs.specs), *MIRRORS]
    inputs: object = batch
    if path.startswith("foreign"):
        inputs = SimpleNamespace(batch_size=raw_bs, **{n: getattr(batch, n) for n in names})
    gate, backend = InputGate(bufs), NullBackend()
    full = path == "full"
    gate.sources(inputs, raw_bs, backend)  # first sight
    benchmark(gate.sources, inputs, raw_bs, backend, full=full)  # type: ignore[operator]
    BASELINES["input checks"] = "full"
    record(benchmark, "input checks", raw_bs, path)
