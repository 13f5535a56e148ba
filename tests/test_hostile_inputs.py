"""The hostile-inputs table: every hostile model file, tokenizer, template,
request, prompt or sizing file, interruption, concurrent misuse and output
file the other tests build, run through its entry point (the CLI's ``main``
in-process, or the library call), each with the outcome it must have: exit 2
or a typed error naming the file and field, never a traceback.

``GRAPHRUNNER_WRITE_RESULTS=1`` writes the table to
``bench/results/hostile-inputs.md`` when every case is as expected.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hostile_model_cases import model_file_cases
from hostile_run_cases import run_cases
from hostile_table import Case, Outcome, World, check, table

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "hostile-inputs.md"
CASES = [*model_file_cases(), *run_cases()]
ROWS: dict[int, Outcome] = {}
HEADER = [
    "# hostile inputs",
    "",
    "Each hostile input the tests build, run through the entry point a user",
    "would call: the CLI (`graphrunner_ref.cli.main.main`, in-process) or the library.",
    "*outcome*: the exit status, the exception type, both (`exit 2 (Type)`: the",
    "CLI's status, the type the library call raises), or `ok` where the input is",
    "handled without an error (the last column then says what was observed).",
    "Every row is checked: a traceback, an untyped error or an error that no",
    "longer names its file or field fails `tests/test_hostile_inputs.py`.",
    "",
    "Regenerate: `GRAPHRUNNER_WRITE_RESULTS=1 .venv/bin/python -m pytest -q",
    "tests/test_hostile_inputs.py` (the table is written only when every case",
    "passes).",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    threads = torch.get_num_threads()  # the CLI sets its own (--threads)
    w = World(tmp_path_factory.mktemp("hostile"))
    yield w
    torch.set_num_threads(threads)
    if os.environ.get("GRAPHRUNNER_WRITE_RESULTS") == "1" and len(ROWS) == len(CASES):
        rows = [(case, ROWS[i]) for i, case in enumerate(CASES)]
        RESULTS.write_text(table(rows, w.root, HEADER))


def test_case_names_are_unique_within_an_entry_point() -> None:
    keys = [(c.group, c.name, c.entry) for c in CASES]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{c.group}: {c.name}"[:80] for c in CASES]
)
def test_each_hostile_input_has_its_outcome(index: int, world: World) -> None:
    case: Case = CASES[index]
    outcome = case.run(world)
    problem = check(case, outcome)
    assert not problem, f"{case.group}: {case.name} via {case.entry}: {problem}"
    ROWS[index] = outcome
    if outcome.kind == "skipped":
        pytest.skip(outcome.text)
