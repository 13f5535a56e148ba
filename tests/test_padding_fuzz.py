"""The padding fuzz (:mod:`padding_fuzz`) on every phase and mechanism: every
captured size replayed with fewer live rows and with as many, each buffer's
tail poisoned (NaN, inf, -1, out of range, live and bystander indices), with
the sanitizer on and on the lean path without it; live outputs equal to
eager, no state row corrupted.

Every phase on every mechanism, the compiled CPU runner included (its sizes
1, 2 and 4 share one compilation); ``bench/bench_padding_fuzz.py`` times it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from conftest import HAS_CUDA
from fuzz_cases import MECHANISMS, PHASES, FuzzCase, make_case
from graphrunner import Phase
from padding_fuzz import PATHS, PATTERNS, fuzz

EAGER_SIZES = [1, 2, 4]
COMPILED_SIZES = [1, 2, 4]


def _params() -> list[object]:
    params: list[object] = []
    for label in MECHANISMS:
        cuda = label.startswith("cuda")
        if cuda and not HAS_CUDA:
            continue
        for phase in PHASES:
            marks = [pytest.mark.cuda] if cuda else []
            params.append(pytest.param(phase, label, marks=marks, id=f"{phase}-{label}"))
    return params


@pytest.mark.padded
@pytest.mark.parametrize(("phase", "label"), _params())
def test_poisoned_tails_never_reach_live_rows_or_state(phase: str, label: str) -> None:
    sizes = EAGER_SIZES if label == "eager" else COMPILED_SIZES
    counts = fuzz(lambda: make_case(phase, label, sizes), label)
    assert counts.clean, "\n".join(counts.failures)
    live = range(1, sizes[-1] + 1)
    assert counts.sizes == [(min(s for s in sizes if s >= n), n) for n in live]
    assert counts.paths == list(PATHS)
    assert counts.replays == len(live) * len(PATTERNS) * len(PATHS)
    assert counts.live_rows == sum(live) * len(PATTERNS) * len(PATHS)


class _SkipsTail:
    """A populate that leaves one buffer's padded tail as it found it."""

    def __init__(self, case: FuzzCase, name: str) -> None:
        self.inner, self.buffers, self.name = case.runner.writer, case.runner.buffers, name

    def write(self, sources: Sequence[torch.Tensor], raw_bs: int, bs: int) -> int:
        spec = next(s for s in self.buffers.specs if s.name == self.name)
        tail = self.buffers.tensors[self.name][spec.rows(raw_bs) :]
        kept = tail.clone()
        ops = self.inner.write(sources, raw_bs, bs)
        tail.copy_(kept)
        return ops


@pytest.mark.parametrize(
    ("phase", "field", "finding"),
    [
        ("decode", "out_cache_loc", "corruptions"),
        ("eagle_decode", "out_cache_loc", "corruptions"),
        ("mamba_decode", "mamba_track_mask", "corruptions"),
        ("verify", "out_cache_loc", "corruptions"),
        ("eagle_extend", "accept_lens", "errors"),
    ],
)
def test_the_fuzz_sees_a_populate_that_skips_a_tail(phase: str, field: str, finding: str) -> None:
    """Without the sanitizer, the fuzz's own comparisons find the poison a
    populate left behind (a padded row writing live state, or an index out of
    range reaching a kernel); with it, the sanitizer refuses every padded replay."""

    def broken() -> FuzzCase:
        case = make_case(phase, "eager", [4], sanitize=False)
        case.runner.writer = _SkipsTail(case, field)
        return case

    counts = fuzz(broken, "eager", paths=["lean"])
    assert getattr(counts, finding) > 0, counts
    with_sanitizer = fuzz(
        lambda: _with_skip(make_case(phase, "eager", [4]), field), "eager", paths=["sanitized"]
    )
    # The sanitizer refuses the poison before launch (where it differs from
    # the pad value), so nothing reaches the state.
    assert with_sanitizer.violations > 0, with_sanitizer
    assert with_sanitizer.mismatches == with_sanitizer.corruptions == with_sanitizer.errors == 0


def _with_skip(case: FuzzCase, field: str) -> FuzzCase:
    case.runner.writer = _SkipsTail(case, field)
    return case


def _rows_mix(forward: Any) -> Any:
    """``forward`` with a planted read bug: every float output row gains the
    batch's mean, padded rows included."""

    def mixed(b: Any) -> Any:
        out = forward(b)
        if isinstance(out, torch.Tensor):
            return out + out.mean(0, keepdim=True) if out.is_floating_point() else out
        if isinstance(out, dict):
            name = next((k for k, v in out.items() if v.is_floating_point()), None)
            if name is not None:
                out = {**out, name: out[name] + out[name].mean(0, keepdim=True)}
        return out

    return mixed


@pytest.mark.parametrize("phase", PHASES)
def test_the_fuzz_sees_a_planted_read_bug_on_every_phase(
    phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that mix write nothing they do not own: only the sanitizer's read
    check (a relaunch with the sinks and padded rows changed) can see them;
    it refuses them on every phase, and the same fuzz without the bug is clean."""
    real = FuzzCase.build

    def build(self: FuzzCase, phase_value: Phase, *args: Any, **kwargs: Any) -> None:
        planted = dataclasses.replace(phase_value, forward=_rows_mix(phase_value.forward))
        real(self, planted, *args, **kwargs)

    monkeypatch.setattr(FuzzCase, "build", build)
    counts = fuzz(lambda: make_case(phase, "eager", [4]), "eager", paths=["sanitized"])
    assert counts.violations > 0, counts


class _OnePast:
    """A phase's inputs with every length one longer: attention then reads one
    column past each live row's cache (that column is the sink, or no slot
    its request owns)."""

    def __init__(self, b: Any) -> None:
        self.b = b

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.b, name)
        return value + 1 if name == "seq_lens" else value


#: The phases whose attention reads each row's cache up to ``seq_lens`` (the
#: verify and extend phases read by their own per-token positions, Mamba
#: reads no KV, MTP its frozen cache).
READS_BY_LENGTH = ("decode", "sampled_decode", "eagle_decode")


@pytest.mark.parametrize("phase", READS_BY_LENGTH)
def test_the_fuzz_sees_an_off_by_one_length_on_every_phase_it_applies_to(
    phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An off-by-one length writes nothing it does not own and equals its own
    eager run: only the read check sees it, on every phase that reads by length."""
    real = FuzzCase.build

    def build(self: FuzzCase, phase_value: Phase, *args: Any, **kwargs: Any) -> None:
        planted = dataclasses.replace(
            phase_value, forward=lambda b, f=phase_value.forward: f(_OnePast(b))
        )
        real(self, planted, *args, **kwargs)

    monkeypatch.setattr(FuzzCase, "build", build)
    counts = fuzz(lambda: make_case(phase, "eager", [4]), "eager", paths=["sanitized"])
    assert counts.violations > 0 and counts.mismatches == counts.errors == 0, counts
