"""The multi-step decode phase at every padded size: poisoned tails, the
sanitizer on, live outputs equal to N single eager decode steps (greedy and
sampled, bit for bit), rows stopping at every step by end token and by
budget, state outside the live rows' reserved slots untouched."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sampled_rows import sampling_rows

from conftest import MECHANISMS, runner_device
from graphrunner import GraphRunner, create_runner
from graphrunner.declare.hooks import NullBackend
from graphrunner.phases import SpecBatch
from graphrunner.phases.multistep import multistep_phase
from graphrunner.phases.sampled import with_sampling
from graphrunner.sampling import logprobs, sample
from graphrunner.sanitizer.padding import PaddingSanitizer
from spec_world import SpecWorld

SIZES = [2, 4]


class MultiStep:
    """A runner of ``steps`` decode steps per launch over a world."""

    def __init__(
        self,
        label: str,
        steps: int,
        *,
        sampling: bool,
        end_token: int | None,
        logprobs: int = 0,
    ) -> None:
        self.world = w = SpecWorld(runner_device(label))
        self.steps, self.sampling, self.end_token = steps, sampling, end_token
        self.step_logits: dict[tuple[int, int], torch.Tensor] = {}  # (row, step): [vocab]
        kind, options = MECHANISMS[label]
        b = w.bundle
        phase = multistep_phase(
            w.model.forward_decode,
            steps,
            backend=w.model.attn_backend,
            end_token=end_token,
            sampling=sampling,
            logprobs=logprobs,
        )
        self.runner = create_runner(
            phase,
            kind=kind,
            **options,
            device=w.device,
            capture_sizes=SIZES,
            show_progress=False,
            sanitizer=PaddingSanitizer.for_pools(b.req_pool, b.kv_cache, kv_allocator=b.kv_alloc),
        )
        self.runner.capture()

    def inputs(self, raw_bs: int, seed: int, budgets: list[int]) -> Any:
        """``raw_bs`` prefilled requests, each with ``budgets[i]`` reserved slots
        recorded in ``req_to_token`` (the rest of its ``N`` rows 0)."""
        w, n = self.world, self.steps
        b, gen = w.bundle, torch.Generator().manual_seed(seed)
        requests = w.reset(raw_bs, seed)
        slots: list[int] = []
        for (row, committed), budget in zip(requests, budgets, strict=True):
            fresh = b.kv_alloc.alloc(budget) if budget else []
            if fresh:
                b.req_pool.write(row, committed, fresh)
            slots += fresh + [0] * (n - budget)
        rows = [r for r, _ in requests]
        lens = [c + 1 for _, c in requests]
        dev = w.device
        fields = {
            "req_pool_indices_cpu": torch.tensor(rows),
            "seq_lens_cpu": torch.tensor(lens),
            "req_pool_indices": torch.tensor(rows, device=dev),
            "seq_lens": torch.tensor(lens, device=dev),
            "positions": torch.tensor(lens, device=dev) - 1,
            "input_ids": torch.randint(0, 256, (raw_bs,), generator=gen).to(dev),
            "out_cache_loc": torch.tensor(slots, device=dev),
            "steps_left": torch.tensor(budgets, device=dev),
        }
        batch = SpecBatch(**fields)
        return with_sampling(batch, sampling_rows(raw_bs, seed, dev)) if self.sampling else batch

    def reference(self, inputs: Any) -> torch.Tensor:
        """Each row's tokens ``[bs, N]`` (-1 after it stops) from single eager
        decode steps of its live rows only."""
        model, n, bs = self.world.model, self.steps, inputs.batch_size
        slots = inputs.out_cache_loc.view(bs, n)
        ids, pos = inputs.input_ids.clone(), inputs.positions.clone()
        budget = inputs.steps_left.tolist()
        out = torch.full((bs, n), -1, dtype=torch.int64)
        alive = [i for i in range(bs) if budget[i] > 0]
        for j in range(n):
            if not alive:
                break
            at = torch.tensor(alive, device=ids.device)
            step = SpecBatch(
                req_pool_indices_cpu=inputs.req_pool_indices_cpu[alive],
                seq_lens_cpu=inputs.seq_lens_cpu[alive] + j,
                input_ids=ids[at],
                positions=pos[at],
                seq_lens=pos[at] + 1,
                req_pool_indices=inputs.req_pool_indices[at],
                out_cache_loc=slots[at, j],
            )
            with torch.no_grad():
                logits = model.forward_decode(step)
            if self.sampling:
                rows = [getattr(inputs, f)[at] for f in _SAMPLING]
                token = sample(logits, *rows, step.positions + 1)
            else:
                token = logits.argmax(-1)
            ids[at], pos[at] = token, pos[at] + 1
            self.step_logits.update({(i, j): logits[k] for k, i in enumerate(alive)})
            out[alive, j] = token.cpu()
            alive = [
                i
                for i, t in zip(alive, token.tolist(), strict=True)
                if t != self.end_token and j + 1 < budget[i]
            ]
        return out


_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "sampling_seed")
_LABELS = ["eager", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: (label, N, sampling); inductor compiles each unrolled step.
_CASES = [
    pytest.param(
        (label, n, sampling),
        marks=[pytest.mark.cuda] if label == "cuda" else [],
        id=f"{label}-N{n}-{'sampled' if sampling else 'greedy'}",
    )
    for label in _LABELS
    for n in (2, 4, 8)
    for sampling in (False, True)
]


@pytest.fixture(scope="module", params=_CASES)
def multistep(request: pytest.FixtureRequest) -> Iterator[MultiStep]:
    label, n, sampling = request.param
    yield MultiStep(label, n, sampling=sampling, end_token=None)


def _poison(runner: GraphRunner, raw_bs: int, live_slot: int, live_row: int) -> None:
    for spec in runner.buffers.specs:
        tail = runner.buffers.tensors[spec.name][spec.rows(raw_bs) :]
        if tail.is_floating_point():
            tail.fill_(float("nan"))
        elif spec.name == "req_pool_indices":
            tail.fill_(live_row)
        elif spec.name == "out_cache_loc":
            tail.fill_(live_slot)
        else:
            tail.fill_(3)


def check_replay(ms: MultiStep, raw_bs: int, seed: int, budgets: list[int]) -> torch.Tensor:
    """Replay against the eager reference: tokens and counts exact, state
    equal outside slot 0; returns the tokens."""
    world, runner = ms.world, ms.runner
    inputs = ms.inputs(raw_bs, seed, budgets)
    before = world.state()
    expected = ms.reference(inputs)
    expected_state = world.state()
    world.restore(before)
    row = int(inputs.req_pool_indices_cpu[0])
    _poison(runner, raw_bs, int(world.bundle.req_pool.req_to_token[row, 0]), row)
    checked = runner.sanitizer.stats.replays_checked if runner.sanitizer else 0
    out = runner.replay(inputs)
    assert torch.equal(out["tokens"].cpu(), expected)
    assert torch.equal(out["count"].cpu(), (expected >= 0).sum(1))
    assert out["logits"].shape == (raw_bs, 256) and not out["logits"].isnan().any()
    after = world.state()
    for name, value in expected_state.items():  # slot 0 is the padding sink
        torch.testing.assert_close(after[name][1:], value[1:], msg=name, rtol=1e-5, atol=1e-5)
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked == checked + 1
    return expected


@pytest.mark.parametrize("raw_bs", range(1, SIZES[-1] + 1))
def test_padded_replay_equals_n_single_eager_steps(multistep: MultiStep, raw_bs: int):
    n = multistep.steps
    tokens = check_replay(multistep, raw_bs, raw_bs, [n] * raw_bs)
    assert (tokens >= 0).all()  # no end token: every row takes every step


def test_rows_stop_at_every_step_by_budget(multistep: MultiStep):
    n = multistep.steps
    for k in range(n + 1):  # 0: a row with no step at all is a padded row
        budgets = [k, n, max(k - 1, 0)]
        tokens = check_replay(multistep, 3, 30 + k, budgets)
        assert (tokens >= 0).sum(1).tolist() == budgets


@pytest.mark.parametrize("label", ["eager", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_rows_stop_at_every_step_by_end_token(label: str, n: int):
    """The end token of row 0's step k (k < N) stops it there, kept; rows
    emitting it later stop too, and the others run on."""
    probe = MultiStep(label, n, sampling=False, end_token=None)
    seen = probe.reference(probe.inputs(3, 7, [n] * 3))
    for k in range(n - 1):
        end = int(seen[0, k])
        ms = MultiStep(label, n, sampling=False, end_token=end)
        tokens = check_replay(ms, 3, 7, [n] * 3)
        first = seen[0].tolist().index(end)
        assert tokens[0].tolist() == seen[0, : first + 1].tolist() + [-1] * (n - first - 1)


def test_a_backend_planning_on_the_host_is_refused():
    class HostPlanned(NullBackend):
        metadata_on_device = False

    with pytest.raises(ValueError, match="metadata_on_device"):
        multistep_phase(lambda b: b, 4, backend=HostPlanned())
    bad_steps: list[Any] = [0, 9, True, 2.0]
    for bad in bad_steps:
        with pytest.raises(ValueError, match="steps"):
            multistep_phase(lambda b: b, bad)


@pytest.mark.parametrize("label", ["eager", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_each_steps_logprobs_are_those_of_its_logits_and_token(label: str, n: int, sampling: bool):
    ms = MultiStep(label, n, sampling=sampling, end_token=None, logprobs=3)
    budgets = [n, 0, n - 1, 1]
    inputs = ms.inputs(4, 13, budgets)
    before = ms.world.state()
    expected = ms.reference(inputs)
    ms.world.restore(before)
    out = ms.runner.replay(inputs)
    assert torch.equal(out["tokens"].cpu(), expected)
    assert out["logprob"].shape == (4, n)
    assert out["top_logprobs"].shape == out["top_ids"].shape == (4, n, 3)
    assert len(ms.step_logits) == sum(budgets)
    for (i, j), logits in ms.step_logits.items():
        lp = logprobs(logits.view(1, -1), expected[i, j].view(1).to(logits.device), 3)
        torch.testing.assert_close(out["logprob"][i, j], lp.chosen[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out["top_logprobs"][i, j], lp.top[0], rtol=0, atol=1e-5)
        assert torch.equal(out["top_ids"][i, j], lp.top_ids[0])


@pytest.mark.parametrize("n", [2, 4])
def test_compile_step_once_traces_one_region_called_at_every_step(n: int):
    """``compile_step_once``: dynamo's graph calls one subgraph N times (inductor
    then compiles it once) instead of inlining N copies of the step; the
    launch's tokens equal the unrolled one's."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def forward(b: Any) -> torch.Tensor:  # logits from the step's five tensors
        mixed = b.input_ids * 3 + b.positions + b.seq_lens + b.out_cache_loc
        return torch.nn.functional.one_hot((mixed + b.req_pool_indices) % 7, 7).float()

    names = {s.name for s in multistep_phase(forward, n).specs}
    inputs = {name: torch.arange(3, dtype=torch.int64) + 1 for name in names}
    inputs["out_cache_loc"] = torch.arange(3 * n, dtype=torch.int64) + 1
    inputs["steps_left"] = torch.full((3,), n, dtype=torch.int64)
    batch = SimpleNamespace(**inputs)
    unrolled = multistep_phase(forward, n).forward(batch)
    step = multistep_phase(forward, n, compile_step_once=True).forward
    torch.compiler.reset()
    once = torch.compile(step, backend=keep, fullgraph=True)(batch)
    assert torch.equal(once["tokens"], unrolled["tokens"])
    nodes = graphs[0].graph.nodes
    calls = [x for x in nodes if x.op == "call_function" and "invoke_subgraph" in str(x.target)]
    assert len(calls) == n
    assert len({x.args[0].target for x in calls}) == 1  # one subgraph, called at every step
