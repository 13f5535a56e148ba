"""Mixture-of-experts decoders through the bridge: each row runs its own top-k
experts (:mod:`graphrunner_ref.bridge.experts`), so a live row's output does
not depend on which experts its neighbours, padded rows included, chose.

transformers' own dispatch groups the step's rows by expert: the shapes of the
expert products, and the bits of a row, follow the other rows' routing. Here a
row's logits are bit-equal whether its neighbours in a step of the same size
are padding or other requests; padded replay under the sanitizer equals
transformers' greedy ``generate`` on the eager and the compiled CPU runner.
(Between different batch sizes no dense product is bit-stable either: a
one-row product takes another kernel than a four-row one.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graphrunner_ref import Engine, create_decode_runner
from graphrunner_ref.bridge import load_transformers
from graphrunner_ref.bridge.experts import EXPERTS, row_experts_forward
from hf_tiny import hf_greedy, mixed_trace, save_decoders, tiny_config

transformers = pytest.importorskip("transformers")

#: transformers ``model_type`` -> its expert arguments (4 experts, top 2).
MOE: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {  # a shared expert behind its own gate, an expert bias-free MLP
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, "norm_topk_prob": True},
    "olmoe": {"num_experts": 4},
}
TRACE = mixed_trace()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    configs = {t: tiny_config(t, num_experts_per_tok=2, **extra) for t, extra in MOE.items()}
    return save_decoders(tmp_path_factory, configs)


@pytest.mark.parametrize("arch", sorted(MOE))
def test_padded_replay_equals_transformers_generate(
    arch: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    config: Any = bundle.model.hf.config
    assert config._experts_implementation == EXPERTS
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    result = Engine(bundle, runner).run(TRACE)
    assert result.outputs == hf_greedy(reference, TRACE)
    assert runner.stats.padded_rows > 0
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked > 0


def test_the_compiled_cpu_runner_equals_transformers(saved: dict[str, tuple[Path, Any]]) -> None:
    path, reference = saved["qwen2_moe"]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    assert runner.compilations == 1
    assert Engine(bundle, runner).run(TRACE).outputs == hf_greedy(reference, TRACE)
    assert runner.stats.eager_fallbacks == 0 and runner.direct_fallbacks == 0


def _step_logits(bundle: Any, rows: list[int], tokens: list[int], lens: list[int]) -> torch.Tensor:
    """One decode step of 4 rows (the ones past ``rows`` padded: row 0, slot 0)."""
    pad = 4 - len(rows)
    table = bundle.req_pool.req_to_token
    slots = [int(table[r, n - 1]) for r, n in zip(rows, lens, strict=True)]
    step = SimpleNamespace(
        input_ids=torch.tensor(tokens + [0] * pad),
        positions=torch.tensor([n - 1 for n in lens] + [0] * pad),
        req_pool_indices=torch.tensor(rows + [0] * pad),
        seq_lens=torch.tensor(lens + [1] * pad),
        out_cache_loc=torch.tensor(slots + [0] * pad),
    )
    with torch.no_grad():
        return bundle.model.forward_decode(step)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_rows_logits_are_the_same_bits_whatever_its_neighbours(
    arch: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    path, _ = saved[arch]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    prompts = [[3, 17, 5, 9, 22, 7], [11, 2, 90], [40, 41, 42, 43, 44]]
    rows, lens = [], []
    for prompt in prompts:  # each prompt cached, one more slot for its next token
        row = bundle.req_pool.alloc(1)[0]
        slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt) + 1))
        bundle.model.forward_extend(row, torch.tensor(prompt), slots[:-1])
        bundle.req_pool.req_to_token[row, len(prompt)] = int(slots[-1])
        rows.append(row)
        lens.append(len(prompt) + 1)
    next_tokens = [60, 61, 62]
    alone = _step_logits(bundle, rows[:1], next_tokens[:1], lens[:1])[0]
    crowded = _step_logits(bundle, rows, next_tokens, lens)[0]
    shuffled = _step_logits(bundle, [rows[0], rows[2]], [60, 99], [lens[0], lens[2]])[0]
    assert torch.equal(alone, crowded) and torch.equal(alone, shuffled)


class _LargestNewTensor(TorchDispatchMode):
    """The most elements of any tensor an op allocated (views of its inputs excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        read = {_storage(t) for t in pytree.tree_leaves((args, kwargs))}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in read:
                self.largest = max(self.largest, t.numel())
        return out


def _storage(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def test_eagerly_a_rows_experts_are_read_in_place_never_copied(
    saved: dict[str, tuple[Path, Any]],
) -> None:
    path, _ = saved["mixtral"]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    experts = next(m for m in bundle.model.hf.modules() if hasattr(m, "gate_up_proj"))
    n_experts, hidden = experts.gate_up_proj.shape[0], experts.down_proj.shape[1]
    torch.manual_seed(0)
    x = torch.randn(6, hidden)
    index = torch.stack([torch.randperm(n_experts)[:2] for _ in range(6)])
    weights = torch.rand(6, 2)
    with torch.no_grad(), _LargestNewTensor() as seen:
        eager = row_experts_forward(experts, x, index, weights)
    # An eager gather copies [6, 2, ...] expert weights; in place, nothing
    # grows past one row's projections.
    assert seen.largest < experts.gate_up_proj[0].numel()
    with torch.no_grad(), mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        gathered = row_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(eager, gathered)
