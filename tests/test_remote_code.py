"""A checkpoint's own Python never runs: a tokenizer config with ``auto_map``
pointing at a module in the checkpoint is not imported, and nothing asks on
stdin (were it asked, its answer would be "y")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_world import tiny_text_checkpoint

# transformers copies the module into its own cache before importing it: the
# marker goes to an absolute path inside the checkpoint.
EVIL = """
from pathlib import Path
Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import PreTrainedTokenizerFast as EvilTokenizer
"""


def remote_code_checkpoint(path: Path) -> Path:
    """A tiny text checkpoint at ``path`` whose tokenizer config maps
    ``AutoTokenizer`` to its own module, which writes ``path / "RAN"`` if run."""
    tiny_text_checkpoint(path)
    (path / "evil.py").write_text(EVIL.format(marker=str(path / "RAN")))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "EvilTokenizer"  # a class only the module defines
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return remote_code_checkpoint(tmp_path_factory.mktemp("remote") / "hf")


def test_the_checkpoints_tokenizer_code_is_never_run(hostile: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from graphrunner_ref.io.text import TextCodec\n"
        "try:\n"
        "    TextCodec.load(Path(sys.argv[1]), what='--prompt')\n"
        "    print('loaded')\n"
        "except ValueError as e:\n"
        "    print('refused', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(hostile)],
        input="y\n",  # were it asked, the answer would be yes
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # graphrunner's one-line refusal naming the file, not transformers' own words
    assert proc.stdout.startswith(f"refused {hostile}: {hostile / 'tokenizer_config.json'}")
    assert "graphrunner runs no checkpoint code" in proc.stdout
    assert "trust_remote_code" not in proc.stdout
    assert not (hostile / "RAN").exists()
