"""``python -m graphrunner demo`` and ``generate``: output, and errors found before any work."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import graphrunner_ref.cli.checks as cli_checks
import graphrunner_ref.cli.demo as cli_demo
import graphrunner_ref.cli.main as cli
import graphrunner_ref.engine.memory as memory
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import requests_from_prompts, synthetic_trace
from graphrunner_ref.io import save_checkpoint
from graphrunner_ref.model import ModelBundle, default_config, default_model
from test_engine import StrayWriter

PROMPTS = [[1, 2, 3], [200], [7, 7, 7, 7, 7, 7, 7, 7], [0, 255, 9, 4]]
EAGER = ["--runner", "eager", "--capture-sizes", "1,2,4"]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def _expected(max_new_tokens: int) -> list[list[int]]:
    bundle = default_model(max_requests=4)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    trace = requests_from_prompts(PROMPTS, max_new_tokens=max_new_tokens)
    outputs = Engine(bundle, runner).run(trace).outputs
    return [outputs[i] for i in range(len(PROMPTS))]


def test_generate_prints_greedy_tokens_in_prompt_order(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(
        [
            "generate",
            "--prompts",
            str(prompts_file),
            "--max-new-tokens",
            "6",
            "--arrive-every",
            "2",
            *EAGER,
        ]
    )
    assert rc == 0
    lines = _lines(capsys.readouterr().out)
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    assert [line["token_ids"] for line in lines] == _expected(6)


def test_generate_from_a_checkpoint_and_the_cpu_runner_writes_output(
    prompts_file: Path, tmp_path: Path
) -> None:
    save_checkpoint(default_model(max_requests=1).model, tmp_path / "ckpt")
    out = tmp_path / "out.jsonl"
    rc = cli.main(
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--prompts",
            str(prompts_file),
            "--max-new-tokens",
            "5",
            "--output",
            str(out),
            "--runner",
            "cpu",
            "--capture-sizes",
            "2,4",
            "--check",
        ]
    )
    assert rc == 0
    assert [line["token_ids"] for line in _lines(out.read_text())] == _expected(5)


#: Prompt files generate refuses (exit 2) before any work: (content, the error).
BAD_PROMPT_FILES = [
    ("[1, 2]\n[3, 4\n", r"prompts.jsonl:2: not valid JSON"),
    ("[1, 2]\n\n[3, 256]\n", r"prompts.jsonl:3: token 1 = 256 is not a token id in 0..255"),
    ("[1, -1]\n", r"prompts.jsonl:1: token 1 = -1"),
    ('[1, "a"]\n', r"prompts.jsonl:1: token 1 = 'a'"),
    ('{"ids": [1]}\n', r"prompts.jsonl:1: expected a non-empty JSON list"),
    ("[]\n", r"prompts.jsonl:1: expected a non-empty JSON list"),
    (
        "[1]\n" + json.dumps([5] * 250) + "\n",
        r"prompts.jsonl:2: prompt of 250 tokens \+ 128 new "
        r"tokens needs a context of 377, longer than the model's 256",
    ),
    ("\n", r"has no prompts"),
    ("[" * 100_000 + "]" * 100_000 + "\n", r"prompts.jsonl:1: .*nested too deeply"),
    ("[1" + "0" * 5000 + "]\n", r"prompts.jsonl:1: .*(digits|token 0 = )"),
    ("\ufeff[1, 2]\n[3, 256]\n", r"prompts.jsonl:2: token 1 = 256"),  # BOM: line 1 is fine
]


@pytest.mark.parametrize("content, match", BAD_PROMPT_FILES)
def test_generate_rejects_bad_prompts_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    content: str,
    match: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert cli.main(["generate", "--prompts", str(path), *EAGER]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(match, captured.err), captured.err


@pytest.mark.parametrize(
    "args, match",
    [
        (["generate", "--prompts", "nowhere.jsonl"], "prompts file 'nowhere.jsonl' not found"),
        (["demo", "--capture-sizes", "1,x"], "--capture-sizes '1,x'"),
        (["demo", "--capture-sizes", "1,2", "--max-bs", "4"], "--max-bs 4"),
        (["demo", "--runner", "cuda", "--device", "cpu"], "--runner cuda does not run on"),
        (["demo", "--checkpoint", "no/such/dir"], "--checkpoint no/such/dir: no such file"),
        (["demo", "--steps", "0"], "--steps 0"),
        (["demo", "--threads", "0"], "--threads 0: expected 1.."),
        (["demo", "--page-size", "0"], "--page-size 0: expected 1..256 (the model's context)"),
        (["demo", "--device", "meta"], "--device 'meta': expected cpu, cuda or cuda:N"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(
    args: list[str],
    match: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    assert cli.main(args) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize(
    "runner, device, on_gpu_host, on_cpu_host",
    [
        (None, None, ("cuda", "cuda"), ("cpu", "cpu")),
        ("cpu", None, ("cpu", "cpu"), ("cpu", "cpu")),
        ("eager", None, ("eager", "cpu"), ("eager", "cpu")),
        ("cuda", None, ("cuda", "cuda"), None),
        (None, "cpu", ("cpu", "cpu"), ("cpu", "cpu")),
        ("eager", "cpu", ("eager", "cpu"), ("eager", "cpu")),
        (None, "cuda:1", ("cuda", "cuda:1"), None),
        ("cuda", "cuda", ("cuda", "cuda"), None),
        ("eager", "cuda", ("eager", "cuda"), None),
        ("eager", "cuda:0", ("eager", "cuda:0"), None),
    ],
)
def test_resolve_device_follows_whichever_of_runner_and_device_is_given(
    cuda: bool,
    runner: str | None,
    device: str | None,
    on_gpu_host: tuple[str, str],
    on_cpu_host: tuple[str, str] | None,
) -> None:
    expected = on_gpu_host if cuda else on_cpu_host
    if expected is None:
        with pytest.raises(cli.UsageError, match="no CUDA device is available"):
            cli.resolve_device(runner, device, cuda_available=cuda)
    else:
        assert cli.resolve_device(runner, device, cuda_available=cuda) == expected


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize(
    "runner, device, message",
    [
        ("cpu", "cuda", "--runner cpu does not run on --device cuda: expected --device cpu"),
        ("cpu", "cuda:1", "--runner cpu does not run on --device cuda:1: expected --device cpu"),
        (
            "cuda",
            "cpu",
            "--runner cuda does not run on --device cpu: expected --device cuda or cuda:N",
        ),
        ("eager", "meta", "--device 'meta': expected cpu, cuda or cuda:N"),
        (None, "cuda:", "--device 'cuda:': expected cpu, cuda or cuda:N"),
    ],
)
def test_resolve_device_refuses_a_pair_that_cannot_run(
    cuda: bool, runner: str | None, device: str, message: str
) -> None:
    with pytest.raises(cli.UsageError) as error:
        cli.resolve_device(runner, device, cuda_available=cuda)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "runner, device, message",
    [
        ("cuda", None, "--runner cuda: no CUDA device is available; expected cpu or eager"),
        ("cuda", "cuda:0", "--runner cuda: no CUDA device is available; expected cpu or eager"),
        (None, "cuda", "--device cuda: no CUDA device is available; expected cpu"),
        ("eager", "cuda:1", "--device cuda:1: no CUDA device is available; expected cpu"),
    ],
)
def test_resolve_device_without_cuda_names_what_asked_for_it(
    runner: str | None, device: str | None, message: str
) -> None:
    with pytest.raises(cli.UsageError) as error:
        cli.resolve_device(runner, device, cuda_available=False)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "argv, kind, device",
    [
        (["--runner", "cpu"], "cpu", "cpu"),
        (["--runner", "eager"], "eager", "cpu"),
        (["--runner", "cuda"], "cuda", "cuda"),
        ([], "cuda", "cuda"),
        (["--runner", "eager", "--device", "cuda"], "eager", "cuda"),
    ],
)
def test_on_a_gpu_host_the_cli_resolves_args_device_from_the_runner(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], kind: str, device: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = cli._parser().parse_args(["demo", *argv])
    assert cli_checks.runner_kind(args) == kind
    assert args.device == device


def test_a_cuda_device_index_past_the_device_count_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    assert cli.main(["demo", "--device", "cuda:2"]) == 2
    assert capsys.readouterr().err == (
        "graphrunner demo: error: --device cuda:2: expected cuda:N with N < 2 devices\n"
    )


@pytest.mark.parametrize("command", [["demo"], ["generate", "--prompts", "p.jsonl"]])
def test_runner_cuda_without_a_cuda_device_exits_2_before_any_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    assert cli.main([*command, "--runner", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"graphrunner {command[0]}: error: --runner cuda: no CUDA device is available; "
        "expected cpu or eager\n"
    )


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize(
    "runner, kind",
    [(["--runner", "cpu"], "cpu"), (["--runner", "eager"], "eager"), ([], "cpu")],
)
@pytest.mark.parametrize("command", [["demo"], ["generate", "--prompts", "{prompts}"]])
def test_compile_without_the_cuda_runner_exits_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    prompts_file: Path,
    cuda: bool,
    runner: list[str],
    kind: str,
    command: list[str],
) -> None:
    if cuda and not runner:
        runner = ["--device", "cpu"]  # else a GPU host picks the cuda runner
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    argv = [a.replace("{prompts}", str(prompts_file)) for a in command]
    assert cli.main([*argv, *runner, "--compile"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"graphrunner {command[0]}: error: --compile needs --runner cuda (the cpu runner "
        f"always compiles; eager never does); the runner here is {kind}\n"
    )


class _Stop(Exception):
    """Raised in place of building a runner: the test has seen what it needs."""


@pytest.mark.parametrize(
    "argv, kind, options",
    [
        (["--runner", "cuda", "--compile"], "cuda", {"compile": True}),
        (["--runner", "cuda"], "cuda", {"compile": True}),  # the default on CUDA
        (["--runner", "cuda", "--no-compile"], "cuda", {}),
        (["--compile"], "cuda", {"compile": True}),
        (["--runner", "cpu"], "cpu", {}),
    ],
)
@pytest.mark.parametrize("command", [["demo"], ["generate", "--prompts", "{prompts}"]])
def test_compile_reaches_the_runner_only_when_asked_for(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    prompts_file: Path,
    argv: list[str],
    kind: str,
    options: dict[str, bool],
    command: list[str],
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def create(bundle: Any, kind: str, **kwargs: Any) -> None:
        calls.append((kind, kwargs))
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (1 << 30, "a fake GPU"))
    monkeypatch.setattr(serving, "build", lambda *a: object())
    monkeypatch.setattr(serving, "create_decode_runner", create)
    command = [a.replace("{prompts}", str(prompts_file)) for a in command]
    with pytest.raises(_Stop):
        cli.main([*command, *argv, "--capture-sizes", "1,2"])
    [(called_kind, kwargs)] = calls
    assert called_kind == kind
    assert {k: v for k, v in kwargs.items() if k == "compile"} == options
    if command[0] == "demo":
        assert f"device: {kind}   runner: {kind}   " in capsys.readouterr().out


def test_device_help_says_the_default_follows_the_runner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "cuda for --runner cuda, cpu for --runner cpu or eager" in help_text
    assert "--compile, --no-compile CUDA runner only: run torch.compile'd programs" in help_text


def test_demo_reports_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "25", "--max-bs", "4", "--runner", "eager"]) == 0
    out = capsys.readouterr().out
    for needle in [
        "device: cpu",
        "runner: eager",
        "capture (eager): sizes [1, 2, 4]",
        "bs=4",
        "decode: 25 steps",
        "tokens/s: graphs",
        "ratio",
        "padded rows:",
        "mismatches: 0",
    ]:
        assert needle in out, needle


@pytest.fixture
def built_page_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The KV page size of every bundle the CLI builds."""
    sizes: list[int] = []
    real = serving.build

    def build(*a: Any) -> ModelBundle:
        bundle = real(*a)
        sizes.append(bundle.kv_alloc.page_size)
        return bundle

    monkeypatch.setattr(serving, "build", build)
    return sizes


def test_demo_with_kv_pages_checks_every_step_and_passes(
    capsys: pytest.CaptureFixture[str], built_page_sizes: list[int]
) -> None:
    args = ["demo", "--steps", "16", "--max-bs", "4", "--runner", "eager", "--page-size", "4"]
    assert cli.main([*args, "--check-padding"]) == 0
    assert built_page_sizes == [4]
    out = capsys.readouterr().out
    for needle in [
        "1 thread(s)   KV pages of 4 slots\n",
        "decode: 16 steps",
        "checked steps: 16,",
        "mismatches: 0\n",
        "padding sanitizer: 16 replays checked, no violation",
    ]:
        assert needle in out, needle


def test_generate_with_kv_pages_prints_the_same_tokens(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], built_page_sizes: list[int]
) -> None:
    args = ["generate", "--prompts", str(prompts_file), "--max-new-tokens", "7", *EAGER]
    assert cli.main([*args, "--page-size", "4", "--check"]) == 0
    assert built_page_sizes == [4]
    captured = capsys.readouterr()
    assert [line["token_ids"] for line in _lines(captured.out)] == _expected(7)
    assert captured.err.endswith("mismatches: 0\n")


def test_demo_exits_1_on_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = serving.create_decode_runner
    monkeypatch.setattr(
        serving,
        "create_decode_runner",
        lambda bundle, *a, **k: StrayWriter(real(bundle, *a, **k), bundle),
    )
    assert cli.main(["demo", "--steps", "10", "--max-bs", "2", "--runner", "eager"]) == 1
    out = capsys.readouterr().out
    assert "mismatches: 10" in out


def test_demo_check_padding_checks_every_replay(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--steps", "12", "--max-bs", "4", "--runner", "eager", "--check-padding"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "padding sanitizer: 12 replays checked, no violation" in out


def test_demo_check_padding_exits_1_on_a_stray_write(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_build = serving.build

    def build_with_stray_forward(*a: Any) -> ModelBundle:
        bundle = real_build(*a)
        forward, k_last = bundle.model.forward_decode, bundle.kv_cache.k_buffers[0][-1]

        def stray(*args: Any, **kwargs: Any) -> torch.Tensor:
            k_last.add_(1.0)  # a KV slot no live row owns
            return forward(*args, **kwargs)

        bundle.model.forward_decode = stray  # type: ignore[method-assign]
        return bundle

    monkeypatch.setattr(serving, "build", build_with_stray_forward)
    args = ["demo", "--steps", "4", "--max-bs", "2", "--runner", "eager", "--check-padding"]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "padding violation" in err and "k_cache[0]" in err


def test_python_dash_m_runs_the_demo() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphrunner",
            "demo",
            "--steps",
            "8",
            "--max-bs",
            "2",
            "--runner",
            "eager",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mismatches: 0" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--end-token", "256"], "--end-token 256: expected a token id in 0..255"),
        (["--end-token", "-1"], "--end-token -1: expected a token id in 0..255"),
        (
            ["--output", "{tmp}/nodir/out.jsonl"],
            "--output {tmp}/nodir/out.jsonl: directory '{tmp}/nodir' does not exist",
        ),
        (["--output", "{tmp}"], "--output {tmp}: is a directory"),
        (["--device", "foo"], "--device 'foo': expected cpu, cuda or cuda:N"),
        (["--device", "meta"], "--device 'meta': expected cpu, cuda or cuda:N"),
        (["--device", "mps"], "--device 'mps': expected cpu, cuda or cuda:N"),
        (["--device", "cuda:x"], "--device 'cuda:x': expected cpu, cuda or cuda:N"),
        (["--threads", "0"], "--threads 0: expected 1..{cores} (this machine's cores)"),
        (["--threads", "-2"], "--threads -2: expected 1..{cores} (this machine's cores)"),
        # The longest prompt (8 tokens) + 128 new tokens (the default) - 1.
        (["--page-size", "0"], "--page-size 0: expected 1..135 (the context of this run)"),
        (["--page-size", "-4"], "--page-size -4: expected 1..135 (the context of this run)"),
    ],
)
def test_generate_rejects_bad_arguments_before_any_work(
    prompts_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert cli.main(["generate", "--prompts", str(prompts_file), *EAGER, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    message = message.replace("{tmp}", str(tmp_path)).replace("{cores}", str(os.cpu_count()))
    assert captured.err == f"graphrunner generate: error: {message}\n"


def test_generate_names_the_line_of_a_non_utf8_prompt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"[1, 2]\n\n[3, \xff]\n[4]\n")
    assert cli.main(["generate", "--prompts", str(path), *EAGER]) == 2
    assert capsys.readouterr().err == f"graphrunner generate: error: {path}:3: not valid UTF-8\n"


def test_generate_replaces_the_output_file_whole(prompts_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old contents, longer than nothing\n" * 100)
    args = ["generate", "--prompts", str(prompts_file), "--max-new-tokens", "3", *EAGER]
    assert cli.main([*args, "--output", str(out)]) == 0
    assert [line["token_ids"] for line in _lines(out.read_text())] == _expected(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


def test_a_failed_output_write_leaves_the_old_file_and_no_temp_file(
    prompts_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")

    def replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace)
    args = ["generate", "--prompts", str(prompts_file), "--max-new-tokens", "2", *EAGER]
    assert cli.main([*args, "--output", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"graphrunner generate: error: --output {out}: [Errno 28] No space left on device\n"
    )
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


def _checkpoint(tmp_path: Path, **config_edit: Any) -> Path:
    path = tmp_path / "ckpt"
    save_checkpoint(default_model(max_requests=1).model, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | config_edit))
    return path


def test_generate_exits_2_on_a_corrupt_weights_file(
    prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _checkpoint(tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    args = ["generate", "--prompts", str(prompts_file), "--checkpoint", str(path), *EAGER]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"graphrunner generate: error: {weights} is not a valid safetensors file: "
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"head_dim": 16.0}, "config field head_dim=16.0: expected a positive int"),
        (
            {"rms_norm_eps": None},
            "config field rms_norm_eps=None: expected a positive finite number",
        ),
    ],
)
def test_generate_exits_2_on_a_bad_config_value(
    prompts_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    edit: dict[str, Any],
    message: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    path = _checkpoint(tmp_path, **edit)
    args = ["generate", "--prompts", str(prompts_file), "--checkpoint", str(path), *EAGER]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == f"graphrunner generate: error: {message}\n"


@pytest.mark.parametrize(
    "edit",
    [
        {"rope_scaling": {"rope_type": "default"}},
        {"rope_scaling": {"type": "default"}},
        {"architectures": None},
    ],
)
def test_generate_runs_a_plain_rope_checkpoint_however_it_says_so(
    prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict[str, Any]
) -> None:
    path = _checkpoint(tmp_path, **edit)
    args = ["generate", "--prompts", str(prompts_file), "--checkpoint", str(path), *EAGER]
    assert cli.main([*args, "--max-new-tokens", "3"]) == 0
    assert [line["token_ids"] for line in _lines(capsys.readouterr().out)] == _expected(3)


def test_demo_builds_the_embedded_model_at_the_context_it_reports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[int] = []
    real = serving.create_decode_runner

    def capture(bundle: ModelBundle, *a: Any, **k: Any) -> Any:
        built.append(bundle.max_context_len)
        return real(bundle, *a, **k)

    monkeypatch.setattr(serving, "create_decode_runner", capture)
    assert cli.main(["demo", "--steps", "6", "--max-bs", "2", "--runner", "eager"]) == 0
    reported = re.search(r"vocab 256, context (\d+)\n", capsys.readouterr().out)
    assert reported is not None
    assert built == [int(reported.group(1))] and built[0] < 256


def test_seed_help_says_what_it_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "--seed SEED seed of the embedded model's weights, of the demo's synthetic trace "
        "and of sampling (each request's seed derives from it and the request id unless a "
        "prompt gives its own; no effect on a --checkpoint's weights)"
    ) in help_text


# Bounds: every number the CLI takes is refused past what the machine can hold,
# with exit 2, one line naming the argument, the value and the range, no output.

CORES = os.cpu_count() or 1
BIG = str(10**30)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test, instead of hanging or allocating, if a refused run starts."""
    monkeypatch.setattr(cli_demo, "synthetic_trace", lambda **k: pytest.fail("built a trace"))
    real_sizes = cli_checks.default_capture_sizes

    def sizes(max_bs: int) -> list[int]:  # past 10**7 it would run for minutes
        return (
            pytest.fail(f"capture sizes up to {max_bs}") if max_bs > 10**7 else real_sizes(max_bs)
        )

    monkeypatch.setattr(cli_checks, "default_capture_sizes", sizes)
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail(f"set {n} threads"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", str(2**63)], f"--seed {2**63}: expected 0..{2**63 - 1}"),
        (["--seed", str(2**64)], f"--seed {2**64}: expected 0..{2**63 - 1}"),
        (["--seed", BIG], f"--seed {BIG}: expected 0..{2**63 - 1}"),
        (["--seed", "-1"], f"--seed -1: expected 0..{2**63 - 1}"),
        (
            ["--threads", str(CORES + 1)],
            f"--threads {CORES + 1}: expected 1..{CORES} (this machine's cores)",
        ),
        (["--threads", "20000"], f"--threads 20000: expected 1..{CORES} (this machine's cores)"),
        (["--threads", "100000"], f"--threads 100000: expected 1..{CORES} (this machine's cores)"),
        (["--max-bs", "1000001"], "--max-bs 1000001: expected 1..1000000"),
        (["--max-bs", BIG], f"--max-bs {BIG}: expected 1..1000000"),
        (["--max-bs", "0"], "--max-bs 0: expected 1..1000000"),
        (
            ["--capture-sizes", "1,1000000000"],
            "--capture-sizes '1,1000000000': expected sizes in 1..1000000",
        ),
        (
            ["--capture-sizes", "1,1000001"],
            "--capture-sizes '1,1000001': expected sizes in 1..1000000",
        ),
        (["--capture-sizes", "0,4"], "--capture-sizes '0,4': expected sizes in 1..1000000"),
        (
            ["--page-size", "1000000000"],
            "--page-size 1000000000: expected 1..256 (the model's context)",
        ),
        (["--page-size", "257"], "--page-size 257: expected 1..256 (the model's context)"),
        (["--steps", "1000000000"], "--steps 1000000000: expected 1..100000"),
        (["--steps", "100001"], "--steps 100001: expected 1..100000"),
        (["--steps", BIG], f"--steps {BIG}: expected 1..100000"),
    ],
)
def test_demo_refuses_a_number_out_of_range_before_any_work(
    capsys: pytest.CaptureFixture[str], no_work: None, argv: list[str], message: str
) -> None:
    assert cli.main(["demo", "--runner", "eager", *argv]) == 2
    assert capsys.readouterr() == ("", f"graphrunner demo: error: {message}\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--max-new-tokens", "257"],
            "--max-new-tokens 257: expected 1..256 (the model's context)",
        ),
        (
            ["--max-new-tokens", BIG],
            f"--max-new-tokens {BIG}: expected 1..256 (the model's context)",
        ),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: expected 1..256 (the model's context)"),
        (["--arrive-every", "100001"], "--arrive-every 100001: expected 0..100000"),
        (["--arrive-every", BIG], f"--arrive-every {BIG}: expected 0..100000"),
        (["--arrive-every", "-1"], "--arrive-every -1: expected 0..100000"),
        (["--end-token", BIG], f"--end-token {BIG}: expected a token id in 0..255"),
        (["--seed", str(2**64)], f"--seed {2**64}: expected 0..{2**63 - 1}"),
        (["--threads", "100000"], f"--threads 100000: expected 1..{CORES} (this machine's cores)"),
        (["--max-bs", "100000000"], "--max-bs 100000000: expected 1..1000000"),
        (
            ["--capture-sizes", "1,1000000000"],
            "--capture-sizes '1,1000000000': expected sizes in 1..1000000",
        ),
        # The longest prompt (8 tokens) + 128 new tokens (the default) - 1 = 135.
        (["--page-size", "136"], "--page-size 136: expected 1..135 (the context of this run)"),
        (
            ["--page-size", "1000000000"],
            "--page-size 1000000000: expected 1..135 (the context of this run)",
        ),
    ],
)
def test_generate_refuses_a_number_out_of_range_before_any_work(
    prompts_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_work: None,
    argv: list[str],
    message: str,
) -> None:
    out = tmp_path / "out.jsonl"
    base = ["generate", "--prompts", str(prompts_file), "--runner", "eager", "--output", str(out)]
    assert cli.main([*base, *argv]) == 2
    assert capsys.readouterr() == ("", f"graphrunner generate: error: {message}\n")
    assert not out.exists()


def _args(*argv: str) -> argparse.Namespace:
    return cli._parser().parse_args(["demo", "--runner", "eager", "--device", "cpu", *argv])


def test_the_values_at_the_bounds_pass_the_checks() -> None:
    args = _args("--threads", str(CORES), "--seed", str(cli_checks.MAX_SEED))
    assert cli_checks.check_common(args) == "eager"
    assert cli_checks.capture_sizes(_args("--max-bs", "1000000"))[-1] == 1_000_000
    assert cli_checks.capture_sizes(_args("--capture-sizes", "1,1000000")) == [1, 1_000_000]
    sizes = cli_checks.capture_sizes(_args("--max-bs", "1"))
    cli_checks.check_fits(
        _args("--page-size", "23"),
        default_config(),
        sizes,
        23,
        max_prompt_len=8,
        kind="eager",
        check=True,
    )
    with pytest.raises(cli.UsageError, match=r"^--page-size 24: expected 1\.\.23 "):
        cli_checks.check_fits(
            _args("--page-size", "24"),
            default_config(),
            sizes,
            23,
            max_prompt_len=8,
            kind="eager",
            check=True,
        )


def test_the_largest_seed_seeds_the_model_and_the_trace() -> None:
    # torch takes it (it overflowed past 2**64 - 1; negatives alias the top half).
    default_model(max_requests=1, max_context_len=8, seed=cli_checks.MAX_SEED)
    synthetic_trace(num_requests=2, vocab_size=256, max_context_len=64, seed=cli_checks.MAX_SEED)


def test_the_demo_runs_the_largest_step_count(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def trace(**kwargs: Any) -> None:
        asked.append(kwargs["num_requests"])
        raise _Stop

    monkeypatch.setattr(cli_demo, "synthetic_trace", trace)
    with pytest.raises(_Stop):
        cli.main(["demo", "--runner", "eager", "--steps", "100000", "--page-size", "256"])
    assert asked == [100_000]


def test_generate_takes_the_largest_budget_and_arrival_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []

    def build(args: Any, max_requests: int, context: int) -> None:
        built.append(context)
        raise _Stop

    monkeypatch.setattr(serving, "build", build)
    path = tmp_path / "prompts.jsonl"
    path.write_text("[5]\n[6]\n")
    argv = ["generate", "--prompts", str(path), "--runner", "eager", "--page-size", "256"]
    with pytest.raises(_Stop):
        cli.main([*argv, "--max-new-tokens", "256", "--arrive-every", "100000"])
    assert built == [256]


@pytest.mark.parametrize("device", ["cuda:2", "cuda:128", "cuda:99999999999999999999"])
def test_a_huge_cuda_device_index_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], device: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    assert cli.main(["demo", "--device", device]) == 2
    assert capsys.readouterr().err == (
        f"graphrunner demo: error: --device {device}: expected cuda:N with N < 2 devices\n"
    )


def test_a_device_index_with_a_leading_zero_is_not_a_device() -> None:
    with pytest.raises(cli.UsageError, match="--device 'cuda:01': expected cpu, cuda or cuda:N"):
        cli.resolve_device(None, "cuda:01", cuda_available=True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--threads", "100000"], f"--threads 100000: expected 1..{CORES} (this machine's cores)"),
        (["--threads", "20000"], f"--threads 20000: expected 1..{CORES} (this machine's cores)"),
        (["--seed", str(2**64)], f"--seed {2**64}: expected 0..{2**63 - 1}"),
    ],
)
def test_python_dash_m_refuses_what_crashed_it(argv: list[str], message: str) -> None:
    # In a subprocess: were the bound gone, these would crash the interpreter.
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner", "demo", "--runner", "eager", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"graphrunner demo: error: {message}\n"


# The memory estimate, and the refusal of a run that would not fit.


def _estimate(**kwargs: Any) -> int:
    options: dict[str, Any] = {
        "capture_sizes": [1, 2, 4],
        "context": 40,
        "page_size": 4,
        "max_prompt_len": 8,
    }
    return cli.memory_estimate(default_config(), **(options | kwargs))


def test_the_memory_estimate_counts_the_pools_the_bundle_allocates() -> None:
    bundle = default_model(max_requests=4, max_context_len=40, page_size=4)
    kv = bundle.kv_cache
    pools = bundle.req_pool.req_to_token.nbytes + sum(
        t.nbytes for t in (*kv.k_buffers, *kv.v_buffers)
    )
    # One more copy of the pools (check mode's snapshot) costs exactly the pools.
    assert _estimate(pool_copies=1) - _estimate() == pools
    model = bundle.model
    # Distinct storages: the stacked q/k/v and gate/up buffers are the
    # parameters' own memory (their weights are views of them).
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers())
    }
    assert _estimate() >= pools + sum(storages.values())


def test_the_memory_estimate_counts_the_logits_each_cuda_graph_keeps() -> None:
    kept = (1 + 2) * 256 * 4  # sizes 1 and 2 besides 4, float32 logits of vocab 256
    with_graphs = _estimate(cuda_graphs=True) - _estimate(capture_sizes=[4], cuda_graphs=True)
    assert with_graphs == kept
    assert _estimate() == _estimate(capture_sizes=[4])  # nothing kept without graphs


def test_the_memory_estimate_grows_with_every_size_that_allocates() -> None:
    base = _estimate()
    assert _estimate(capture_sizes=[1, 2, 8]) > base
    assert _estimate(context=80) > base
    assert _estimate(page_size=32) > base  # 40 tokens take 64 slots, not 40
    assert _estimate(max_prompt_len=40, capture_sizes=[1]) > _estimate(capture_sizes=[1])


def test_available_memory_reads_meminfo_and_the_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    monkeypatch.setattr(memory, "_MEMINFO", meminfo)
    monkeypatch.setattr(memory, "_CGROUP", cgroup)
    assert memory.available_memory("cpu") == (8 << 30, "a fixed cap (no /proc/meminfo)")
    meminfo.write_text("MemTotal: 4000 kB\nMemFree: 1000 kB\nMemAvailable: 3000 kB\n")
    assert memory.available_memory("cpu") == (3000 * 1024, "MemAvailable")
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("100\n")
    assert memory.available_memory("cpu") == (3000 * 1024, "MemAvailable")
    (cgroup / "memory.max").write_text("1000100\n")
    assert memory.available_memory("cpu") == (1000000, "cgroup memory.max")


@pytest.fixture
def free_memory(monkeypatch: pytest.MonkeyPatch) -> int:
    free = 1 << 30
    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (free, "the test"))
    return free


def test_a_largest_batch_past_the_memory_exits_2_naming_the_batch_that_fits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, free_memory: int
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    assert cli.main(["demo", "--runner", "eager", "--max-bs", "100000"]) == 2
    out, err = capsys.readouterr()
    found = re.fullmatch(
        r"graphrunner demo: error: --max-bs 100000: expected 1\.\.(\d+) \(memory: this run "
        r"needs about ([\d.]+) GiB, 1\.0 GiB is free per the test\)\n",
        err,
    )
    assert out == "" and found, err
    assert 1 < int(found.group(1)) < 100_000 and float(found.group(2)) > 1.0


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--max-bs", "100000"], "--max-bs 100000"),
        (["--capture-sizes", "1,8,100000"], "--capture-sizes '1,8,100000'"),
    ],
)
def test_the_batch_range_named_is_the_largest_that_fits(
    free_memory: int, argv: list[str], flag: str
) -> None:
    args, config = _args(*argv), default_config()
    sizes = cli_checks.capture_sizes(args)
    options: dict[str, Any] = {"max_prompt_len": 48, "kind": "eager", "check": True}
    with pytest.raises(cli.UsageError) as error:
        cli_checks.check_fits(args, config, sizes, 110, **options)
    found = re.match(
        rf"{re.escape(flag)}: expected (?:sizes in )?1\.\.(\d+) \(memory: ", str(error.value)
    )
    assert found, str(error.value)
    fits = int(found.group(1))

    def estimate(bs: int) -> int:
        up_to = [s for s in sizes if s < bs] + [bs]
        return cli.memory_estimate(
            config, capture_sizes=up_to, context=110, page_size=1, max_prompt_len=48, pool_copies=1
        )

    assert estimate(fits) <= free_memory < estimate(fits + 1)
    cli_checks.check_fits(args, config, [*[s for s in sizes if s < fits], fits], 110, **options)


def test_kv_slots_past_int32_exit_2_even_with_memory_to_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (1 << 62, "the test"))
    config = dataclasses.replace(default_config(), max_position_embeddings=4096)
    args = _args("--max-bs", "1000000")
    sizes = cli_checks.capture_sizes(args)
    options: dict[str, Any] = {"max_prompt_len": 8, "kind": "eager", "check": False}
    # 524287 requests of 4096 slots, plus the padding slot, index below 2**31.
    with pytest.raises(cli.UsageError) as error:
        cli_checks.check_fits(args, config, sizes, 4096, **options)
    assert str(error.value) == (
        "--max-bs 1000000: expected 1..524287 (int32 KV slot indices allow 2147483647 slots)"
    )
    cli_checks.check_fits(
        args, config, [*[s for s in sizes if s < 524287], 524287], 4096, **options
    )


def test_a_model_that_does_not_fit_at_batch_size_1_names_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (1 << 16, "the test"))
    args = _args("--checkpoint", "ckpt", "--max-bs", "2")
    with pytest.raises(cli.UsageError) as error:
        cli_checks.check_fits(
            args, default_config(), [1, 2], 100, max_prompt_len=8, kind="eager", check=False
        )
    assert str(error.value).startswith(
        "--checkpoint ckpt at context 100: no batch size fits (memory: this run needs about "
    )
