"""``generate`` and ``demo`` sampling options: the flags and a prompt line's
own fields reach the engine (compared with the engine run directly), ``--seed``
seeds sampling, temperature 0 is greedy bit for bit, ``--logprobs`` writes
the eager log-softmax, and every bad value exits 2 naming the flag or line."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_engine_logprobs import eager_last_logits

import graphrunner_ref.cli.demo as cli_demo
import graphrunner_ref.cli.main as cli
from graphrunner.sampling import SamplingParams
from graphrunner_ref import Engine, Request, create_decode_runner, default_model
from graphrunner_ref.engine import serving
from graphrunner_ref.io import save_checkpoint

PROMPTS = [[1, 2, 3], [200], [7, 7, 7, 7, 7, 7, 7, 7], [0, 255, 9, 4]]
EAGER = ["--runner", "eager", "--capture-sizes", "1,2,4"]
NEW = 6


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _generate(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert cli.main(["generate", "--max-new-tokens", str(NEW), *EAGER, *argv]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _tokens(lines: list[dict[str, Any]]) -> list[list[int]]:
    return [line["token_ids"] for line in lines]


def _engine(
    sampling: Sequence[SamplingParams | None],
    *,
    seed: int,
    budgets: Sequence[int] = (NEW,) * len(PROMPTS),
    prompts: Sequence[Sequence[int]] = PROMPTS,
) -> list[list[int]]:
    """The engine run directly on the embedded model of ``--seed seed``."""
    bundle = default_model(max_requests=4, seed=seed)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], sampling=True)
    runner.capture()
    trace = [
        Request(i, tuple(p), n, sampling=s)
        for i, (p, n, s) in enumerate(zip(prompts, budgets, sampling, strict=True))
    ]
    out = Engine(bundle, runner, seed=seed).run(trace).outputs
    return [out[i] for i in range(len(trace))]


HOT = ["--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01"]
HOT_PARAMS = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01)


def test_the_flags_and_the_seed_reach_the_engine(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    got = _tokens(_generate(capsys, "--prompts", str(prompts_file), *HOT, "--seed", "5"))
    assert got == _engine([HOT_PARAMS] * 4, seed=5)
    assert got != _engine([None] * 4, seed=5)  # it does sample
    again = _tokens(_generate(capsys, "--prompts", str(prompts_file), *HOT, "--seed", "5"))
    assert again == got


def test_the_seed_seeds_sampling_not_only_the_weights(
    prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"  # weights that --seed does not touch
    save_checkpoint(default_model(max_requests=1).model, ckpt)
    base = ["--prompts", str(prompts_file), "--checkpoint", str(ckpt), "--json"]
    greedy = [_tokens(_generate(capsys, *base, "--seed", s)) for s in ("1", "2")]
    assert greedy[0] == greedy[1]
    hot = [_tokens(_generate(capsys, *base, *HOT, "--seed", s)) for s in ("1", "2", "1")]
    assert hot[0] != hot[1] and hot[0] == hot[2]


def test_temperature_0_is_the_greedy_output_bit_for_bit(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = _generate(capsys, "--prompts", str(prompts_file))
    assert _generate(capsys, "--prompts", str(prompts_file), "--temperature", "0") == greedy
    # With log-probabilities the sampled step runs, its temperature-0 tokens the argmax's.
    built: list[dict[str, Any]] = []
    real = serving.create_decode_runner

    def spy(*a: Any, **k: Any) -> Any:
        built.append(k)
        return real(*a, **k)

    monkeypatch.setattr(serving, "create_decode_runner", spy)
    lines = _generate(capsys, "--prompts", str(prompts_file), "--logprobs", "1", "--top-k", "3")
    assert _tokens(lines) == _tokens(greedy)
    _generate(capsys, "--prompts", str(prompts_file))
    assert [k.get("sampling", False) for k in built] == [True, False]  # greedy: plain runner


def test_a_prompt_line_s_fields_override_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        PROMPTS[0],
        {"prompt": PROMPTS[1], "temperature": 1.2, "seed": 99, "max_new_tokens": 3},
        {"prompt": PROMPTS[2], "temperature": 0, "top_k": 5},
        {"prompt": PROMPTS[3], "top_p": 0.5, "min_p": 0.2, "top_k": 7},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = _tokens(_generate(capsys, "--prompts", str(path), *HOT, "--seed", "4"))
    params = [
        HOT_PARAMS,
        SamplingParams(temperature=1.2, top_k=40, top_p=0.95, min_p=0.01, seed=99),
        None,
        SamplingParams(temperature=0.9, top_k=7, top_p=0.5, min_p=0.2),
    ]
    assert got == _engine(params, seed=4, budgets=[NEW, 3, NEW, NEW])
    assert len(got[1]) == 3
    # Greedy flags: only the line that asks samples.
    got = _tokens(_generate(capsys, "--prompts", str(path), "--seed", "4"))
    params = [None, SamplingParams(temperature=1.2, seed=99), None, None]
    assert got == _engine(params, seed=4, budgets=[NEW, 3, NEW, NEW])


@pytest.mark.parametrize("mode", [[], ["--overlap"], ["--speculative", "eagle"]], ids=str)
def test_logprobs_are_the_eager_log_softmax_of_each_written_token(
    prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    out = tmp_path / "out.jsonl"
    argv = ["--prompts", str(prompts_file), *HOT, "--seed", "0", "--logprobs", "4"]
    argv += ["--output", str(out), *mode]
    assert _generate(capsys, *argv) == []
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    reference = default_model(max_requests=1)
    for prompt, line in zip(PROMPTS, lines, strict=True):
        assert len(line["logprobs"]) == len(line["token_ids"]) == NEW
        for i, (token, entry) in enumerate(zip(line["token_ids"], line["logprobs"], strict=True)):
            lp = torch.log_softmax(
                eager_last_logits(reference, [*prompt, *line["token_ids"][:i]]), -1
            )
            assert entry["token"] == token
            assert entry["logprob"] == pytest.approx(lp[token].item(), abs=1e-4)
            top = torch.topk(lp, 4)
            assert [t for t, _ in entry["top"]] == top.indices.tolist()
            assert [v for _, v in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert all("logprobs" not in x for x in _generate(capsys, "--prompts", str(prompts_file)))


def test_demo_samples_and_checks_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--steps", "8", "--max-bs", "2", "--runner", "eager", *HOT, "--seed", "3"]
    assert cli.main(argv) == 0
    assert "mismatches: 0" in capsys.readouterr().out


@pytest.fixture
def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    monkeypatch.setattr(cli_demo, "synthetic_trace", lambda **k: pytest.fail("built a trace"))


BAD_FLAGS = [
    (["--temperature", "-0.5"], "--temperature -0.5: expected a finite number >= 0"),
    (["--temperature", "nan"], "--temperature nan: expected a finite number >= 0"),
    (["--temperature", "inf"], "--temperature inf: expected a finite number >= 0"),
    (["--top-k", "-1"], "--top-k -1: expected an int >= 0 (0: no limit)"),
    (["--top-k", str(2**63)], f"--top-k {2**63}: expected an int in 0..{2**63 - 1} (0: no limit)"),
    (["--top-p", "0"], "--top-p 0.0: expected a number in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: expected a number in (0, 1]"),
    (["--min-p", "-0.1"], "--min-p -0.1: expected a number in [0, 1]"),
    (["--min-p", "1.01"], "--min-p 1.01: expected a number in [0, 1]"),
    (["--seed", "-1"], f"--seed -1: expected 0..{2**63 - 1}"),
    (["--seed", str(2**63)], f"--seed {2**63}: expected 0..{2**63 - 1}"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS)
@pytest.mark.parametrize("command", ["demo", "generate"])
def test_a_bad_sampling_flag_exits_2_naming_it(
    prompts_file: Path,
    capsys: pytest.CaptureFixture[str],
    no_build: None,
    command: str,
    argv: list[str],
    message: str,
) -> None:
    extra = ["--prompts", str(prompts_file)] if command == "generate" else []
    assert cli.main([command, "--runner", "eager", *extra, *argv]) == 2
    assert capsys.readouterr() == ("", f"graphrunner {command}: error: {message}\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--logprobs", "-1"], "--logprobs -1: expected 0..20"),
        (["--logprobs", "21"], "--logprobs 21: expected 0..20"),
        (
            ["--temperature", "1", "--speculative", "mtp", "--check"],
            "generate --speculative --check with sampling (temperature > 0): it compares "
            "with plain decoding token for token, which sampled speculative decoding equals "
            "in distribution only; expected temperature 0",
        ),
    ],
)
def test_generate_refuses_logprobs_and_modes_it_cannot_serve(
    prompts_file: Path,
    capsys: pytest.CaptureFixture[str],
    no_build: None,
    argv: list[str],
    message: str,
) -> None:
    assert cli.main(["generate", "--runner", "eager", "--prompts", str(prompts_file), *argv]) == 2
    assert capsys.readouterr() == ("", f"graphrunner generate: error: {message}\n")


BAD_LINES = [
    ({"prompt": [1], "temperature": -1}, "temperature=-1; expected a finite number >= 0"),
    ({"prompt": [1], "temperature": "hot"}, "temperature='hot'; expected a finite number >= 0"),
    ({"prompt": [1], "top_k": 1.5}, "top_k=1.5; expected an int >= 0 (0: no limit)"),
    ({"prompt": [1], "top_k": True}, "top_k=True; expected an int >= 0 (0: no limit)"),
    (
        {"prompt": [1], "top_k": 10**30},
        f"top_k={10**30}; expected an int in 0..{2**63 - 1} (0: no limit)",
    ),
    ({"prompt": [1], "temperature": 1e400}, "temperature=inf; expected a finite number >= 0"),
    ({"prompt": [1], "top_p": 0}, "top_p=0; expected a number in (0, 1]"),
    ({"prompt": [1], "min_p": 2}, "min_p=2; expected a number in [0, 1]"),
    ({"prompt": [1], "seed": -1}, "seed=-1; expected an int in [0, 2**63)"),
    ({"prompt": [1], "seed": 2**63}, f"seed={2**63}; expected an int in [0, 2**63)"),
    ({"prompt": [1], "seed": "7"}, "seed='7'; expected an int in [0, 2**63)"),
    ({"prompt": [1], "max_new_tokens": 0}, "max_new_tokens=0; expected an int in 1..256"),
    ({"prompt": [1], "max_new_tokens": 257}, "max_new_tokens=257; expected an int in 1..256"),
    ({"prompt": [1], "max_new_tokens": 2.0}, "max_new_tokens=2.0; expected an int in 1..256"),
    (
        {"prompt": [1], "temp": 1},
        'unknown field \'temp\'; expected "prompt" and any of "max_new_tokens", '
        '"temperature", "top_k", "top_p", "min_p", "seed"',
    ),
    ({"prompt": [1, 256]}, "expected a non-empty JSON list of token ids in 0..255"),
    ({"prompt": []}, "expected a non-empty JSON list of token ids in 0..255"),
    ({"prompt": 5}, 'expected a non-empty JSON list of token ids, or an object with a "prompt"'),
    (
        {"prompt": [250] * 250, "max_new_tokens": 10},
        "prompt of 250 tokens + 10 new tokens needs a context of 259, longer than the "
        "model's context 256",
    ),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_a_bad_prompt_line_exits_2_naming_the_line_and_the_field(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_build: None,
    line: dict[str, Any],
    message: str,
) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(f"[1, 2]\n\n{json.dumps(line)}\n")
    assert cli.main(["generate", "--runner", "eager", "--prompts", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"graphrunner generate: error: {path}:3: {message}"), err
    assert err.count("\n") == 1


def test_the_overlap_demo_and_check_compare_with_plain_sampling(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Overlap draws plain sampling's tokens (same seeds and positions), so the
    demo and ``generate --check`` compare with it and find them equal."""
    argv = ["demo", "--steps", "12", "--max-bs", "2", "--runner", "eager", *HOT, "--seed", "3"]
    assert cli.main([*argv, "--overlap"]) == 0
    out = capsys.readouterr().out
    assert "outputs equal to plain sampling: " in out
    assert "mismatches: 0" in out
    gen = ["generate", "--prompts", str(prompts_file), "--runner", "eager", *HOT, "--seed", "8"]
    assert cli.main([*gen, "--overlap", "--check", "--json"]) == 0
    assert capsys.readouterr().err.endswith("mismatches: 0\n")


def test_the_overlap_check_counts_a_seed_the_plain_run_does_not_share(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain reference samples with the run's seed: a reference drawn from
    another seed differs, and ``--check`` says so (exit 1)."""
    real = serving.baseline

    def other_seed(config: Any, *a: Any, **k: Any) -> Any:
        return real(dataclasses.replace(config, seed=config.seed + 1), *a, **k)

    monkeypatch.setattr(serving, "baseline", other_seed)
    gen = ["generate", "--prompts", str(prompts_file), "--runner", "eager", *HOT, "--seed", "8"]
    assert cli.main([*gen, "--overlap", "--check", "--json", "--max-new-tokens", "12"]) == 1
    assert "mismatches: 0" not in capsys.readouterr().err


def test_generate_overlap_samples_the_plain_engine_s_tokens(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--prompts", str(prompts_file), *HOT, "--seed", "8", "--arrive-every", "1"]
    plain = _generate(capsys, *argv)
    assert _generate(capsys, *argv, "--overlap") == plain
    assert _tokens(plain) == _engine([HOT_PARAMS] * 4, seed=8)


def test_a_state_space_checkpoint_samples_by_the_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hf_ssm import save_tiny_mamba

    ckpt = tmp_path / "ck"
    save_tiny_mamba(ckpt)
    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2]\n[3, 4, 5]\n" + json.dumps({"prompt": [6], "seed": 9}) + "\n")
    base = ["--checkpoint", str(ckpt), "--prompts", str(path), "--json", "--runner", "eager"]

    def run(*argv: str) -> list[list[int]]:
        capsys.readouterr()
        assert cli.main(["generate", "--max-new-tokens", "5", *base, *argv]) == 0
        return _tokens([json.loads(x) for x in capsys.readouterr().out.splitlines()])

    greedy = run()
    assert run("--temperature", "0", "--seed", "4") == greedy
    hot = [run(*HOT, "--seed", s) for s in ("1", "2", "1")]
    assert hot[0] == hot[2] and hot[0] != greedy
    assert hot[0][:2] != hot[1][:2] and hot[0][2] == hot[1][2]  # line 3 has its own seed


def test_a_state_space_checkpoint_gives_the_transformers_log_softmax(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hf_ssm import save_tiny_mamba

    hf = save_tiny_mamba(tmp_path / "ck").eval()
    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2]\n[3, 4, 5]\n")
    argv = ["generate", "--checkpoint", str(tmp_path / "ck"), "--prompts", str(path)]
    argv += ["--runner", "eager", "--max-new-tokens", "4", *HOT, "--logprobs", "3"]
    assert cli.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    for prompt, line in zip([[1, 2], [3, 4, 5]], lines, strict=True):
        tokens = line["token_ids"]
        assert len(line["logprobs"]) == len(tokens) == 4
        for i, entry in enumerate(line["logprobs"]):
            with torch.no_grad():
                logits = hf(torch.tensor([[*prompt, *tokens[:i]]])).logits[0, -1]
            lp = torch.log_softmax(logits.float(), -1)
            assert entry["token"] == tokens[i]
            assert entry["logprob"] == pytest.approx(lp[tokens[i]].item(), abs=1e-4)
            assert [t for t, _ in entry["top"]] == torch.topk(lp, 3).indices.tolist()


def test_a_text_prompt_object_samples_as_its_token_id_twin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    from gguf_world import tiny_text_checkpoint

    ckpt = tmp_path / "hf"
    tiny_text_checkpoint(ckpt)
    text = "hello world, hello graphs"
    ids = AutoTokenizer.from_pretrained(ckpt)(text)["input_ids"]
    own = {"temperature": 1.1, "seed": 3, "max_new_tokens": 5}
    files = []
    for name, prompt in (("text", text), ("ids", ids)):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text(json.dumps({"prompt": prompt, **own}) + "\n")
    base = ["generate", "--checkpoint", str(ckpt), "--runner", "eager", "--ignore-eos"]
    # --logprobs prints JSON lines even with a tokenizer.
    assert cli.main([*base, "--prompts", str(files[0]), "--logprobs", "1"]) == 0
    [by_text] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert cli.main([*base, "--prompts", str(files[1]), "--json"]) == 0
    [by_ids] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert by_text["token_ids"] == by_ids["token_ids"] and len(by_ids["token_ids"]) == 5
    assert [e["token"] for e in by_text["logprobs"]] == by_text["token_ids"]
    greedy = tmp_path / "greedy.jsonl"
    greedy.write_text(json.dumps({"prompt": ids, "max_new_tokens": 5}) + "\n")
    assert cli.main([*base, "--prompts", str(greedy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] != by_ids["token_ids"]  # it sampled


@pytest.mark.parametrize(
    "method",
    ["mtp", "eagle"],
)
def test_generate_speculative_samples_reproducibly_by_the_seed(
    prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    ckpt = tmp_path / "ckpt"  # weights that --seed does not touch: only sampling sees it
    save_checkpoint(default_model(max_requests=1).model, ckpt)
    base = ["--prompts", str(prompts_file), "--checkpoint", str(ckpt), "--json"]
    argv = [*base, *HOT, "--speculative", method, "--draft", "self"]
    first = _tokens(_generate(capsys, *argv, "--seed", "3"))
    assert _tokens(_generate(capsys, *argv, "--seed", "3")) == first
    assert _tokens(_generate(capsys, *argv, "--seed", "4")) != first
    greedy = _tokens(_generate(capsys, *base, "--seed", "3"))
    assert first != greedy  # it samples
    cold = [*base, "--temperature", "0", "--speculative", method, "--draft", "self"]
    assert _tokens(_generate(capsys, *cold, "--seed", "3")) == greedy


def test_sampling_without_a_seed_draws_one_and_says_it(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --seed with sampling: a fresh seed per run, printed on stderr, and
    --seed with that value repeats the run token for token."""
    argv = ["generate", "--max-new-tokens", str(NEW), *EAGER, "--prompts", str(prompts_file), *HOT]
    seeds, runs = [], []
    for _ in range(2):
        assert cli.main(argv) == 0
        out, err = capsys.readouterr()
        found = re.search(r"generate: sampling with seed (\d+) \(drawn; --seed \1 repeats", err)
        assert found, err
        seeds.append(int(found.group(1)))
        runs.append(_tokens([json.loads(line) for line in out.splitlines()]))
    assert seeds[0] != seeds[1]  # drawn afresh (equal with probability 2**-31)
    assert (
        _tokens(_generate(capsys, "--prompts", str(prompts_file), *HOT, "--seed", str(seeds[0])))
        == runs[0]
    )


def test_greedy_without_a_seed_draws_none(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli.main(["generate", "--max-new-tokens", "2", *EAGER, "--prompts", str(prompts_file)]) == 0
    )
    assert "seed" not in capsys.readouterr().err


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_sampled_speculative_decoding_runs_compiled_on_the_cpu_runner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    """``--speculative METHOD --temperature 0.8 --runner cpu``: the verify's
    rejection sampling traces with a symbolic batch (it once failed to, on the
    vocabulary axis), and the compiled run draws the eager runner's tokens
    for the same seed: a token depends on its seed and position alone."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:2]))
    argv = ["generate", "--max-new-tokens", str(NEW), "--prompts", str(path), "--json"]
    spec = [*HOT, "--speculative", method, "--draft", "self", "--seed", "3"]

    def tokens(*extra: str) -> list[list[int]]:
        capsys.readouterr()
        assert cli.main([*argv, *spec, *extra]) == 0
        return _tokens([json.loads(x) for x in capsys.readouterr().out.splitlines()])

    compiled = tokens("--runner", "cpu", "--capture-sizes", "1,2")
    assert compiled == tokens(*EAGER)
    assert all(len(t) == NEW for t in compiled)
