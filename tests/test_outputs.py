"""Declared outputs: replay slices each output by its declared batch axis and
rows per request, on every mechanism; a shape that disagrees with its
declaration is an error at capture, never a silent wrong slice."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from conftest import RUNNER_PARAMS, make_runner, runner_device
from graphrunner import BufferSpec, GraphRunner, OutputSpec, PadRule, create_runner
from graphrunner.declare import OutputDeclarationError
from graphrunner.declare.buffers import BufferView

W, TOPK, STEPS, HIDDEN = 3, 2, 5, 6
SIZES = [2, 4]
POISON = 7


def specs() -> list[BufferSpec]:
    """A per-request, a per-token (W) and a per-candidate (TOPK) buffer at once."""
    return [
        BufferSpec("req_pool_indices", torch.int64, PadRule.ZERO),
        BufferSpec("accept_lens", torch.int64, PadRule.WIDTH, width=W),
        BufferSpec("input_ids", torch.int64, PadRule.ZERO, rows_per_request=W),
        BufferSpec(
            "hidden", torch.float32, PadRule.ZERO, rows_per_request=W, extra_shape=(HIDDEN,)
        ),
        BufferSpec("topk_ids", torch.int64, PadRule.ZERO, rows_per_request=TOPK),
    ]


def draft_forward(b: object) -> dict[str, torch.Tensor]:
    """Every output a function of its own request's rows only."""
    req = b.req_pool_indices  # type: ignore[attr-defined]
    bs = req.shape[0]
    per_req = b.input_ids.view(bs, W).sum(1) + req * 1000 + b.accept_lens  # type: ignore[attr-defined]
    cands = b.topk_ids.view(bs, TOPK) + per_req[:, None]  # type: ignore[attr-defined]
    steps = torch.arange(STEPS, device=req.device)[:, None, None] * 10
    return {
        "draft_tokens": cands[None] + steps,  # [steps, bs, topk]
        "hidden_out": b.hidden * 2 + 1,  # type: ignore[attr-defined]  # [bs * W, hidden]
        "flat_topk": cands.reshape(-1),  # [bs * topk]
        "scale": torch.ones((), device=req.device),  # no batch axis
        # [steps, bs * W, hidden]: a batch axis of 1 with W rows per request
        "steps_hidden": b.hidden[None] * 3 + steps.float(),  # type: ignore[attr-defined]
    }


OUTPUTS = {
    "draft_tokens": OutputSpec(batch_axis=1),
    "hidden_out": OutputSpec(rows_per_request=W),
    "flat_topk": OutputSpec(rows_per_request=TOPK),
    "scale": OutputSpec(batch_axis=None),
    "steps_hidden": OutputSpec(batch_axis=1, rows_per_request=W),
}


def live_inputs(raw_bs: int, device: str) -> SimpleNamespace:
    g = torch.Generator().manual_seed(raw_bs)

    def ints(n: int) -> torch.Tensor:
        return torch.randint(1, 50, (n,), generator=g).to(device)

    return SimpleNamespace(
        batch_size=raw_bs,
        req_pool_indices=ints(raw_bs),
        accept_lens=ints(raw_bs) % W + 1,
        input_ids=ints(raw_bs * W),
        hidden=torch.randn(raw_bs * W, HIDDEN, generator=g).to(device),
        topk_ids=ints(raw_bs * TOPK),
    )


@pytest.fixture(scope="module", params=RUNNER_PARAMS)
def draft_runner(request: pytest.FixtureRequest) -> Iterator[GraphRunner]:
    runner = make_runner(
        request.param, draft_forward, specs(), capture_sizes=SIZES, outputs=OUTPUTS
    )
    runner.capture()
    yield runner


@pytest.mark.parametrize("raw_bs", range(1, SIZES[-1] + 1))
def test_declared_outputs_replay_padded_with_the_live_slices(
    draft_runner: GraphRunner, raw_bs: int
):
    inputs = live_inputs(raw_bs, str(draft_runner.device))
    expected = draft_forward(inputs)  # eager, unpadded
    for t in draft_runner.buffers.tensors.values():
        t.fill_(POISON)  # stale tails: a padded row keeping them would show
    out = draft_runner.replay(inputs)
    assert isinstance(out, dict)
    assert out["draft_tokens"].shape == (STEPS, raw_bs, TOPK)
    assert out["hidden_out"].shape == (raw_bs * W, HIDDEN)
    assert out["flat_topk"].shape == (raw_bs * TOPK,)
    assert out["scale"].shape == ()
    assert out["steps_hidden"].shape == (STEPS, raw_bs * W, HIDDEN)
    for name, value in expected.items():
        torch.testing.assert_close(out[name], value, rtol=0, atol=0, msg=name)
    # The padded tail of the width buffer holds the width.
    bs = draft_runner.graph_size_for(raw_bs)
    assert draft_runner.buffers.tensors["accept_lens"][raw_bs:bs].tolist() == [W] * (bs - raw_bs)


def capture_with(forward: object, outputs: object = None) -> GraphRunner:
    runner = create_runner(
        forward,  # type: ignore[arg-type]
        specs(),
        device="cpu",
        capture_sizes=SIZES,
        outputs=outputs,  # type: ignore[arg-type]
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    return runner


def test_an_undeclared_draft_loop_output_is_an_error_at_capture_not_an_empty_slice():
    def steps_first(b: BufferView) -> torch.Tensor:
        return draft_forward(b)["draft_tokens"]  # [steps, bs, topk], axis 0 is not bs

    with pytest.raises(OutputDeclarationError, match=r"shape \(5, 4, 2\): expected 4 rows"):
        capture_with(steps_first)
    runner = capture_with(steps_first, OutputSpec(batch_axis=1))
    assert runner.replay(live_inputs(3, "cpu")).shape == (STEPS, 3, TOPK)


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ({**OUTPUTS, "hidden_out": OutputSpec()}, r"'hidden_out' has shape \(12, 6\): expected 4"),
        ({**OUTPUTS, "flat_topk": OutputSpec(rows_per_request=W)}, "rows_per_request=3"),
        ({**OUTPUTS, "scale": OutputSpec()}, r"batch_axis=0 is out of range for 0 dims"),
        ({k: v for k, v in OUTPUTS.items() if k != "scale"}, "returned keys .* declared for"),
        (tuple(OUTPUTS.values()), "returned a dict; outputs were declared as a tuple"),
    ],
)
def test_a_mismatching_declaration_is_a_clear_error_at_capture(outputs: object, message: str):
    with pytest.raises(OutputDeclarationError, match=message):
        capture_with(draft_forward, outputs)


def test_a_failed_declaration_check_leaves_nothing_captured():
    runner = create_runner(
        draft_forward, specs(), device="cpu", capture_sizes=SIZES, show_progress=False, kind="eager"
    )
    with pytest.raises(OutputDeclarationError):
        runner.capture()
    assert not runner.is_captured and runner.capture_report is None


def test_tuple_outputs_are_declared_per_element():
    def pair(b: BufferView) -> tuple[torch.Tensor, torch.Tensor]:
        out = draft_forward(b)
        return out["hidden_out"], out["draft_tokens"]

    runner = capture_with(pair, (OutputSpec(rows_per_request=W), OutputSpec(batch_axis=-2)))
    hidden, draft = runner.replay(live_inputs(1, "cpu"))
    assert hidden.shape == (W, HIDDEN) and draft.shape == (STEPS, 1, TOPK)
    with pytest.raises(OutputDeclarationError, match="returned 2 outputs; 1 were declared"):
        capture_with(pair, (OutputSpec(),))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows_per_request": 0}, "rows_per_request=0; expected an int >= 1"),
        ({"batch_axis": 1.0}, "batch_axis=1.0; expected an int or None"),
        ({"batch_axis": True}, "batch_axis=True"),
    ],
)
def test_bad_output_specs_are_refused(kwargs: dict[str, object], message: str):
    with pytest.raises(ValueError, match=message):
        OutputSpec(**kwargs)  # type: ignore[arg-type]


def test_an_output_declaration_must_be_specs():
    with pytest.raises(TypeError, match="expected OutputSpec, got int"):
        capture_with(draft_forward, {"draft_tokens": 1})


def test_runner_device_helper_is_consistent():
    assert runner_device("cuda+compile") == "cuda" and runner_device("cpu") == "cpu"
