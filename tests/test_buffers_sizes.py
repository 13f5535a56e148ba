"""Buffer declarations and the capture-size policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphrunner import BufferSpec, PadRule, create_runner, decode_buffer_specs
from graphrunner.declare import StaticBuffers
from graphrunner.sizing import BatchSizeError, default_capture_sizes, pad_to, padding_waste
from graphrunner.sizing.sizes import validate_capture_sizes


def test_buffer_without_a_rule_is_an_error():
    with pytest.raises(ValueError, match="'seq_lens' declared without a pad rule"):
        BufferSpec("seq_lens", torch.int64, None)  # type: ignore[arg-type]


def test_fill_value_only_with_fill_rule():
    with pytest.raises(ValueError, match="fill_value is required"):
        BufferSpec("x", torch.int64, PadRule.FILL)
    with pytest.raises(ValueError, match="rule=ZERO, fill_value=3"):
        BufferSpec("x", torch.int64, PadRule.ZERO, fill_value=3)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.int64, 1.5),
        (torch.uint8, -1),
        (torch.int32, 2**31),
        (torch.bool, 2),
        (torch.float32, float("nan")),
        (torch.float32, 2**25 + 1),  # rounds to 2**25
        (torch.float16, 1e6),  # overflows to inf
        (torch.int64, "1"),
    ],
)
def test_fill_value_must_be_exact_in_the_dtype(dtype: torch.dtype, value: object):
    """populate would write a converted value the sanitizer then flags."""
    with pytest.raises(ValueError, match=f"fill_value {value!r} is not exactly representable"):
        BufferSpec("x", dtype, PadRule.FILL, fill_value=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(torch.int64, -1), (torch.uint8, 255), (torch.bool, True), (torch.float32, float("-inf"))],
)
def test_fill_values_that_fit_are_accepted(dtype: torch.dtype, value: int | float):
    BufferSpec("x", dtype, PadRule.FILL, fill_value=value)


@pytest.mark.parametrize("name", ["bs", "tensors"])
def test_names_the_view_itself_uses_are_refused(name: str):
    with pytest.raises(ValueError, match=f"buffer name '{name}' is taken by BufferView"):
        BufferSpec(name, torch.int64, PadRule.ZERO)


def test_specs_must_be_buffer_specs_and_buffers_stay_put():
    with pytest.raises(TypeError, match="expected BufferSpec, got tuple"):
        StaticBuffers([("input_ids", torch.int64)], 4, "cpu")  # type: ignore[list-item]
    bufs = StaticBuffers(decode_buffer_specs(), 4, "cpu")
    with pytest.raises(TypeError):  # populate's plans and the graphs hold these tensors
        bufs.tensors["seq_lens"] = torch.zeros(4, dtype=torch.int64)  # type: ignore[index]


def test_duplicate_names_and_bad_sizes_rejected():
    spec = BufferSpec("x", torch.int64, PadRule.ZERO)
    with pytest.raises(ValueError, match=r"more than once: \['x'\]"):
        StaticBuffers([spec, spec], 4, "cpu")
    with pytest.raises(ValueError, match="max_bs=0; expected an int >= 1"):
        StaticBuffers([spec], 0, "cpu")


def test_buffers_allocated_once_at_max_size():
    h = BufferSpec("h", torch.float16, PadRule.ZERO, rows_per_request=3, extra_shape=(5,))
    bufs = StaticBuffers([*decode_buffer_specs(), h], 16, "cpu")
    assert bufs.tensors["seq_lens"].shape == (16,)
    assert bufs.tensors["h"].shape == (48, 5) and bufs.tensors["h"].dtype == torch.float16
    view = bufs.view(4)
    assert view.h.data_ptr() == bufs.tensors["h"].data_ptr() and view.h.shape == (12, 5)
    assert bufs.view(4) is view


def test_decode_specs_follow_the_design_table():
    rules = {s.name: (s.rule, s.pad_value()) for s in decode_buffer_specs(seq_len_fill_value=2)}
    assert rules == {
        "input_ids": (PadRule.ZERO, 0),
        "req_pool_indices": (PadRule.ZERO, 0),
        "seq_lens": (PadRule.FILL, 2),
        "out_cache_loc": (PadRule.ZERO, 0),
        "positions": (PadRule.ZERO, 0),
    }


def test_backend_fill_value_must_match_spec():
    class Backend:
        seq_len_fill_value = 2

        def init_graph_state(self, max_bs: int) -> None: ...

    with pytest.raises(ValueError, match="fill_value 1 differs from the backend's"):
        create_runner(
            lambda v: v,
            decode_buffer_specs(),
            device="cpu",
            max_bs=4,
            backend=Backend(),
            kind="eager",
        )  # type: ignore[arg-type]


def test_default_sizes_dense_then_coarse_and_capped():
    sizes = default_capture_sizes(256)
    assert sizes[:8] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert sizes[-1] == 256 and all(b - a == 8 for a, b in zip(sizes[5:], sizes[6:], strict=False))
    assert default_capture_sizes(10) == [1, 2, 4, 8, 10]
    assert default_capture_sizes(1) == [1]
    big = default_capture_sizes(1000)
    assert big[-1] == 1000 and big == sorted(set(big)) and 512 in big
    steps = {b: b - a for a, b in zip(big, big[1:-1], strict=False)}  # the cap aside
    assert {steps[b] for b in steps if 256 < b <= 512} == {16}
    assert {steps[b] for b in steps if b > 512} == {32}


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ([], "empty"),
        ([0, 1], r"\[0\] must be positive"),
        ([2, 1], "sorted and unique"),
        ([1, 1], "sorted and unique"),
        ([1, 2.0], r"\[1\] must be an int"),
        ([True], "must be an int"),
        ({1, 2}, "must be ordered"),
    ],
)
def test_bad_size_lists(sizes: list, match: str):
    with pytest.raises(ValueError, match=match):
        validate_capture_sizes(sizes)


def test_pad_to_bisects_and_rejects_out_of_range():
    sizes = [1, 2, 4, 8]
    assert [pad_to(sizes, b) for b in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(BatchSizeError, match="exceeds the largest captured size 8"):
        pad_to(sizes, 9)
    with pytest.raises(BatchSizeError, match="must be >= 1, got 0"):
        pad_to(sizes, 0)


def test_padding_waste():
    waste = padding_waste([1, 2, 4, 8], [3, 5, 8])
    assert (waste.live_rows, waste.padded_rows) == (16, 4)
    assert waste.fraction == pytest.approx(0.2)


def test_size_policy_edge_cases():
    with pytest.raises(ValueError, match="max_bs must be a positive int, got True"):
        default_capture_sizes(True)  # type: ignore[arg-type]
    assert validate_capture_sizes(np.array([1, 2, 4])) == [1, 2, 4]  # NumPy ints are ints
    assert all(type(s) is int for s in validate_capture_sizes(np.array([1, 2])))
    for bad in (2.5, True):
        with pytest.raises(BatchSizeError, match="must be an int"):
            pad_to([1, 2, 4], bad)  # type: ignore[arg-type]
    with pytest.raises(BatchSizeError, match="no captured sizes"):
        pad_to([], 1)


def test_padding_waste_validates_sizes_and_counts_fallbacks_unpadded():
    with pytest.raises(ValueError, match="sorted and unique"):
        padding_waste([4, 2, 1], [3])
    waste = padding_waste([1, 2, 4], [3, 9])  # 3 -> 4 pads one row; 9 runs eagerly
    assert (waste.live_rows, waste.padded_rows) == (12, 1)


def test_width_only_with_the_width_rule_and_exact():
    assert BufferSpec("accept_lens", torch.int64, PadRule.WIDTH, width=4).pad_value() == 4
    with pytest.raises(ValueError, match="width is required with PadRule.WIDTH"):
        BufferSpec("accept_lens", torch.int64, PadRule.WIDTH)
    with pytest.raises(ValueError, match="rule=ZERO, width=4"):
        BufferSpec("x", torch.int64, PadRule.ZERO, width=4)
    with pytest.raises(ValueError, match="width=0; expected an int >= 1"):
        BufferSpec("x", torch.int64, PadRule.WIDTH, width=0)
    with pytest.raises(ValueError, match="width 300 is not exactly representable"):
        BufferSpec("x", torch.uint8, PadRule.WIDTH, width=300)


@pytest.mark.parametrize("rows", [0, -1, 1.0, True, "2"])
def test_rows_per_request_must_be_a_positive_int(rows: object):
    with pytest.raises(ValueError, match=f"rows_per_request={rows!r}; expected an int >= 1"):
        BufferSpec("x", torch.int64, PadRule.ZERO, rows_per_request=rows)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(0,), (2, -1), [4], (1.5,)])
def test_extra_shape_must_be_a_tuple_of_positive_ints(shape: object):
    with pytest.raises(ValueError, match="extra_shape=.*expected a tuple of ints >= 1"):
        BufferSpec("x", torch.int64, PadRule.ZERO, extra_shape=shape)  # type: ignore[arg-type]


def test_layout_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        BufferSpec("x", torch.int64, PadRule.ZERO, 3)  # type: ignore[misc]


def test_host_seq_lens_buffer_has_the_backend_fill():
    specs = {s.name: s for s in decode_buffer_specs(seq_len_fill_value=2, host_seq_lens=True)}
    host = specs["seq_lens_cpu"]
    assert host.host and host.rule is PadRule.FILL and host.pad_value() == 2

    class Backend:
        seq_len_fill_value = 1

    with pytest.raises(ValueError, match="seq_lens_cpu fill_value 3 differs from the backend's"):
        create_runner(
            lambda v: v,
            [
                *decode_buffer_specs(),
                BufferSpec(
                    "seq_lens_cpu",
                    torch.int64,
                    PadRule.FILL,
                    fill_value=3,
                    host=True,
                    backend_fill=True,
                ),
            ],
            device="cpu",
            max_bs=4,
            backend=Backend(),  # type: ignore[arg-type]
            kind="eager",
        )


def test_index_buffers_pad_to_slot_0_or_the_width():
    BufferSpec("out_cache_loc", torch.int64, PadRule.ZERO, index=True)
    BufferSpec("accept_lens", torch.int64, PadRule.WIDTH, width=3, index=True)
    for rule, extra in ((PadRule.FILL, {"fill_value": 5}), (PadRule.KEEP, {})):
        with pytest.raises(ValueError, match=f"holds indices and pads with {rule.name}"):
            BufferSpec("out_cache_loc", torch.int64, rule, index=True, **extra)  # type: ignore[arg-type]
    assert all(s.index for s in decode_buffer_specs() if s.name != "seq_lens")
