"""Sampling parameters: validated where they are made, declared as buffers
whose pad values sample finite numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from graphrunner.declare.buffers import PadRule, StaticBuffers
from graphrunner.sampling import (
    SAMPLING_FIELD_NAMES,
    SAMPLING_FIELDS,
    SamplingParams,
    filtered_probs,
    logprobs,
    sample,
    sampling_tensors,
)
from graphrunner.writers.base import populate


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"temperature": -0.1}, ["temperature=-0.1", ">= 0"]),
        ({"temperature": math.inf}, ["temperature=inf", "finite"]),
        ({"temperature": math.nan}, ["temperature=nan", "finite"]),
        ({"temperature": "1"}, ["temperature='1'"]),
        ({"top_k": -1}, ["top_k=-1", ">= 0"]),
        ({"top_k": True}, ["top_k=True", "an int"]),
        ({"top_k": 2.0}, ["top_k=2.0", "an int"]),
        ({"top_p": 0.0}, ["top_p=0.0", "(0, 1]"]),
        ({"top_p": 1.5}, ["top_p=1.5", "(0, 1]"]),
        ({"top_p": math.nan}, ["top_p=nan", "(0, 1]"]),
        ({"min_p": -0.01}, ["min_p=-0.01", "[0, 1]"]),
        ({"min_p": 1.01}, ["min_p=1.01", "[0, 1]"]),
        ({"seed": -1}, ["seed=-1", "[0, 2**63)"]),
        ({"seed": 2**63}, [f"seed={2**63}", "[0, 2**63)"]),
        ({"seed": True}, ["seed=True"]),
        ({"seed": 1.0}, ["seed=1.0"]),
    ],
)
def test_out_of_range_params_are_refused_naming_field_value_and_range(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_params_defaults_are_greedy_and_edges_are_accepted():
    assert SamplingParams().greedy
    assert SamplingParams() == SamplingParams(0.0, 0, 1.0, 0.0, None)
    edge = SamplingParams(temperature=0, top_k=0, top_p=1, min_p=1, seed=2**63 - 1)
    assert edge.greedy and edge.seed == 2**63 - 1
    assert not SamplingParams(temperature=1e-3, top_p=1e-6, min_p=0).greedy
    with pytest.raises(AttributeError):
        edge.temperature = 1.0  # type: ignore[misc]


def test_sampling_fields_declare_each_parameter_with_a_finite_pad_value():
    specs = {s.name: s for s in SAMPLING_FIELDS}
    assert SAMPLING_FIELD_NAMES == ("temperature", "top_k", "top_p", "min_p", "sampling_seed")
    expected = {
        "temperature": (torch.float32, PadRule.FILL, 1.0),
        "top_k": (torch.int64, PadRule.FILL, 1),
        "top_p": (torch.float32, PadRule.FILL, 1.0),
        "min_p": (torch.float32, PadRule.ZERO, 0),
        "sampling_seed": (torch.int64, PadRule.ZERO, 0),
    }
    for name, (dtype, rule, pad) in expected.items():
        spec = specs[name]
        assert (spec.dtype, spec.rule, spec.pad_value()) == (dtype, rule, pad), name
        assert spec.rows_per_request == 1 and not spec.index and not spec.host


def test_sampling_tensors_builds_one_row_per_request():
    params = [SamplingParams(), SamplingParams(0.7, 40, 0.9, 0.05, seed=3)]
    rows = sampling_tensors(params, [11, 2**63 - 1], "cpu")
    assert list(rows) == list(SAMPLING_FIELD_NAMES)
    assert rows["temperature"].tolist() == [0.0, pytest.approx(0.7)]
    assert rows["top_k"].tolist() == [0, 40]
    assert rows["top_p"].tolist() == [1.0, pytest.approx(0.9)]
    assert rows["min_p"].tolist() == [0.0, pytest.approx(0.05)]
    assert rows["sampling_seed"].tolist() == [11, 2**63 - 1]
    for spec in SAMPLING_FIELDS:
        assert rows[spec.name].dtype == spec.dtype and rows[spec.name].shape == (2,)
    with pytest.raises(ValueError, match="2 params but 1 seeds"):
        sampling_tensors(params, [1], "cpu")
    with pytest.raises(ValueError, match=r"seeds\[1\]=-5"):
        sampling_tensors(params, [1, -5], "cpu")
    with pytest.raises(TypeError, match=r"params\[0\]"):
        sampling_tensors([{"temperature": 1.0}], [1], "cpu")  # type: ignore[list-item]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_padded_rows_compute_finite_values(dtype):
    """Rows holding the declared pad values, whatever the logits (even all
    equal, very large or very small), give an in-range token, a finite
    distribution and finite log-probabilities."""
    g = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.cat(
        [
            torch.randn(3, vocab, generator=g) * 5,
            torch.zeros(1, vocab),
            torch.full((1, vocab), -1e4),
            torch.linspace(-6e4, 6e4, vocab)[None],
        ]
    ).to(dtype)
    n = logits.shape[0]
    pad = {s.name: torch.full((n,), s.pad_value(), dtype=s.dtype) for s in SAMPLING_FIELDS}
    args = (pad["temperature"], pad["top_k"], pad["top_p"], pad["min_p"])
    position = torch.zeros(n, dtype=torch.int64)
    tokens = sample(logits, *args, pad["sampling_seed"], position)
    probs = filtered_probs(logits, *args)
    assert torch.isfinite(probs).all()
    # top-k 1 keeps the maximum (and its ties: the constant rows keep every token)
    assert torch.equal(logits.gather(-1, tokens[:, None])[:, 0], logits.amax(-1))
    assert torch.allclose(probs.sum(-1), torch.ones(n))
    out = logprobs(logits, tokens, 5)
    assert torch.isfinite(out.chosen).all() and torch.isfinite(out.top).all()


def test_populate_pads_the_sampling_buffers_and_live_rows_sample_as_unpadded():
    """The declared fields through the one populate routine: the padded tail
    holds the pad values over poisoned buffers, and the live rows' tokens
    equal those of the unpadded batch."""
    buffers = StaticBuffers(SAMPLING_FIELDS, 8, "cpu")
    for tensor in buffers.tensors.values():
        tensor.fill_(-7)  # stale values a pad rule must overwrite
    params = [SamplingParams(0.8, 5, 0.9, 0.05), SamplingParams(), SamplingParams(1.2, 0, 0.5)]
    rows = sampling_tensors(params, [3, 4, 2**62], "cpu")
    populate(buffers, SimpleNamespace(**rows), 3, 8)
    view = buffers.view(8).tensors()
    for spec in SAMPLING_FIELDS:
        assert torch.equal(view[spec.name][:3], rows[spec.name]), spec.name
        assert (view[spec.name][3:] == spec.pad_value()).all(), spec.name
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 64, generator=g) * 3
    position = torch.tensor([10, 11, 12, 0, 0, 0, 0, 0])
    names = ("temperature", "top_k", "top_p", "min_p", "sampling_seed")
    padded = sample(logits, *(view[n] for n in names), position)
    live = sample(logits[:3], *(rows[n] for n in names), position[:3])
    assert torch.equal(padded[:3], live)
    assert ((padded >= 0) & (padded < 64)).all()
    assert torch.isfinite(filtered_probs(logits, *(view[n] for n in names[:4]))).all()
