"""The GGUF cache: keyed by content, not by file name; processes converting
the same file at once coordinate (one converts, the others reuse)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import graphrunner_ref.io.gguf_cache as cache
from graphrunner_ref.io.gguf_cache import CACHE_ENV, checkpoint_dir
from graphrunner_ref.io.gguf_import import GGUFImportError
from test_gguf_hostile import write

# Each process says it is ready, waits for the others, and converts slowly, so
# that all of them look for the entry before any has written it.
CONVERT = """
import sys, time
from pathlib import Path
import graphrunner_ref.io.gguf_cache as cache
gguf, ready, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
slow = cache.convert_gguf
def convert(*args):
    time.sleep(1.0)
    return slow(*args)
cache.convert_gguf = convert
ready.touch()
while not go.exists():
    time.sleep(0.01)
print(cache.checkpoint_dir(gguf))
"""


def test_the_same_bytes_under_another_name_reuse_one_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = write(tmp_path / "model.gguf")
    second = tmp_path / "renamed-copy.gguf"
    shutil.copy(first, second)
    converted: list[Path] = []
    convert = cache.convert_gguf

    def counted(path: Path, out: Path) -> Path:
        converted.append(path)
        return convert(path, out)

    monkeypatch.setattr(cache, "convert_gguf", counted)
    out = checkpoint_dir(first)
    assert checkpoint_dir(second) == out
    assert converted == [first]  # the copy under another name did not convert again
    assert "converted" in capsys.readouterr().err.splitlines()[0]
    entries = [p.name for p in (tmp_path / "cache" / "checkpoints").iterdir()]
    assert [e for e in entries if not e.startswith(".")] == [out.name]


def test_the_key_is_the_whole_content_hashed_with_progress_past_a_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = write(tmp_path / "model.gguf")
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 1  # one bit in the middle: the key must see it
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    digest = hashlib.sha256(first.read_bytes()).hexdigest()[:32]
    assert cache.converted_dir(first) == tmp_path / "cache" / "checkpoints" / f"gguf-{digest}"
    assert cache.converted_dir(other) != cache.converted_dir(first)
    assert "hashing" not in capsys.readouterr().err  # small: no bar
    monkeypatch.setattr(cache, "_PROGRESS_BYTES", 0)
    cache.converted_dir(first)
    assert "hashing model.gguf" in capsys.readouterr().err


def test_processes_converting_one_file_at_once_all_get_it(tmp_path: Path) -> None:
    gguf = write(tmp_path / "model.gguf")
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT, str(gguf), str(tmp_path / f"ready{i}"), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(3)):
        assert time.monotonic() < deadline, "the converting processes did not start"
        time.sleep(0.05)
    go.touch()
    results = [p.communicate(timeout=240) + (p.returncode,) for p in procs]
    assert [code for _, _, code in results] == [0, 0, 0], [err for _, err, _ in results]
    assert len({out.strip() for out, _, _ in results}) == 1
    verbs = sorted(err.split()[0] for _, err, _ in results)
    assert verbs == ["converted", "using", "using"]
    assert (Path(results[0][0].strip()) / "config.json").is_file()
    cached = list((tmp_path / "cache" / "checkpoints").iterdir())
    assert [p.name for p in cached if p.name.endswith(".lock")] == []  # no stray lock file


def test_a_gguf_that_cannot_convert_is_named_and_leaves_no_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    bad = write(tmp_path / "bad.gguf", meta={"attention.head_count": 0})
    with pytest.raises(GGUFImportError) as caught:
        checkpoint_dir(bad)
    assert str(caught.value) == (f"{bad}: GGUF llama.attention.head_count=0: expected an int >= 1")
    entries = list((tmp_path / "cache" / "checkpoints").iterdir())
    assert [p.name for p in entries if not p.name.endswith(".lock")] == []
    assert entries == []  # the lock file went with the failed conversion
