"""The lean replay path: every buffer poisoned before every replay still ends
with exactly its live rows and pad values (nothing stale read), outputs equal
the eager model's; only a step sealed by its own checks (a DecodeBatch, a
SpecBatch) skips the per-field checks, an object that merely says it is
sealed is checked in full every time; a backend of the older protocol still runs, an
incomplete one is refused at construction; the seq_lens fill is spec data."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import graphrunner
from graphrunner import BufferSpec, GraphRunner, PadRule, create_runner, decode_buffer_specs
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.phases import SpecBatch
from graphrunner.testing import ToyWorld

POISON = -5
PACKAGE = pathlib.Path(graphrunner.__file__).parent


def _runner(world: ToyWorld, backend: object = None, **specs: bool) -> GraphRunner:
    runner = create_runner(
        world.model,
        decode_buffer_specs(**specs),
        device="cpu",
        capture_sizes=[1, 2, 4, 8],
        backend=backend,  # type: ignore[arg-type]
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    return runner


@pytest.mark.parametrize("raw_bs", range(1, 9))
def test_poisoned_buffers_hold_exactly_live_rows_and_pad_values_after_each_replay(raw_bs: int):
    world = ToyWorld()
    runner = _runner(world, host_seq_lens=True)
    batch = world.make_batch(raw_bs, seed=raw_bs)
    expected, _ = world.eager_reference(batch)
    bs = runner.graph_size_for(raw_bs)
    outs = []
    for _ in range(2):  # the second replay takes the cheap path: it must write everything too
        for t in runner.buffers.tensors.values():
            t.fill_(POISON)
        outs.append(runner.replay(batch).clone())
        # Float tolerance only: the padded forward multiplies more rows (BLAS blocking).
        torch.testing.assert_close(outs[-1], expected)
        for spec in runner.buffers.specs:
            buf = runner.buffers.tensors[spec.name]
            assert torch.equal(buf[:raw_bs], getattr(batch, spec.name)), spec.name
            pad = spec.pad_value()
            assert buf[raw_bs:bs].tolist() == [pad] * (bs - raw_bs), spec.name
            assert buf[bs:].tolist() == [POISON] * (runner.max_bs - bs), spec.name
    assert torch.equal(outs[0], outs[1])
    assert runner.input_gate.full_checks == 0  # a sealed DecodeBatch: never checked per field
    # One cat of the decode fields and the host buffer (one allocation on a
    # CPU) into the largest size's storage, or into staging and one copy out.
    assert runner.stats.last_populate_ops == (1 if bs == runner.max_bs else 2)


class _OwnBatch:
    """Not a DecodeBatch: an engine's own batch that says it is sealed."""

    def __init__(self, batch: DecodeBatch) -> None:
        self.batch_size = batch.batch_size
        self.device = batch.device
        self.sealed = True  # its word alone: no seal key, nothing checked
        for name, tensor in batch.tensors().items():
            setattr(self, name, tensor)

    def is_sealed(self) -> bool:
        return self.sealed


def test_an_object_that_says_it_is_sealed_is_checked_and_a_sealed_step_is_not():
    world = ToyWorld()
    runner = _runner(world)
    batch = world.make_batch(3, seed=1)
    expected, _ = world.eager_reference(batch)
    for count in (1, 2):  # every replay: nothing it says is taken on trust
        torch.testing.assert_close(runner.replay(_OwnBatch(batch)), expected)
        assert runner.input_gate.full_checks == count
    step = SpecBatch(**batch.tensors()).seal(runner.buffers.specs, "cpu")
    for _ in range(2):
        torch.testing.assert_close(runner.replay(step), expected)
    assert runner.input_gate.full_checks == 2  # the seal: checked once, where it was made
    bad = _OwnBatch(batch)
    bad.positions = bad.positions.float()
    with pytest.raises(graphrunner.writers.PopulateError, match=r"'positions' has dtype"):
        runner.replay(bad)


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_generic_replay_code_imports_no_phase():
    check = _imports(PACKAGE / "core" / "input_check.py")
    assert not any(n.startswith("graphrunner.batch") for n in check)
    tree = ast.parse((PACKAGE / "core" / "input_check.py").read_text())
    assert "DecodeBatch" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    runner = _imports(PACKAGE / "core" / "runner.py")
    assert not any(n.endswith("SEQ_LEN_BUFFERS") for n in runner)


class _OldBackend:
    """A backend written against the first protocol: no validate_inputs."""

    seq_len_fill_value = 1

    def __init__(self) -> None:
        self.replays = 0

    def init_graph_state(self, max_bs: int) -> None:
        pass

    def init_capture_metadata(self, bs: int, view: object) -> None:
        pass

    def init_replay_metadata(self, bs: int, raw_bs: int, view: object, inputs: object) -> None:
        self.replays += 1


def test_a_backend_of_the_older_protocol_runs_graph_and_eager_steps():
    world = ToyWorld()
    old = _OldBackend()
    runner = _runner(world, backend=old)
    batch = world.make_batch(3, seed=2)
    expected, _ = world.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), expected)
    assert old.replays == 1
    big = world.make_batch(9, seed=3)  # above every graph: the eager path validates too
    big_expected, _ = world.eager_reference(big)
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        torch.testing.assert_close(runner.replay(big), big_expected)


@pytest.mark.parametrize("missing", ["init_replay_metadata", "init_capture_metadata"])
def test_a_backend_missing_a_required_hook_is_refused_at_construction(missing: str):
    incomplete = type(
        "HalfBackend", (), {k: v for k, v in vars(_OldBackend).items() if k != missing}
    )
    with pytest.raises(TypeError, match=rf"backend HalfBackend does not define {missing}"):
        create_runner(
            lambda b: b.input_ids,
            decode_buffer_specs(),
            device="cpu",
            max_bs=2,
            backend=incomplete(),  # type: ignore[arg-type]
            show_progress=False,
            kind="eager",
        )


def test_the_backend_fill_is_declared_by_the_spec_not_its_name():
    class Backend(_OldBackend):
        seq_len_fill_value = 2

    flagged = BufferSpec("lens", torch.int64, PadRule.FILL, fill_value=1, backend_fill=True)
    with pytest.raises(ValueError, match="lens fill_value 1 differs from the backend's"):
        create_runner(
            lambda b: b.lens, [flagged], device="cpu", max_bs=2, backend=Backend(), kind="eager"
        )
    # A seq_lens of another meaning, not flagged, keeps its own fill.
    plain = BufferSpec("seq_lens", torch.int64, PadRule.FILL, fill_value=1)
    create_runner(
        lambda b: b.seq_lens, [plain], device="cpu", max_bs=2, backend=Backend(), kind="eager"
    )
    assert [s.name for s in decode_buffer_specs(host_seq_lens=True) if s.backend_fill] == [
        "seq_lens",
        "seq_lens_cpu",
    ]
