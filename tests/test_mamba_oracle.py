"""The external oracle for models with Mamba layers: greedy tokens served
through padded replay equal transformers' ``generate(do_sample=False)``.

Tiny random ``MambaForCausalLM`` (Mamba-1), ``Mamba2ForCausalLM``,
``JambaForCausalLM`` (Mamba-1 and attention layers over the KV pool, one
hybrid request pool) and ``BambaForCausalLM`` (Mamba-2 and attention with
partial rotary) checkpoints
are saved with ``save_pretrained`` and loaded through graphrunner's
checkpoint dispatch. Requests arrive at staggered steps with staggered prompt
lengths, so decode steps see batch sizes 1..8, most of them padded up to a
captured size; the sanitizer checks every replay, including that no Mamba slot
outside the live rows changes, slot 0 included. Forked requests continue
exactly as their parent, also in a slot just freed and poisoned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import MECHANISMS, RUNNER_PARAMS, runner_device
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.sanitizer.padding import PaddingViolation
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.mamba_step import state_space_inputs
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io.checkpoint import load_any_model
from graphrunner_ref.io.mamba_checkpoint import StateSpaceBundle
from hf_ssm import (
    groups_the_gated_norm,
    save_tiny_bamba,
    save_tiny_jamba,
    save_tiny_mamba,
    save_tiny_mamba2,
)

transformers = pytest.importorskip("transformers")

CAPTURE_SIZES = [1, 2, 4, 8]
CONTEXT = 48
SAVERS = {
    "mamba": save_tiny_mamba,
    "mamba2": save_tiny_mamba2,
    "jamba": save_tiny_jamba,
    "bamba": save_tiny_bamba,
}
HYBRIDS = ("jamba", "bamba")


def _trace() -> list[Request]:
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 3, 5, 8, 13, 2, 9, 17, 4, 21, 6, 11, 7, 2]
    requests, step = [], 0
    for rid, n in enumerate(lengths):
        prompt = tuple(torch.randint(256, (n,), generator=gen).tolist())
        budget = int(torch.randint(4, 13, (), generator=gen))
        requests.append(Request(rid, prompt, budget, arrival_step=step))
        step += int(torch.randint(0, 3, (), generator=gen))
    return requests


TRACE = _trace()


def _generate(hf: Any, prompt: tuple[int, ...], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.fixture(scope="module", params=list(SAVERS))
def oracle(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, dict[int, list[int]]]:
    """The model kind, its checkpoint directory and transformers' greedy tokens."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    hf = SAVERS[kind](path)
    if kind in ("mamba2", "bamba") and not groups_the_gated_norm(hf):
        pytest.skip(
            f"transformers {transformers.__version__} normalises the gated RMSNorm over all "
            "channels, not per group; the oracle needs a release that groups it"
        )
    hf.generation_config.eos_token_id = None  # run every request to its budget
    hf.generation_config.pad_token_id = 0
    return kind, path, {r.rid: _generate(hf, r.prompt, r.max_new_tokens) for r in TRACE}


def _bundle(path: Path, device: str = "cpu") -> StateSpaceBundle:
    bundle = load_any_model(path, max_requests=8, max_context_len=CONTEXT, device=device)
    assert isinstance(bundle, StateSpaceBundle)
    return bundle


@pytest.mark.parametrize("label", RUNNER_PARAMS)
def test_greedy_tokens_equal_transformers_generate(
    oracle: tuple[str, Path, dict[int, list[int]]], label: str
) -> None:
    kind, path, expected = oracle
    sizes = CAPTURE_SIZES
    mechanism, options = MECHANISMS[label]
    bundle = _bundle(path, runner_device(label))
    runner = create_decode_runner(
        bundle, mechanism, capture_sizes=sizes, check_padding=True, **options
    )
    runner.capture()
    result = Engine(bundle, runner).run(TRACE)
    assert result.outputs == expected, f"{kind} through {label}"
    stats = result.stats
    assert runner.sanitizer is not None
    assert runner.sanitizer.stats.replays_checked == runner.stats.replays == stats.steps
    assert set(stats.batch_sizes) == set(range(1, 9)), stats.batch_sizes
    padded = sum(n for bs, n in stats.batch_sizes.items() if bs not in sizes)
    assert padded > stats.steps / 4 and stats.padded_rows > 0
    # Every request's clear ran in a prefill; every slot came back.
    assert bundle.mamba_pool.num_pending == 0
    assert bundle.mamba_pool.available_size() == bundle.mamba_pool.size
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size


def test_the_sanitizer_catches_a_padded_row_that_writes_its_mamba_slot(
    oracle: tuple[str, Path, dict[int, list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that ignores ``mamba_track_mask`` lets padded rows write the
    sink slot 0: the sanitizer must refuse the replay (so the oracle runs above,
    where it passed every replay, mean something)."""
    import graphrunner_ref.model.hybrid as hybrid_module
    import graphrunner_ref.model.mamba as mamba_module
    from graphrunner_ref.model.mamba_mixer import write_states

    def ignore_mask(pool: Any, slots: Any, mask: Any, new: Any, old: Any) -> None:
        write_states(pool, slots, torch.ones_like(mask), new, old)

    monkeypatch.setattr(mamba_module, "write_states", ignore_mask)
    monkeypatch.setattr(hybrid_module, "write_states", ignore_mask)
    _, path, _ = oracle
    bundle = _bundle(path)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4], check_padding=True)
    runner.capture()
    bundle.mamba_pool.ssm_state[0] = 0.5  # the sink holds a value a padded row would change
    with pytest.raises(PaddingViolation, match=r"mamba\.\w+_state Mamba slot 0 changed"):
        Engine(bundle, runner).run(TRACE[:2])


def test_the_one_engine_and_loader_serve_a_state_space_checkpoint(
    oracle: tuple[str, Path, dict[int, list[int]]],
) -> None:
    """``load_any`` dispatches on config.json; the plain ``Engine`` and
    ``create_decode_runner`` serve the bundle (its DecodeStep adds the Mamba
    fields and state ops); an eager rerun and future references are refused."""
    from graphrunner.core.future_map import FutureMap
    from graphrunner_ref.engine.bundle import create_decode_runner
    from graphrunner_ref.engine.loop import Engine
    from graphrunner_ref.io import load_any, read_any_config, state_space_kind

    kind, path, expected = oracle
    assert state_space_kind(path) == kind
    assert not isinstance(read_any_config(path), dict)
    bundle = load_any(path, max_requests=8, max_context_len=CONTEXT)
    assert isinstance(bundle, StateSpaceBundle)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4])
    runner.capture()
    assert runner.state_ops is bundle.req_pool
    assert Engine(bundle, runner).run(TRACE[:4]).outputs == {
        r.rid: expected[r.rid] for r in TRACE[:4]
    }
    with pytest.raises(ValueError, match="advance each request's Mamba state twice"):
        Engine(bundle, runner, check=True)
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    with pytest.raises(ValueError, match="future_map: overlap scheduling is not supported"):
        create_decode_runner(bundle, "eager", capture_sizes=[4], future_map=future)
    other = create_decode_runner(_bundle(path), "eager", capture_sizes=[4])
    with pytest.raises(ValueError, match="runner.state_ops is not the bundle's request pool"):
        Engine(bundle, other)


def _decode(
    bundle: StateSpaceBundle, runner: Any, batch: DecodeBatch, steps: int
) -> list[list[int]]:
    """``steps`` greedy decode steps of ``batch`` through ``runner``; tokens per row."""
    tokens: list[list[int]] = [[] for _ in range(batch.batch_size)]
    for _ in range(steps):
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
        ids = runner.replay(state_space_inputs(batch, bundle.req_pool)).argmax(-1)
        for row, t in zip(tokens, ids.tolist(), strict=True):
            row.append(t)
        batch.input_ids = ids
    return tokens


def test_forked_requests_continue_as_their_parent_even_in_a_poisoned_freed_slot(
    oracle: tuple[str, Path, dict[int, list[int]]],
) -> None:
    kind, path, expected = oracle
    if kind in HYBRIDS:
        pytest.skip("forking shares KV slots in a hybrid model; a Mamba model has none")
    bundle = _bundle(path)
    pool, req = bundle.mamba_pool, bundle.req_pool
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4], check_padding=True)
    runner.capture()
    parent = TRACE[4]
    # A request that finishes, leaving its slot poisoned: a fork landing there
    # must see its parent's state, never this.
    (gone,) = req.alloc(1)
    ids = torch.tensor(parent.prompt)
    slots = torch.tensor(bundle.kv_alloc.alloc(len(parent.prompt)))
    (row,) = req.alloc(1)
    first = int(bundle.model.forward_extend(row, ids, slots).argmax())
    assert first == expected[parent.rid][0]
    gone_slot = req.mamba_slots([gone])[0]
    req.free([gone])  # its clear ran in the prefill above: nothing pending on it
    pool.conv_state[gone_slot] = float("nan")
    pool.ssm_state[gone_slot] = float("nan")
    kids = req.fork(row, 2)
    assert gone_slot in req.mamba_slots(kids)  # the lowest free slot: the poisoned one
    n = len(parent.prompt)
    for kid in kids:  # a fork shares the parent's KV slots (none are read here)
        req.write(kid, 0, slots)
    batch = DecodeBatch.from_requests(
        [row, *kids], [n] * 3, torch.tensor([first] * 3), device="cpu", max_context_len=CONTEXT
    )
    tokens = _decode(bundle, runner, batch, parent.max_new_tokens - 1)  # bs 3, padded to 4
    assert runner.state_ops_run == 1  # the recorded copy ran once, before the first forward
    assert tokens[0] == expected[parent.rid][1:]
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]


def test_generate_loads_the_checkpoint_like_a_llama_one(
    oracle: tuple[str, Path, dict[int, list[int]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``graphrunner generate --checkpoint DIR`` serves a Mamba / Jamba
    checkpoint: transformers' greedy tokens, in prompt order."""
    import json

    from graphrunner_ref.cli import main as cli

    kind, path, expected = oracle
    requests = TRACE[:4]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(list(r.prompt)) + "\n" for r in requests))
    threads = torch.get_num_threads()
    args = ["generate", "--checkpoint", str(path), "--prompts", str(prompts), "--json"]
    try:
        rc = cli.main([*args, "--max-new-tokens", "4", "--runner", "eager", "--check-padding"])
        out = capsys.readouterr().out
        assert cli.main([*args, "--runner", "eager", "--check"]) == 2  # refused: usage error
        # The Llama path's argument checks, shared: a bad --arrive-every is refused too.
        assert cli.main([*args, "--runner", "eager", "--arrive-every", "-1"]) == 2
        assert "--arrive-every -1: expected 0..100000" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    tokens = [json.loads(line)["token_ids"] for line in out.splitlines()]
    assert tokens == [expected[r.rid][:4] for r in requests], kind


@pytest.mark.parametrize("label", ["eager", "cpu"])
def test_padded_replay_at_every_size_touches_only_the_live_slots(
    oracle: tuple[str, Path, dict[int, list[int]]], label: str
) -> None:
    """Every raw size 1..8 padded up to 8: live logits and live slots equal the
    eager forward of the unpadded batch; every other slot, the sink slot 0
    included (all poisoned with random values), is bit-identical after the replay."""
    kind, path, _ = oracle
    bundle = _bundle(path)
    req, pool = bundle.req_pool, bundle.mamba_pool
    runner = create_decode_runner(bundle, label, capture_sizes=[8])
    runner.capture()
    rows, lens, first = [], [], []
    for r in TRACE[:8]:
        (row,) = req.alloc(1)
        ids, slots = torch.tensor(r.prompt), torch.tensor(bundle.kv_alloc.alloc(len(r.prompt)))
        first.append(int(bundle.model.forward_extend(row, ids, slots).argmax()))
        rows.append(row)
        lens.append(len(r.prompt))
    gen = torch.Generator().manual_seed(0)
    for state in (pool.conv_state, pool.ssm_state):  # a padded row would change these
        state[len(rows) + 1 :] = torch.randn(state[len(rows) + 1 :].shape, generator=gen)
        state[0] = torch.randn(state[0].shape, generator=gen)
    exact = {"rtol": 0, "atol": 0}
    for bs in range(1, 9):
        batch = DecodeBatch.from_requests(
            rows[:bs], lens[:bs], torch.tensor(first[:bs]), device="cpu", max_context_len=CONTEXT
        )
        batch.prepare_decode(req, bundle.kv_alloc)
        inputs = state_space_inputs(batch, req)
        before = (pool.conv_state.clone(), pool.ssm_state.clone())
        ref = bundle.model.forward_decode(inputs)  # unpadded, eager
        ref_state = (pool.conv_state.clone(), pool.ssm_state.clone())
        pool.conv_state.copy_(before[0])
        pool.ssm_state.copy_(before[1])
        out = runner.replay(inputs)
        tol = {"rtol": 1e-5, "atol": 1e-5}  # a batch of 8 rows rounds unlike one of bs
        torch.testing.assert_close(out, ref, **tol)
        live = req.mamba_slots(rows[:bs])
        others = [s for s in range(pool.size + 1) if s not in live]
        for now, want, old in zip(
            (pool.conv_state, pool.ssm_state), ref_state, before, strict=True
        ):
            torch.testing.assert_close(now[live], want[live], **tol)
            torch.testing.assert_close(now[others], old[others], **exact)
        lens = [n + 1 if i < bs else n for i, n in enumerate(lens)]
        first = [*out.argmax(-1).tolist(), *first[bs:]]


def test_the_sanitizer_refuses_a_live_row_reading_another_requests_slot(
    oracle: tuple[str, Path, dict[int, list[int]]],
) -> None:
    """Swapped ``mamba_track_indices`` would advance each request's state with
    the other's token: refused before launch, naming the field, nothing written."""
    _, path, _ = oracle
    bundle = _bundle(path)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2], check_padding=True)
    runner.capture()
    rows = []
    for r in TRACE[:2]:
        (row,) = bundle.req_pool.alloc(1)
        slots = torch.tensor(bundle.kv_alloc.alloc(len(r.prompt)))
        bundle.model.forward_extend(row, torch.tensor(r.prompt), slots)
        rows.append(row)
    lens = [len(r.prompt) for r in TRACE[:2]]
    batch = DecodeBatch.from_requests(
        rows, lens, torch.tensor([1, 2]), device="cpu", max_context_len=CONTEXT
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    inputs = state_space_inputs(batch, bundle.req_pool)
    inputs.mamba_track_indices = inputs.mamba_track_indices.flip(0)
    before = bundle.mamba_pool.ssm_state.clone()
    with pytest.raises(PaddingViolation, match="mamba_track_indices batch row 0"):
        runner.replay(inputs)
    assert torch.equal(bundle.mamba_pool.ssm_state, before)
    inputs.mamba_track_indices = inputs.mamba_track_indices.flip(0)
    inputs.mamba_track_mask = torch.tensor([True, False])
    with pytest.raises(PaddingViolation, match="mamba_track_mask batch row 1"):
        runner.replay(inputs)


@pytest.mark.cuda
def test_a_cuda_graph_step_with_state_ops_never_syncs(
    oracle: tuple[str, Path, dict[int, list[int]]],
) -> None:
    """Forked rows' recorded copy, populate and the graph launch run under
    ``set_sync_debug_mode("error")``: no step reads the device back."""
    kind, path, expected = oracle
    if kind in HYBRIDS:
        pytest.skip("forking shares KV slots in a hybrid model; a Mamba model has none")
    bundle = _bundle(path, "cuda")
    req = bundle.req_pool
    runner = create_decode_runner(bundle, "cuda", capture_sizes=[4])
    runner.capture()
    parent = TRACE[4]
    n = len(parent.prompt)
    (row,) = req.alloc(1)
    slots = torch.tensor(bundle.kv_alloc.alloc(n), device="cuda")
    first = bundle.model.forward_extend(row, torch.tensor(parent.prompt, device="cuda"), slots)
    kids = req.fork(row, 2)  # a copy recorded, run by the replay's pre-launch step
    for kid in kids:
        req.write(kid, 0, slots)
    batch = DecodeBatch.from_requests(
        [row, *kids], [n] * 3, first.argmax().repeat(3), device="cuda", max_context_len=CONTEXT
    )
    batch.prepare_decode(req, bundle.kv_alloc)
    inputs = state_space_inputs(batch, req)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.replay(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.state_ops_run == 1
    assert out.argmax(-1).tolist() == [expected[parent.rid][1]] * 3
