"""``generate``'s JSON-lines prompts carry penalties and logit bias: a line's
``repetition_penalty`` and ``logit_bias`` give the tokens of the model run
alone with the torch reference (tests/test_penalties.py) beside a plain
line; a bad value, a bias key outside the vocabulary and penalties with
``--check`` exit 2 naming the field."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from test_engine_penalties import alone_tokens

import graphrunner_ref.cli.main as cli
from graphrunner.sampling import SamplingParams
from graphrunner_ref import Request

PROMPT = [5, 17, 42, 9, 100, 3]
NEW = 10
ARGV = ["generate", "--json", "--runner", "eager", "--quiet", "--max-new-tokens", str(NEW)]


def _generate(tmp: Path, lines: list[dict[str, object]], *extra: str) -> tuple[int, str]:
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main([*ARGV, "--prompts", str(path), *extra])
    return status, out.getvalue()


def test_a_lines_penalties_give_the_references_tokens(tmp_path: Path) -> None:
    line = {"prompt": PROMPT, "repetition_penalty": 1.9, "logit_bias": {"7": 100, "9": -100}}
    status, out = _generate(tmp_path, [line, {"prompt": PROMPT}])
    assert status == 0
    got = [json.loads(x)["token_ids"] for x in out.splitlines()]
    params = SamplingParams(repetition_penalty=1.9, logit_bias={7: 100.0, 9: -100.0})
    assert got[0] == alone_tokens(Request(0, tuple(PROMPT), NEW, 0, sampling=params))
    assert got[1] == alone_tokens(Request(1, tuple(PROMPT), NEW, 0))
    assert got[0] != got[1]


@pytest.mark.parametrize(
    ("fields", "extra", "named"),
    [
        ({"presence_penalty": 3}, (), "presence_penalty"),
        ({"logit_bias": {"x": 1}}, (), "logit_bias"),
        ({"logit_bias": {"256": 1}}, (), "logit_bias"),
        ({"repetition_penalty": 1.2}, ("--check",), "repetition_penalty"),
    ],
)
def test_bad_lines_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields, extra, named
) -> None:
    status, _ = _generate(tmp_path, [{"prompt": PROMPT, **fields}], *extra)
    assert status == 2
    assert named in capsys.readouterr().err
