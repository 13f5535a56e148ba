"""Programmatic dependent launch (PDL) of the model's Triton kernels.

On the CPU: the switch and its refusals (the kernels' Hopper code with and
without the wait and release is checked in the kernels' own compile tests).
On a Hopper GPU (``cuda``-marked): a chain of dependent kernels launched
early inside a CUDA graph reads what its predecessor wrote (the buffer
between them poisoned before every replay), bit-equal to plain launches; and
a model whose Triton kernels launch programmatically (then inductor's too)
serves transformers' greedy tokens through padded replay with the sanitizer on.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_model
from graphrunner_ref.model import LlamaDecoder, default_model
from graphrunner_ref.model.kernels.decode_attention import decode_attention
from graphrunner_ref.model.kernels.gemv import gemv
from graphrunner_ref.model.kernels.pdl import INDUCTOR_OPTIONS, triton_launch
from graphrunner_ref.model.llama import LlamaDecoderLayer, use_small_batch_linears
from graphrunner_ref.model.programmatic_launch import use_programmatic_launch
from hf_tiny import hf_greedy, save_tiny_llama


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _flags(model: LlamaDecoder) -> set[bool]:
    layers = [cast(LlamaDecoderLayer, layer) for layer in model.model.layers]
    return {
        model.programmatic_launch,
        model.attn_backend.programmatic_launch,
        *(layer.programmatic_launch for layer in layers),
    }


def test_the_switch_sets_every_kernel_and_refuses_what_cannot_launch_early() -> None:
    model = default_model(max_requests=2, max_context_len=16).model
    assert _flags(model) == {False}  # off by default
    with pytest.raises(ValueError, match=r"enabled='yes': expected a bool"):
        use_programmatic_launch(model, "yes")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"use_programmatic_launch: programmatic dependent launch on cpu: expected a "
        r"CUDA device of compute capability 9\.0",
    ):
        use_programmatic_launch(model)
    assert _flags(model) == {False}  # nothing half-set by the refusal
    model.programmatic_launch = model.attn_backend.programmatic_launch = True
    use_programmatic_launch(model, False)
    assert _flags(model) == {False}


def test_kernels_refuse_an_early_launch_off_hopper() -> None:
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"gemv: programmatic dependent launch on cpu"):
        gemv(x, w, pdl=True)
    q, kv = torch.randn(1, 2, 16), torch.randn(4, 1, 16)
    r2t, rows = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"decode_attention: programmatic dependent launch"):
        decode_attention(q, kv, kv, r2t, rows, rows + 1, scale=1.0, num_splits=1, pdl=True)


def test_launch_arguments_carry_the_prologue_and_the_attribute_together() -> None:
    assert triton_launch(False) == {"PDL": False}
    assert triton_launch(True) == {"PDL": True, "launch_pdl": True}
    assert INDUCTOR_OPTIONS == {"triton.enable_pdl": True}


@pytest.mark.cuda
def test_a_dependent_chain_launched_early_reads_its_predecessors_writes() -> None:
    if not _hopper():
        pytest.skip("needs a CUDA device of compute capability 9.0+")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    x, w1, w2, w3 = rand(4, 2048), rand(4096, 2048), rand(2048, 4096), rand(2048, 2048)
    outputs = []
    for pdl in (False, True):
        h1, h2, h3 = (x.new_empty(4, n) for n in (4096, 2048, 2048))

        def chain(h1=h1, h2=h2, h3=h3, pdl=pdl) -> None:  # type: ignore[no-untyped-def]
            gemv(x, w1, out=h1, pdl=pdl)
            gemv(h1, w2, out=h2, pdl=pdl)
            gemv(h2, w3, residual=h2, out=h3, pdl=pdl)

        chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        for _ in range(20):
            h1.fill_(float("nan"))  # what a kernel started too early would read
            h2.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
        assert h3.isfinite().all(), pdl
        outputs.append(h3.clone())
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.cuda
@pytest.mark.parametrize("inductor_too", [False, True])
def test_served_tokens_equal_transformers_with_kernels_launched_early(
    tmp_path: Path, inductor_too: bool
) -> None:
    """Ours launched early (their contract: wait first), and then inductor's
    too (its own placement of the waits)."""
    if not _hopper():
        pytest.skip("needs a CUDA device of compute capability 9.0+")
    hf = save_tiny_llama(tmp_path)
    hf.generation_config.eos_token_id = None
    trace = [Request(0, (3, 1, 4, 1, 5), 6), Request(1, (9, 2, 6), 4), Request(2, (7,), 5)]
    bundle = load_model(tmp_path, max_requests=4, max_context_len=32, device="cuda")
    use_small_batch_linears(bundle.model, 2)  # sizes 1 and 2 through the kernels, 4 not
    use_programmatic_launch(bundle.model)
    runner = create_decode_runner(
        bundle,
        "cuda",
        capture_sizes=[1, 2, 4],
        compile=True,
        inductor_options=INDUCTOR_OPTIONS if inductor_too else None,
        check_padding=True,
    )
    runner.capture()
    result = Engine(bundle, runner).run(trace)
    expected = hf_greedy(hf, trace)
    assert result.outputs == {r.rid: expected[r.rid] for r in trace}
    assert {1, 2, 3} <= result.stats.batch_sizes.keys()
