"""Phases are values derived from the one decode declaration: each phase's
buffers equal the table of the design (written out here as the oracle), a
runner is a phase on a mechanism, and the width check is runner data."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch

from graphrunner import DecodeBatch, OutputSpec, create_runner
from graphrunner.declare.buffers import BufferSpec, Index, PadRule
from graphrunner.declare.decode import (
    DECODE_FIELD_NAMES,
    DECODE_FIELDS,
    PER_TOKEN_FIELD_NAMES,
    per_token_fields,
)
from graphrunner.declare.hooks import NullBackend
from graphrunner.phases import (
    Phase,
    SpecBatch,
    decode_phase,
    eagle_draft_decode_phase,
    eagle_draft_extend_phase,
    eagle_draft_extend_specs,
    frozen_kv_mtp_phase,
    mtp_buffer_specs,
    verify_buffer_specs,
    verify_phase,
)
from graphrunner.phases.sampled import with_sampling
from graphrunner.sampling import SAMPLING_FIELD_NAMES, SamplingParams, sampling_tensors
from graphrunner.writers import PopulateError
from graphrunner_ref import default_model
from graphrunner_ref.model.token_rows import TokenRows
from spec_world import SpecWorld

I64 = torch.int64
TOK, ROW, KV, POS, COUNT = (
    Index.TOKEN,
    Index.REQUEST_ROW,
    Index.KV_SLOT,
    Index.POSITION,
    Index.COUNT,
)


def _by_name(specs: list[BufferSpec] | tuple[BufferSpec, ...]) -> dict[str, BufferSpec]:
    return {s.name: s for s in specs}


def _per_token_oracle(w: int) -> dict[str, BufferSpec]:
    return _by_name(
        [
            BufferSpec("input_ids", I64, PadRule.ZERO, rows_per_request=w, index=True, indexes=TOK),
            BufferSpec("positions", I64, PadRule.ZERO, rows_per_request=w, index=True, indexes=POS),
            BufferSpec(
                "out_cache_loc", I64, PadRule.ZERO, rows_per_request=w, index=True, indexes=KV
            ),
            BufferSpec("req_pool_indices", I64, PadRule.ZERO, index=True, indexes=ROW),
            BufferSpec("seq_lens", I64, PadRule.WIDTH, width=w, indexes=Index.LENGTH),
        ]
    )


@pytest.mark.parametrize("w", [1, 3, 5])
def test_verify_specs_are_the_per_token_decode_fields(w: int) -> None:
    assert _by_name(verify_buffer_specs(w)) == _per_token_oracle(w)
    assert [s.name for s in per_token_fields(w)] == [s.name for s in DECODE_FIELDS]


def test_eagle_extend_specs_add_hidden_and_lengths() -> None:
    w, hidden = 4, 8
    expected = _per_token_oracle(w) | _by_name(
        [
            BufferSpec(
                "hidden_states",
                torch.float32,
                PadRule.ZERO,
                rows_per_request=w,
                extra_shape=(hidden,),
            ),
            BufferSpec("extend_lens", I64, PadRule.WIDTH, width=w, index=True, indexes=COUNT),
            BufferSpec("accept_lens", I64, PadRule.WIDTH, width=w, index=True, indexes=COUNT),
        ]
    )
    assert _by_name(eagle_draft_extend_specs(w, hidden, torch.float32)) == expected


def test_mtp_specs_are_decode_less_out_cache_loc_plus_hidden() -> None:
    expected = _by_name(
        [
            BufferSpec("input_ids", I64, PadRule.ZERO, index=True, indexes=TOK),
            BufferSpec("req_pool_indices", I64, PadRule.ZERO, index=True, indexes=ROW),
            BufferSpec(
                "seq_lens", I64, PadRule.FILL, fill_value=3, backend_fill=True, indexes=Index.LENGTH
            ),
            BufferSpec("positions", I64, PadRule.ZERO, index=True, indexes=POS),
            BufferSpec("hidden_states", torch.bfloat16, PadRule.ZERO, extra_shape=(6,)),
        ]
    )
    assert _by_name(mtp_buffer_specs(6, torch.bfloat16, seq_len_fill_value=3)) == expected


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_width_is_checked_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"width=.*expected an int >= 1"):
        per_token_fields(bad)


def test_phase_values_of_a_world() -> None:
    w = SpecWorld()
    verify = verify_phase(w.model, 3)
    assert verify.width == 3 and verify.forward == w.model.forward_tokens
    extend = eagle_draft_extend_phase(w.eagle, 2)
    assert extend.width == 2 and _by_name(extend.specs)["hidden_states"].rows_per_request == 2
    draft = eagle_draft_decode_phase(w.eagle)
    assert draft.width is None and {s.name for s in draft.specs} == {
        *(s.name for s in DECODE_FIELDS),
        "hidden_states",
    }
    mtp = frozen_kv_mtp_phase(w.mtp)
    assert "out_cache_loc" not in _by_name(mtp.specs)
    field = "width"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(verify, field, 4)


def test_decode_phase_takes_the_backend_fill() -> None:
    class Backend(NullBackend):
        seq_len_fill_value = 2

    phase = decode_phase(lambda b: b.input_ids, backend=Backend(), host_seq_lens=True)
    seq = _by_name(phase.specs)
    assert seq["seq_lens"].fill_value == seq["seq_lens_cpu"].fill_value == 2
    assert seq["seq_lens_cpu"].host and phase.width is None
    assert _by_name(decode_phase(lambda b: b.input_ids).specs)["seq_lens"].fill_value == 1


def _verify_inputs(world: SpecWorld, bs: int, width: int) -> SpecBatch:
    requests = world.reset(bs, seed=3)
    rows = [r for r, _ in requests]
    lens = [n + width for _, n in requests]
    dev = world.device
    positions = torch.cat([torch.arange(n, n + width) for _, n in requests]).to(dev)
    return SpecBatch(
        req_pool_indices_cpu=torch.tensor(rows),
        seq_lens_cpu=torch.tensor(lens),
        input_ids=torch.ones(bs * width, dtype=I64, device=dev),
        positions=positions,
        out_cache_loc=torch.zeros(bs * width, dtype=I64, device=dev),
        req_pool_indices=torch.tensor(rows, device=dev),
        seq_lens=torch.tensor(lens, device=dev),
    )


def test_a_batch_of_another_width_runs_eagerly() -> None:
    world = SpecWorld()
    runner = create_runner(
        verify_phase(world.model, 3),
        device="cpu",
        capture_sizes=[2],
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.replay(_verify_inputs(world, 2, 2))
    assert runner.stats.eager_fallbacks == 1
    assert any("batch width 2 differs from the captured width 3" in str(w.message) for w in caught)
    runner.replay(_verify_inputs(world, 2, 3))
    assert runner.stats.eager_fallbacks == 1


def test_width_needs_a_buffer_of_that_many_rows() -> None:
    phase = Phase("decode", lambda b: b.input_ids, tuple(DECODE_FIELDS))
    with pytest.raises(ValueError, match="width=2; expected a device buffer of rows_per_request=2"):
        create_runner(dataclasses.replace(phase, width=2), device="cpu", capture_sizes=[1])


@pytest.mark.parametrize("name", ["verify", "eagle_extend", "mtp"])
def test_each_phase_reads_exactly_the_fields_its_specs_declare(name: str) -> None:
    """No input type mirrors a phase by hand: the fields a runner takes are
    its phase's declared buffers (the host ones from the mirrors); a batch
    with exactly those replays, and one lacking any is refused naming it."""
    world = SpecWorld()
    requests = world.reset(2, seed=3)
    phase, full = {
        "verify": (verify_phase(world.model, 2), world.verify_inputs(requests, 2, seed=3)),
        "eagle_extend": (
            eagle_draft_extend_phase(world.eagle, 2),
            world.eagle_inputs(requests, 2, seed=3),
        ),
        "mtp": (frozen_kv_mtp_phase(world.mtp), world.mtp_inputs(requests, seed=3)),
    }[name]
    runner = create_runner(
        phase, kind="eager", device="cpu", capture_sizes=[4], show_progress=False
    )
    runner.capture()
    declared = [s.name for s in phase.specs if not s.host]
    mirrors = {"req_pool_indices_cpu": full.req_pool_indices_cpu, "seq_lens_cpu": full.seq_lens_cpu}

    def batch(without: str | None = None) -> SpecBatch:
        fields = {n: getattr(full, n) for n in declared if n != without}
        return SpecBatch(**mirrors, **fields)

    state = world.state()
    runner.replay(batch())
    world.restore(state)
    for field in declared:
        with pytest.raises(PopulateError, match=field):
            runner.replay(batch(without=field))


def test_token_rows_are_the_decode_fields_of_every_token() -> None:
    world = SpecWorld()
    inputs = world.verify_inputs(world.reset(2, seed=1), 3, seed=1)
    rows = TokenRows(inputs)
    assert set(rows.tensors()) == set(DECODE_FIELD_NAMES)
    assert rows.bs == 6 and rows.width == 3
    torch.testing.assert_close(rows.seq_lens, inputs.positions + 1)


def test_per_token_fields_name_decode_fields() -> None:
    assert set(PER_TOKEN_FIELD_NAMES) < set(DECODE_FIELD_NAMES)
    kept = per_token_fields(2, without=frozenset({"out_cache_loc"}))
    assert [s.name for s in kept] == [n for n in DECODE_FIELD_NAMES if n != "out_cache_loc"]


def test_captures_are_keyed_by_size_alone() -> None:
    w = SpecWorld()
    common: dict[str, Any] = {"device": w.device, "kind": "eager", "show_progress": False}
    verify = create_runner(verify_phase(w.model, 3), capture_sizes=[2, 4], **common)
    decode = create_runner(decode_phase(lambda b: b.input_ids), capture_sizes=[1, 4], **common)
    assert verify.graph_keys == decode.graph_keys == []  # nothing before capture
    verify.capture()
    decode.capture()
    assert verify.graph_keys == [2, 4] and verify.width == 3
    assert decode.graph_keys == [1, 4] and decode.width is None


def test_a_sampled_decode_phase_adds_the_sampling_buffers_and_picks_tokens() -> None:
    bundle = default_model(max_requests=4, max_context_len=16)
    phase = decode_phase(
        bundle.model.forward_decode, backend=bundle.model.attn_backend, sampling=True
    )
    assert [s.name for s in phase.specs][-5:] == list(SAMPLING_FIELD_NAMES)
    runner = create_runner(phase, device="cpu", kind="eager", capture_sizes=[4])
    runner.capture()
    rows = bundle.req_pool.alloc(3)
    batch = DecodeBatch.from_requests(
        rows, [3, 3, 3], torch.tensor([4, 5, 6]), device="cpu", max_context_len=16
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams()]
    out = runner.replay(with_sampling(batch, sampling_tensors(params, [1, 2, 3], "cpu")))
    assert isinstance(out, dict) and out["tokens"].shape == (3,)
    # Greedy rows and top-k 1 are the argmax; every row is a live request's.
    assert torch.equal(out["tokens"], out["logits"].argmax(-1))
    with pytest.raises(ValueError, match="declares its own"):
        decode_phase(bundle.model.forward_decode, outputs=OutputSpec(), sampling=True)
