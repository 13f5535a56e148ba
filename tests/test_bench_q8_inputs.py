"""``bench/bench_q8_inputs.py``'s configurations on the embedded model: each
kind's linear rebuilt with the same weights and the asked activations, and
the q/k/v-float32 configuration answering as ``quantize_model``'s int4-q8
model does, bit for bit, where that model's q/k/v inputs are float32 (a CPU
without AVX-512 BF16; with it they are bfloat16)."""

from __future__ import annotations

import torch

from bench.bench_q8_inputs import KINDS, with_float_inputs
from graphrunner_ref.model import default_model
from graphrunner_ref.model.int4_linear import Int4Linear
from graphrunner_ref.model.int4_q8 import Int4Q8Linear
from graphrunner_ref.model.quantize import bf16_units, quantize_model


def _q8_model() -> torch.nn.Module:
    bundle = default_model(max_requests=1)
    quantize_model(bundle.model, "int4-q8")
    return bundle.model


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.extend_hidden(1, torch.tensor(ids), torch.arange(1, len(ids) + 1))
        return model.logits(hidden)


def test_each_kind_takes_the_asked_inputs_over_the_same_weights() -> None:
    shipped, model = _q8_model(), _q8_model()
    with_float_inputs(model, ("down", "o"))
    for layer, same in zip(model.model.layers, shipped.model.layers, strict=True):
        for kind, (sub, attr) in KINDS.items():
            linear, before = getattr(getattr(layer, sub), attr), getattr(getattr(same, sub), attr)
            assert type(linear) is (Int4Linear if kind in ("down", "o") else Int4Q8Linear), kind
            assert torch.equal(linear.packed, before.packed), kind
            for name in ("scales", "mins"):  # the tiles path rounds them to float16
                torch.testing.assert_close(
                    getattr(linear, name), getattr(before, name), rtol=2**-11, atol=0
                )


def test_q_k_v_float_is_the_shipped_mode_without_bf16_units_and_every_8_bit_is_not() -> None:
    ids = [5, 9, 2, 44, 17, 3, 8]
    shipped = _logits(_q8_model(), ids)
    qkv_float = _logits(with_float_inputs(_q8_model(), ("qkv",)), ids)
    assert torch.equal(qkv_float, shipped) is not bf16_units()
    assert torch.equal(_logits(with_float_inputs(_q8_model(), None), ids), shipped)
    all_8bit = _logits(with_float_inputs(_q8_model(), ()), ids)
    assert not torch.equal(all_8bit, shipped)
