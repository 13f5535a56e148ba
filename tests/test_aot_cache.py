"""The CPU runner's program saved ahead of time (``aot_cache``): a warm capture
loads it without tracing and replays what the cold one does; a stale, foreign
or damaged artifact is refused, with the reason, and rebuilt, never run.

One real AOTInductor build (the toy model, module-scoped); the refusals that
would rebuild put that pristine artifact back instead of compiling again."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from graphrunner import create_runner
from graphrunner.declare.decode import decode_buffer_specs
from graphrunner.mechanisms import aot
from graphrunner.testing import ToyWorld
from tests.poison import assert_state_matches, poison_tails, stale_values

SIZES = [1, 2, 4]
Built = tuple[Path, Any, ToyWorld]
KEY = {"model": "toy", "dtype": "float32", "cpu features": "test"}


def _runner(
    world: ToyWorld, cache: Path, key: dict[str, str] | None = None, sizes: list[int] = SIZES
) -> Any:
    return create_runner(
        world.model,
        decode_buffer_specs(),
        device="cpu",
        kind="cpu",
        capture_sizes=sizes,
        show_progress=False,
        aot_cache=cache,
        aot_key=KEY if key is None else key,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """A cold capture that builds the artifact; the folder, its runner, its world."""
    cache = tmp_path_factory.mktemp("aot")
    world = ToyWorld("cpu")
    runner = _runner(world, cache)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        report = runner.capture()
    # torch's export warns of its own deprecated calls: not the user's to see.
    assert not [w for w in said if issubclass(w.category, FutureWarning)], said
    assert runner.mechanism.aot_status == "built (none saved)"
    assert report.start == "cold" and [s.programs for s in report.sizes] == [1, 0, 0]
    return cache, runner, world


def _artifact(cache: Path) -> Path:
    (folder,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return folder


def _copy(built: Built, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(built[0], cache)
    return cache


def test_warm_load_replays_equal_to_the_cold_program(built: Built, tmp_path: Path) -> None:
    """The loaded program, in another world (other tensors, same shapes),
    gives the cold program's outputs and KV writes bit for bit at every raw
    size, padded tails poisoned with live indices, and equals eager."""
    cold_runner, cold_world = built[1], built[2]
    world = ToyWorld("cpu")
    warm = _runner(world, _copy(built, tmp_path))
    report = warm.capture()
    assert warm.mechanism.aot_status == "loaded"
    assert report.start == "warm" and report.cache_hits == report.compilations == 1
    for raw_bs in (1, 2, 3, 4):
        results = []
        for runner, w in ((cold_runner, cold_world), (warm, world)):
            batch = w.make_batch(raw_bs, seed=raw_bs)
            expected, expected_state = w.eager_reference(batch)
            poison_tails(runner, raw_bs, stale_values(w, batch))
            live = set(batch.out_cache_loc.tolist())
            out = runner.replay(batch).clone()
            torch.testing.assert_close(out, expected)
            state = w.state()
            for name in ("k", "v"):
                assert_state_matches(
                    state[name], expected_state[name], live, exact=False, name=name
                )
            results.append((out, state))
        (cold_out, cold_state), (warm_out, warm_state) = results
        assert torch.equal(cold_out, warm_out)
        for name in ("k", "v"):
            assert torch.equal(cold_state[name][1:], warm_state[name][1:])


def test_a_program_of_size_one_alone_is_saved_and_loaded(tmp_path: Path) -> None:
    """Capturing size 1 alone (a batch-1 server) saves a program of that one
    size (export has no symbolic range 1..1), and a warm capture loads it and
    replays what eager gives."""
    cache = tmp_path / "cache"
    outputs = []
    for status in ("built (none saved)", "loaded"):
        world = ToyWorld("cpu")
        runner = _runner(world, cache, sizes=[1])
        runner.capture()
        assert runner.mechanism.aot_status == status
        batch = world.make_batch(1, seed=1)
        expected, _ = world.eager_reference(batch)
        outputs.append(runner.replay(batch).clone())
        torch.testing.assert_close(outputs[-1], expected)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize(
    "field", ["torch", "max size", "buffers", "cpu capability", "model", "dtype", "cpu features"]
)
def test_a_manifest_changed_in_a_key_field_is_refused_and_rebuilt(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """The folder is right but its manifest says another torch, size, dtype,
    CPU or model: refused naming the field, rebuilt (here: the pristine
    artifact put back), and the new manifest holds the current value."""
    cache = _copy(built, tmp_path)
    manifest_path = _artifact(cache) / aot.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    current = manifest["key"][field]
    manifest["key"][field] = current + "-other"
    manifest_path.write_text(json.dumps(manifest))
    rebuilt = _fake_rebuild(built, monkeypatch)
    runner = _runner(ToyWorld("cpu"), cache)
    runner.capture()
    status = runner.mechanism.aot_status
    assert status.startswith(f"built (refused: {field} differs: saved '{current}-other'"), status
    assert rebuilt == [1]
    assert json.loads(manifest_path.read_text())["key"][field] == current


def _fake_rebuild(built: Built, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """AotPrograms._build replaced by a copy of the pristine artifact (no compile)."""
    calls: list[int] = []
    pristine = _artifact(built[0])

    def build(self: Any, folder: Path, key: Any, forward: Any, view: Any) -> None:
        calls.append(1)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(pristine, folder)
        self._manifest = json.loads((folder / aot.MANIFEST).read_text())
        self._open(folder / aot.PACKAGE)

    monkeypatch.setattr(aot.AotPrograms, "_build", build)
    return calls


def test_a_changed_key_looks_in_another_folder(built: Built, tmp_path: Path) -> None:
    """Another model (the caller's key) is another artifact: nothing of the
    saved one is read, a new one is built beside it."""
    cache = _copy(built, tmp_path)
    runner = _runner(ToyWorld("cpu"), cache, key={**KEY, "model": "another"})
    mechanism = runner.mechanism
    mechanism.aot._build = lambda *a: (_ for _ in ()).throw(aot.AotRefused("not built here"))
    with pytest.warns(RuntimeWarning, match="not built here"):
        runner.capture()
    assert mechanism.aot_status == "refused (not built here)"
    assert runner.compilations == 1  # compiled as without a cache


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing", "manifest"])
def test_a_damaged_artifact_is_refused_and_rebuilt(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    cache = _copy(built, tmp_path)
    folder = _artifact(cache)
    package = folder / aot.PACKAGE
    data = package.read_bytes()
    if damage == "truncated":
        package.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        package.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    elif damage == "missing":
        package.unlink()
    else:
        (folder / aot.MANIFEST).write_text('{"key": {"torch"')
    rebuilt = _fake_rebuild(built, monkeypatch)
    runner = _runner(ToyWorld("cpu"), cache)
    runner.capture()
    status = runner.mechanism.aot_status
    why = {"manifest": "manifest unreadable", "missing": "package missing"}.get(
        damage, "package damaged"
    )
    assert status.startswith(f"built (refused: {why}"), status
    assert rebuilt == [1]


def test_a_foreign_model_of_other_shapes_is_refused_by_its_tensor(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest whose key matches but whose arguments do not (a model of
    another width under the same key): refused naming the tensor."""
    from graphrunner.testing import ToyWorldConfig

    cache = _copy(built, tmp_path)
    world = ToyWorld("cpu", ToyWorldConfig(vocab=101))
    rebuilt = _fake_rebuild(built, monkeypatch)
    runner = _runner(world, cache)
    with pytest.raises(aot.AotRefused):  # the pristine copy put back is foreign too
        runner.capture()
    assert rebuilt == [1]
    status = runner.mechanism.aot_status
    assert "refused: forward." in status and "has shape" in status, status


def test_a_failed_build_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that dies after its package is written leaves no folder under
    the key (nor a staging one): the next capture finds none; this one says
    why and compiles as without the cache."""
    cache = tmp_path / "cache"
    world = ToyWorld("cpu")

    def dies(self: Any, flat: Any, args: Any, dynamic: Any) -> Path:
        stage = tmp_path / "stage"
        stage.mkdir()
        (stage / aot.PACKAGE).write_bytes(b"half")
        return stage / aot.PACKAGE

    monkeypatch.setattr(aot.AotPrograms, "_compile", dies)
    monkeypatch.setattr(aot.AotPrograms, "_measure", lambda *args: 0.0)  # "half" never runs
    real_dump = json.dump

    def dump(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(aot.json, "dump", dump)
    runner = _runner(world, cache)
    with pytest.warns(RuntimeWarning, match="cannot save in .*disk full"):
        runner.capture()  # compiled as without the cache
    monkeypatch.setattr(aot.json, "dump", real_dump)
    assert runner.mechanism.aot_status.startswith("refused (cannot save in")
    assert not cache.exists() or list(cache.iterdir()) == []
    batch = world.make_batch(3, seed=3)
    expected, _ = world.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), expected)


def test_a_folder_moved_aside_by_another_process_compiles_as_without(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes saving the same key at once: the other one moves this
    one's fresh folder aside right after it was written. The capture does not
    fail: it says why and compiles as without the cache."""
    pristine = _artifact(built[0]) / aot.PACKAGE

    def compiled(self: Any, flat: Any, args: Any, dynamic: Any) -> Path:
        stage = tmp_path / "stage"
        stage.mkdir()
        shutil.copy(pristine, stage / aot.PACKAGE)
        return stage / aot.PACKAGE

    real_write = aot._write

    def write_then_lose(folder: Path, manifest: Any, package: Path) -> None:
        real_write(folder, manifest, package)
        shutil.rmtree(folder)  # the other process's rename, at the worst moment

    monkeypatch.setattr(aot.AotPrograms, "_compile", compiled)
    monkeypatch.setattr(aot, "_write", write_then_lose)
    world = ToyWorld("cpu")
    runner = _runner(world, tmp_path / "cache")
    with pytest.warns(RuntimeWarning, match="cannot save in"):
        runner.capture()
    assert runner.mechanism.aot_status.startswith("refused (cannot save in")
    batch = world.make_batch(3, seed=3)
    expected, _ = world.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), expected)


def test_the_aot_cache_flag_and_the_references_key(tmp_path: Path) -> None:
    """``--aot-cache DIR`` is the engine config's; the reference keys the CPU
    runners' programs by its model, dtype, quantize mode and CPU."""
    from graphrunner_ref.cli import main as cli
    from graphrunner_ref.cli.options import config_of
    from graphrunner_ref.engine.bundle import aot_key
    from graphrunner_ref.model import default_model
    from graphrunner_ref.model.attention_cpu import ATTENTION_BUILD
    from graphrunner_ref.model.cpu_kernels import KERNEL_BUILD

    args = cli._parse(["generate", "--prompt", "[1, 2]", "--aot-cache", str(tmp_path)])
    assert config_of(args, "cpu", [1]).aot_cache == str(tmp_path)
    key = aot_key(default_model(max_requests=2, max_context_len=16))
    assert {"model", "modules", "dtype", "quantize", "cpu features", "kernel builds"} <= set(key)
    assert KERNEL_BUILD in key["kernel builds"] and ATTENTION_BUILD in key["kernel builds"]
    assert key["dtype"] == "float32" and key["quantize"] == "None"


def test_the_key_follows_which_product_each_projection_runs() -> None:
    """Two int4-q8 models alike but for the q/k/v projection's product (8-bit
    inputs or float32 ones, the same weights) key their programs apart."""
    from bench.bench_q8_inputs import with_float_inputs
    from graphrunner_ref.engine.bundle import aot_key
    from graphrunner_ref.model import default_model
    from graphrunner_ref.model.quantize import quantize_model

    keys = []
    for kinds in (None, ()):
        bundle = default_model(max_requests=2, max_context_len=16)
        with_float_inputs(quantize_model(bundle.model, "int4-q8"), kinds)
        keys.append(aot_key(bundle))
    assert keys[0]["modules"] != keys[1]["modules"]
    assert {k: v for k, v in keys[0].items() if k != "modules"} == {
        k: v for k, v in keys[1].items() if k != "modules"
    }


def test_a_program_whose_outputs_differ_from_eager_is_refused(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load runs the program once against the eager forward: a difference
    (here: every comparison said false) is refused and rebuilt."""
    cache = _copy(built, tmp_path)
    rebuilt = _fake_rebuild(built, monkeypatch)
    monkeypatch.setattr(aot, "_close", lambda *args: False)
    runner = _runner(ToyWorld("cpu"), cache)
    runner.capture()
    assert runner.mechanism.aot_status == (
        "built (refused: the loaded program's outputs differ from the eager forward's)"
    )
    assert rebuilt == [1]


@pytest.mark.parametrize(("largest_doubled", "saved"), [(8, True), (2, False)])
def test_a_decision_on_the_batch_is_saved_where_every_size_decides_alike(
    tmp_path: Path, largest_doubled: int, saved: bool
) -> None:
    """A forward that branches on its batch in Python (``--prefill-bf16``'s
    row threshold): traced at the largest size, the program serves every
    size up to it, so it is saved and loaded where each captured size takes
    the traced branch, refused (naming the guard) where one does not, and
    every size replays what eager gives either way."""
    cache = tmp_path / "cache"
    statuses = ["built (none saved)", "loaded"] if saved else ["refused"]
    for status in statuses:
        world = ToyWorld("cpu")
        runner = create_runner(
            _Branching(world.model, largest_doubled), decode_buffer_specs(), device="cpu",
            kind="cpu", capture_sizes=SIZES, show_progress=False, aot_cache=cache, aot_key=KEY,
        )  # fmt: skip
        runner.capture()
        assert runner.mechanism.aot_status.startswith(status), runner.mechanism.aot_status
        if not saved:
            assert "shape guards: " in runner.mechanism.aot_status
        for raw_bs in (1, 2, 3, 4):
            batch = world.make_batch(raw_bs, seed=raw_bs)
            expected, _ = world.eager_reference(batch)
            doubled = runner.graph_size_for(raw_bs) <= largest_doubled
            torch.testing.assert_close(
                runner.replay(batch), expected * 2 if doubled else expected - 1
            )


class _Branching(torch.nn.Module):
    """The toy model's logits doubled up to a batch of ``largest_doubled``
    rows, less 1 above (a Python branch on the batch)."""

    def __init__(self, model: torch.nn.Module, largest_doubled: int) -> None:
        super().__init__()
        self.model, self.largest_doubled = model, largest_doubled

    def forward(self, b: Any) -> torch.Tensor:
        logits = self.model(b)
        return logits * 2 if b.input_ids.shape[0] <= self.largest_doubled else logits - 1


def test_a_load_may_differ_from_eager_by_twice_what_the_build_measured(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build records how far its program is from the eager forward (a
    step quantizing its activations rounds otherwise compiled); a load
    compares with twice that, no more."""
    cache = _copy(built, tmp_path)
    manifest_path = _artifact(cache) / aot.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    assert 0.0 <= manifest["eager deviation"] < 1e-4  # the toy's float32 program
    manifest["eager deviation"] = 0.01
    manifest_path.write_text(json.dumps(manifest))
    slacks: list[float] = []
    real = aot._close

    def spy(a: torch.Tensor, b: torch.Tensor, slack: float = 0.0) -> bool:
        slacks.append(slack)
        return real(a, b, slack)

    monkeypatch.setattr(aot, "_close", spy)
    runner = _runner(ToyWorld("cpu"), cache)
    runner.capture()
    assert runner.mechanism.aot_status == "loaded"
    assert slacks and set(slacks) == {0.02}


def test_close_allows_the_slack_and_no_more() -> None:
    b = torch.linspace(-3, 3, 64)
    a = b + 0.01 * (1 + 3)  # off by 0.01 in units of one plus the largest magnitude
    assert not aot._close(a, b)
    assert not aot._close(a, b, 0.005)
    assert aot._close(a, b, 0.011)
    assert aot._deviation([a], [b]) == pytest.approx(0.01, rel=1e-4)
    assert not aot._close(torch.tensor([1, 2]), torch.tensor([1, 3]), 1.0)  # ints: exact
