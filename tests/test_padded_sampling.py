"""The padded suite over the sampled decode step (``create_decode_runner(...,
sampling=True)``): every captured size replayed with every live count up to
it, after every static buffer's tail was poisoned (decode fields with live
indices, the sampling fields with NaN, inf, -1 and huge values).

After each replay the padded rows of the sampling buffers hold exactly their
pad values (:data:`PAD`, written here, not read from the specs), the live
rows hold the inputs, no KV slot but the live ones and the sink changed, and
each live row's token and logits equal the step's eager forward run on that
row alone.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from sampled_rows import sampling_rows

from conftest import runner_device
from graphrunner import GraphRunner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.phases.sampled import sampled_forward, with_sampling
from graphrunner_ref import create_decode_runner, default_model
from graphrunner_ref.model import ModelBundle

pytestmark = pytest.mark.padded

#: The pad value of every sampling buffer: temperature 1, top-k 1 (one
#: token, finite), top-p 1, min-p 0, seed 0.
PAD: dict[str, float | int] = {
    "temperature": 1.0,
    "top_k": 1,
    "top_p": 1.0,
    "min_p": 0.0,
    "sampling_seed": 0,
}
#: Hostile tails of the sampling buffers: (float fields, integer fields).
POISONS: tuple[tuple[float, int], ...] = (
    (float("nan"), -1),
    (float("inf"), 2**62),
    (float("-inf"), -(2**62)),
    (torch.finfo(torch.float32).max, 2**31),
)
#: Captured sizes by mechanism: each size gets its own runner, so it replays
#: every live count up to it (a runner picks the smallest graph that fits);
#: the compiled CPU program, seconds to compile, at one size.
SIZES = {"eager": [1, 2, 4], "cpu": [3], "cuda": [1, 2, 4]}
PROMPT_LENS = [5, 17, 9, 30, 12]
CTX = 64


@dataclass
class Sampled:
    bundle: ModelBundle
    runner: GraphRunner


def _params() -> list[object]:
    out: list[object] = []
    for kind in ("eager", "cpu", "cuda"):
        marks = [pytest.mark.cuda] if kind == "cuda" else []  # conftest skips it without a GPU
        for size in SIZES[kind]:
            out.append(pytest.param(kind, size, marks=marks, id=f"{kind}-{size}"))
    return out


_RUNNERS: dict[tuple[str, int], Sampled] = {}


def captured(kind: str, size: int) -> Sampled:
    if (kind, size) not in _RUNNERS:
        bundle = default_model(max_requests=8, max_context_len=CTX, device=runner_device(kind))
        runner = create_decode_runner(bundle, kind, capture_sizes=[size], sampling=True)
        runner.capture()
        _RUNNERS[(kind, size)] = Sampled(bundle, runner)
    return _RUNNERS[(kind, size)]


def batch_of(bundle: ModelBundle, raw_bs: int, seed: int) -> tuple[DecodeBatch, int]:
    """``raw_bs`` prefilled requests, prepared for one decode step, and the
    pool row of a prefilled bystander outside the batch."""
    bundle.req_pool.clear()
    bundle.kv_alloc.clear()
    gen = torch.Generator().manual_seed(seed)
    reqs, firsts, lens = [], [], [8, *PROMPT_LENS[:raw_bs]]  # the first is a bystander
    with torch.no_grad():
        for n in lens:
            req = bundle.req_pool.alloc(1)[0]
            prompt = torch.randint(bundle.config.vocab_size, (n,), generator=gen)
            slots = torch.tensor(bundle.kv_alloc.alloc(n), device=bundle.device)
            reqs.append(req)
            firsts.append(
                bundle.model.forward_extend(req, prompt.to(bundle.device), slots).argmax()
            )
    batch = DecodeBatch.from_requests(
        reqs[1:], lens[1:], torch.stack(firsts[1:]), device=bundle.device, max_context_len=CTX
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return batch, reqs[0]


def poison(shared: Sampled, raw_bs: int, bystander: int, floats: float, ints: int) -> None:
    """Every static buffer past ``raw_bs`` rows: the decode fields point at
    the bystander and one of its cached slots; the sampling fields hold the poison."""
    stale = {
        "input_ids": 3,
        "req_pool_indices": bystander,
        "seq_lens": CTX,
        "out_cache_loc": int(shared.bundle.req_pool.req_to_token[bystander, 0]),
        "positions": CTX - 1,
    }
    bufs = shared.runner.buffers
    for spec in bufs.specs:
        tail = bufs.tensors[spec.name][bufs.rows(spec, raw_bs) :]
        if spec.name in PAD:
            tail.fill_(floats if tail.is_floating_point() else ints)
        else:
            tail.fill_(stale[spec.name])


def eager_rows(
    bundle: ModelBundle, batch: DecodeBatch, rows: dict[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """The sampled step's eager forward on each live row alone."""
    step = sampled_forward(bundle.model.forward_decode)
    out = []
    for i in range(batch.batch_size):
        one = copy.copy(batch)
        one.filter([i])
        with torch.no_grad():
            got = step(with_sampling(one, {n: t[i : i + 1] for n, t in rows.items()}))
        assert isinstance(got, dict)
        out.append({k: v.clone() for k, v in got.items()})
    return out


def kv_state(bundle: ModelBundle) -> list[torch.Tensor]:
    return [t.clone() for t in (*bundle.kv_cache.k_buffers, *bundle.kv_cache.v_buffers)]


@pytest.mark.parametrize(("kind", "size"), _params())
def test_sampled_padded_rows_keep_pad_values_and_live_rows_match_eager(
    kind: str, size: int
) -> None:
    check_every_live_count(captured(kind, size), kind, size)


class _KeepsTail:
    """A populate that leaves one buffer's padded tail as it found it."""

    def __init__(self, runner: GraphRunner, name: str) -> None:
        self.inner, self.tensor = runner.writer, runner.buffers.tensors[name]

    def write(self, sources: Sequence[torch.Tensor], raw_bs: int, bs: int) -> int:
        kept = self.tensor[raw_bs:].clone()
        ops = self.inner.write(sources, raw_bs, bs)
        self.tensor[raw_bs:].copy_(kept)
        return ops


@pytest.mark.parametrize("name", list(PAD))
def test_the_suite_sees_a_populate_that_skips_a_sampling_tail(name: str) -> None:
    bundle = default_model(max_requests=8, max_context_len=CTX)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2], sampling=True)
    runner.capture()
    runner.writer = _KeepsTail(runner, name)
    # The pad check names the tail, or the poison the padded row kept makes
    # the sampler fail first (a NaN min-p indexes out of range).
    with pytest.raises((AssertionError, RuntimeError)) as found:
        check_every_live_count(Sampled(bundle, runner), "eager", 2)
    assert isinstance(found.value, RuntimeError) or f"{name} tail" in str(found.value)


def check_every_live_count(shared: Sampled, kind: str, size: int) -> None:
    bundle, runner = shared.bundle, shared.runner
    bufs = runner.buffers
    for raw_bs in range(1, size + 1):
        assert runner.graph_size_for(raw_bs) == size
        for p, (floats, ints) in enumerate(POISONS):
            seed = 10 * raw_bs + p
            batch, bystander = batch_of(bundle, raw_bs, seed)
            rows = sampling_rows(raw_bs, seed, bundle.device)
            expected = eager_rows(bundle, batch, rows)  # writes the live KV slots
            before = kv_state(bundle)
            poison(shared, raw_bs, bystander, floats, ints)
            out = runner.replay(with_sampling(batch, rows))
            assert isinstance(out, dict)
            where = f"{kind} bs {size} live {raw_bs} poison {floats}/{ints}"
            for name, pad in PAD.items():
                buf = bufs.tensors[name]
                want = torch.full((size - raw_bs,), pad, dtype=buf.dtype, device=buf.device)
                assert torch.equal(buf[raw_bs:size], want), f"{where}: {name} tail {buf[raw_bs:]}"
                assert torch.equal(buf[:raw_bs], rows[name]), f"{where}: {name} live rows"
            for i, want_row in enumerate(expected):
                assert int(out["tokens"][i]) == int(want_row["tokens"][0]), f"{where}: row {i}"
                torch.testing.assert_close(out["logits"][i : i + 1], want_row["logits"])
            live = set(batch.out_cache_loc.tolist())
            for b, a in zip(before, kv_state(bundle), strict=True):
                changed = set(torch.nonzero((a != b).flatten(1).any(1)).flatten().tolist())
                assert changed <= live | {0}, f"{where}: KV slots {changed - live - {0}} written"
