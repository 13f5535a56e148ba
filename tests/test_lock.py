"""The quick start installs through the lock: every package of the
environment running the tests has the exact version ``constraints.txt``
names, and the lock names every one. ``make test-latest`` runs the suite on
the newest versions instead (``GRAPHRUNNER_UNLOCKED=1``), and says there what
differs from the lock."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dev"))
import lock  # noqa: E402

UNLOCKED = os.environ.get("GRAPHRUNNER_UNLOCKED", "0") != "0"


@pytest.mark.skipif(UNLOCKED, reason="make test-latest: newer versions than the lock, on purpose")
def test_every_installed_version_is_the_locked_one() -> None:
    rows = lock.differences(lock.read_lock(), lock.installed())
    assert not rows, "installed versions differ from constraints.txt (make install uses it):\n" + (
        "\n".join(f"  {name}: locked {locked}, installed {got}" for name, locked, got in rows)
    )


def test_the_lock_pins_the_quick_start_s_packages() -> None:
    pins = lock.read_lock()
    for name in ("torch", "transformers", "tokenizers", "fastapi", "pydantic", "uvicorn", "pip"):
        assert name in pins, f"constraints.txt has no version of {name}"


def test_a_different_version_is_named_with_both_sides(tmp_path: Path) -> None:
    path = tmp_path / "constraints.txt"
    path.write_text("# a comment\ntorch==2.13.0\nnumpy==1.0  # old\nonly-locked==3\n")
    pins = lock.read_lock(path)
    have = {"torch": "2.13.0", "numpy": "2.4.6", "only-installed": "1"}
    assert lock.differences(pins, have) == [
        ("numpy", "1.0", "2.4.6"),
        ("only-installed", "-", "1"),
        ("only-locked", "3", "-"),
    ]


def test_a_line_that_is_not_an_exact_pin_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "constraints.txt"
    path.write_text("torch>=2.4\n")
    with pytest.raises(ValueError, match=r"constraints.txt:1: 'torch>=2.4' is not 'name==version'"):
        lock.read_lock(path)


def test_the_local_label_is_not_part_of_the_release() -> None:
    assert lock.release("2.13.0+cpu") == "2.13.0"
    assert lock.canonical("Typing_Extensions") == "typing-extensions"
