"""populate: every pad rule writes exactly its value, only on the tail; every
bad input is a named error; nothing else in the library writes pad values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graphrunner import BufferSpec, PadRule
from graphrunner.declare import StaticBuffers
from graphrunner.testing import ToyWorld
from graphrunner.writers import PopulateError, populate

POISON = -99
WIDTH = 3  # tokens per request of the per-token buffers
TOPK = 2  # candidates per request of the per-candidate buffer


def all_rule_specs() -> list[BufferSpec]:
    """Every rule, and per-request, per-token, per-candidate and host buffers at once."""
    return [
        BufferSpec("zero_i64", torch.int64, PadRule.ZERO),
        BufferSpec("fill_i32", torch.int32, PadRule.FILL, fill_value=5),
        BufferSpec("width_i64", torch.int64, PadRule.WIDTH, width=WIDTH),
        BufferSpec("keep_f32", torch.float32, PadRule.KEEP),
        BufferSpec("hidden", torch.float32, PadRule.ZERO, rows_per_request=WIDTH, extra_shape=(4,)),
        BufferSpec("fill_f32", torch.float32, PadRule.FILL, fill_value=0.5, rows_per_request=WIDTH),
        BufferSpec("topk_ids", torch.int64, PadRule.ZERO, rows_per_request=TOPK),
        BufferSpec("host_lens", torch.int64, PadRule.FILL, fill_value=7, host=True),
    ]


#: What each buffer of all_rule_specs() pads with, written out from the rules'
#: table (ZERO: 0, FILL: its value, WIDTH: the width, KEEP: untouched).
PAD_TABLE: dict[str, float] = {
    "zero_i64": 0,
    "fill_i32": 5,
    "width_i64": WIDTH,
    "keep_f32": POISON,
    "hidden": 0,
    "fill_f32": 0.5,
    "topk_ids": 0,
    "host_lens": 7,
}


def test_a_smaller_batch_after_a_larger_one_leaves_no_stale_live_row() -> None:
    """Rows 3..7 held live values of a batch of 8; a batch of 3 padded to 4
    must pad row 3, and leave rows 4..7 (past the captured size) alone."""
    bufs = StaticBuffers(all_rule_specs(), max_bs=10, device="cpu")
    populate(bufs, inputs_for(bufs, 8), 8, 8)
    big = {n: t.clone() for n, t in bufs.tensors.items()}
    small = inputs_for(bufs, 3)
    for t in small.__dict__.values():
        t.add_(1000)  # other values than the large batch's
    populate(bufs, small, 3, 4)
    for spec in bufs.specs:
        buf = bufs.tensors[spec.name]
        live, total = bufs.rows(spec, 3), bufs.rows(spec, 4)
        assert torch.equal(buf[:live], getattr(small, spec.name)), spec.name
        tail = buf[live:total]
        pad = big[spec.name][live:total] if spec.rule is PadRule.KEEP else PAD_TABLE[spec.name]
        assert torch.equal(tail, torch.full_like(tail, 0) + pad), spec.name
        assert torch.equal(buf[total:], big[spec.name][total:]), spec.name


def inputs_for(bufs: StaticBuffers, raw_bs: int) -> SimpleNamespace:
    fields = {}
    for spec in bufs.specs:
        shape = (bufs.rows(spec, raw_bs), *spec.extra_shape)
        fields[spec.name] = (
            (torch.arange(torch.Size(shape).numel()) + 100).view(shape).to(spec.dtype)
        )
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(("raw_bs", "bs"), [(0, 4), (1, 1), (1, 4), (3, 4), (4, 4), (2, 8), (8, 8)])
def test_each_rule_writes_its_value_on_the_tail_only(raw_bs: int, bs: int):
    bufs = StaticBuffers(all_rule_specs(), max_bs=10, device="cpu")
    for t in bufs.tensors.values():
        t.fill_(POISON)
    inputs = inputs_for(bufs, raw_bs) if raw_bs else None
    populate(bufs, inputs, raw_bs, bs)
    for spec in bufs.specs:
        buf = bufs.tensors[spec.name]
        live, total = bufs.rows(spec, raw_bs), bufs.rows(spec, bs)
        if raw_bs:
            assert torch.equal(buf[:live], getattr(inputs, spec.name)), spec.name
        tail = buf[live:total]
        expected = PAD_TABLE[spec.name]  # the design table, not spec.pad_value()
        assert torch.equal(tail, torch.full_like(tail, expected)), spec.name
        rest = buf[total:]
        assert torch.equal(rest, torch.full_like(rest, POISON)), f"{spec.name} past bs touched"


def test_device_ops_are_grouped_by_dtype():
    bufs = StaticBuffers(all_rule_specs(), max_bs=10, device="cpu")
    # On the CPU the int64 [bs] buffers (the host one too) share one
    # allocation, written by one cat: into the storage itself at the largest
    # size, else into staging plus one copy out. The others go by (device,
    # dtype), one foreach copy each (live rows and padded tails): int64
    # (top-k), int32, float32.
    pack = next(p for p in bufs.packs if len(p.names) > 1)
    assert pack.names == ("zero_i64", "width_i64", "host_lens")
    assert populate(bufs, inputs_for(bufs, 2), 2, 4) == 2 + 3
    assert populate(bufs, inputs_for(bufs, 4), 4, 4) == 2 + 3  # no tail
    assert populate(bufs, None, 0, 4) == 2 + 3  # tails only
    assert populate(bufs, inputs_for(bufs, 2), 2, 10) == 1 + 3  # the largest size


def test_a_pack_is_one_allocation_of_contiguous_rows():
    bufs = StaticBuffers(all_rule_specs(), max_bs=10, device="cpu")
    for pack in bufs.packs:
        for i, name in enumerate(pack.names):
            buf = bufs.tensors[name]
            assert buf.is_contiguous() and buf.data_ptr() == pack.storage[i].data_ptr()
    assert sorted(n for p in bufs.packs for n in p.names) == sorted(bufs.tensors)


def test_each_buffer_has_its_own_rows_per_request():
    bufs = StaticBuffers(all_rule_specs(), max_bs=10, device="cpu")
    shapes = {name: tuple(t.shape) for name, t in bufs.tensors.items()}
    assert shapes["zero_i64"] == (10,)
    assert shapes["hidden"] == (10 * WIDTH, 4) and shapes["fill_f32"] == (10 * WIDTH,)
    assert shapes["topk_ids"] == (10 * TOPK,)
    view = bufs.view(3)
    assert view.zero_i64.shape == (3,) and view.hidden.shape == (3 * WIDTH, 4)
    assert view.topk_ids.shape == (3 * TOPK,) and view.host_lens.shape == (3,)


def test_host_buffers_live_on_the_host_and_are_padded_by_populate():
    bufs = StaticBuffers(all_rule_specs(), max_bs=10, device="meta")
    assert bufs.tensors["host_lens"].device.type == "cpu"
    assert bufs.tensors["zero_i64"].device.type == "meta"
    inputs = SimpleNamespace(
        **{
            s.name: torch.zeros(s.rows(2), *s.extra_shape, dtype=s.dtype, device=bufs.device_of(s))
            for s in bufs.specs
        }
    )
    inputs.host_lens = torch.tensor([11, 12])
    populate(bufs, inputs, 2, 4)
    assert bufs.tensors["host_lens"][:5].tolist() == [11, 12, 7, 7, 0]
    inputs.host_lens = inputs.host_lens.to("meta")  # a device tensor for a host buffer
    with pytest.raises(PopulateError, match="'host_lens' is on meta, expected cpu"):
        populate(bufs, inputs, 2, 4)


@pytest.fixture
def bufs() -> StaticBuffers:
    return StaticBuffers(all_rule_specs(), max_bs=10, device="cpu")


def test_missing_input_names_the_field(bufs: StaticBuffers):
    inputs = inputs_for(bufs, 2)
    del inputs.fill_i32
    with pytest.raises(PopulateError, match="'fill_i32' is missing"):
        populate(bufs, inputs, 2, 4)


def test_wrong_dtype_names_the_field(bufs: StaticBuffers):
    inputs = inputs_for(bufs, 2)
    inputs.width_i64 = inputs.width_i64.to(torch.int32)
    with pytest.raises(
        PopulateError, match=r"'width_i64' has dtype torch.int32, expected torch.int64"
    ):
        populate(bufs, inputs, 2, 4)


def test_wrong_device_names_the_field(bufs: StaticBuffers):
    inputs = inputs_for(bufs, 2)
    inputs.zero_i64 = inputs.zero_i64.to("meta")
    with pytest.raises(PopulateError, match="'zero_i64' is on meta, expected cpu"):
        populate(bufs, inputs, 2, 4)


@pytest.mark.parametrize("field", ["zero_i64", "hidden"])
def test_wrong_length_names_the_field(bufs: StaticBuffers, field: str):
    inputs = inputs_for(bufs, 2)
    setattr(inputs, field, getattr(inputs, field)[:-1])
    with pytest.raises(PopulateError, match=f"'{field}' has shape"):
        populate(bufs, inputs, 2, 4)


def test_not_a_tensor_and_bad_sizes(bufs: StaticBuffers):
    inputs = inputs_for(bufs, 2)
    inputs.keep_f32 = [1.0, 2.0]
    with pytest.raises(PopulateError, match="'keep_f32' must be a torch.Tensor"):
        populate(bufs, inputs, 2, 4)
    with pytest.raises(PopulateError, match="raw_bs=5, bs=4"):
        populate(bufs, inputs_for(bufs, 5), 5, 4)
    with pytest.raises(PopulateError, match="bs=11"):
        populate(bufs, inputs_for(bufs, 2), 2, 11)
    with pytest.raises(PopulateError, match="inputs are required"):
        populate(bufs, None, 2, 4)


def test_a_0d_input_names_the_field(bufs: StaticBuffers):
    inputs = inputs_for(bufs, 1)
    inputs.width_i64 = torch.tensor(3)
    with pytest.raises(PopulateError, match=r"'width_i64' has shape \(\)"):
        populate(bufs, inputs, 1, 4)


def test_an_input_with_autograd_history_is_copied_as_data(bufs: StaticBuffers):
    inputs = inputs_for(bufs, 2)
    inputs.hidden = inputs.hidden * torch.ones(4, requires_grad=True)
    populate(bufs, inputs, 2, 4)
    assert torch.equal(bufs.tensors["hidden"][: 2 * WIDTH], inputs.hidden.detach())
    assert all(not t.requires_grad for t in bufs.tensors.values())
    populate(bufs, inputs_for(bufs, 3), 3, 4)  # the buffers are still plain data


def test_failed_populate_writes_nothing(bufs: StaticBuffers):
    for t in bufs.tensors.values():
        t.fill_(POISON)
    inputs = inputs_for(bufs, 2)
    inputs.fill_f32 = inputs.fill_f32.double()  # the last field is the bad one
    with pytest.raises(PopulateError):
        populate(bufs, inputs, 2, 4)
    for name, t in bufs.tensors.items():
        assert torch.equal(t, torch.full_like(t, POISON)), name


def test_only_populate_writes_pad_values(monkeypatch: pytest.MonkeyPatch):
    """Replace populate by a copy-only version: if any other code (runner,
    replay, backend hook) wrote a pad value, the sentinel tail would change."""
    from graphrunner import create_runner, decode_buffer_specs

    world = ToyWorld()
    runner = create_runner(
        world.model,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[8],
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    # A valid index everywhere (so the forward still runs) that is no pad value
    # (0, or the seq_lens fill 1): a stray pad write would show.
    sentinel = 2
    assert all(s.pad_value() != sentinel for s in runner.buffers.specs)

    def copy_live_rows_only(sources: list, raw_bs: int, bs: int) -> int:
        bufs = runner.buffers
        for spec, src in zip(bufs.specs, sources, strict=True):
            bufs.tensors[spec.name][:raw_bs].copy_(src)
        return 0

    # The replay path's writer (the runner's torch writer, after validation).
    monkeypatch.setattr(runner.writer, "write", copy_live_rows_only)
    batch = world.make_batch(3, seed=0)
    for t in runner.buffers.tensors.values():
        t[3:].fill_(sentinel)
    runner.replay(batch)
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t[3:], torch.full_like(t[3:], sentinel)), f"{name} tail written"
