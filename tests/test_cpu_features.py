"""A half-precision model on a CPU without native units gets one note naming
the CPU, the dtype and the fast path; none where the units exist, for float32,
on CUDA, or with --quiet."""

from __future__ import annotations

import argparse

import pytest
import torch

from graphrunner_ref.cli.model_args import note_half_precision
from graphrunner_ref.model.cpu_features import half_precision_note, half_precision_units


def _units(monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "units"),
    [(True, True, ["AMX", "AVX-512-bf16"]), (False, True, ["AVX-512-bf16"]), (False, False, [])],
)
def test_the_units_are_read_from_torch(
    monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool, units: list[str]
) -> None:
    _units(monkeypatch, amx, avx512_bf16)
    assert half_precision_units() == units


def test_a_cpu_without_units_gets_a_note_naming_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    _units(monkeypatch, False, False)
    note = half_precision_note(torch.bfloat16, "cpu")
    capability = torch.backends.cpu.get_cpu_capability()
    assert note is not None and note.startswith(f"note: this CPU ({capability}) has no AMX")
    assert "--dtype bfloat16 saves memory, --dtype float32 --quantize fp16" in note
    assert "float16 matmuls" in (half_precision_note(torch.float16, "cpu") or "")
    assert half_precision_note(torch.float32, "cpu") is None
    assert half_precision_note(torch.bfloat16, "cuda:0") is None
    _units(monkeypatch, True, False)
    assert half_precision_note(torch.bfloat16, "cpu") is None


@pytest.mark.parametrize("quiet", [False, True])
def test_the_cli_prints_it_once_unless_quiet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], quiet: bool
) -> None:
    _units(monkeypatch, False, False)
    note_half_precision(argparse.Namespace(dtype="bfloat16", device="cpu", quiet=quiet))
    err = capsys.readouterr().err
    assert err.count("graphrunner: note: this CPU") == (0 if quiet else 1)
