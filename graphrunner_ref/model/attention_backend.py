"""The attention backend of the Llama decoder: builds :class:`AttnMetadata` for
decode, per-token rows and extend, and the graph hooks (capture and replay
metadata, host range checks) the runner calls. See :mod:`graphrunner_ref.model.attention`."""

from __future__ import annotations

import torch

from graphrunner import BufferView
from graphrunner.core import host_range
from graphrunner.declare import Size
from graphrunner_ref.model.attention_cpu import KV_DTYPES, cpp_attention_status
from graphrunner_ref.model.attention_live import LiveRows
from graphrunner_ref.model.attention_meta import AttnMetadata
from graphrunner_ref.model.attention_op import PagedRows
from graphrunner_ref.model.attention_tokens import TokenLayout
from graphrunner_ref.model.attention_torch import decode_columns
from graphrunner_ref.model.kernels.decode_attention import LAYOUTS, DecodeScratch, choose_splits

__all__ = [
    "ATTENTIONS",
    "ATTENTION_KERNELS",
    "LIVE_FROM_CAPACITY",
    "TorchPagedBackend",
    "device_attention",
]

#: The decode attentions a :class:`TorchPagedBackend` can run.
ATTENTION_KERNELS = ("torch", "triton", "live")
#: Named decode attentions (``--attention``): name -> (kernel, Triton layout).
ATTENTIONS = {
    "torch": ("torch", "per_head"),
    "live": ("live", "per_head"),
    "triton": ("triton", "per_head"),
    "triton-all-heads": ("triton", "all_heads"),
}


#: From this capacity (``max_context_len``) up, a CPU model whose KV cache
#: the C++ live kernel cannot read (not float32) runs the live-width torch
#: reference by default; below it the full-width gather, which inductor fuses
#: into the score reduction, is as fast or faster
#: (``bench/results/context-embedded-cpu.md``).
LIVE_FROM_CAPACITY = 512


def device_attention(
    device: torch.device, capacity: int, kv_dtype: torch.dtype = torch.float32
) -> str:
    """The decode attention a model on ``device`` with rows of ``capacity``
    columns and a ``kv_dtype`` KV cache runs unless told otherwise: the Triton
    kernel on CUDA. On the CPU the live-width attention: over a float32 or
    float16 cache (:data:`~graphrunner_ref.model.attention_cpu.KV_DTYPES`)
    (the C++ kernel, each row reading its own live slots) at any capacity:
    faster than the fused full-width gather at every capacity measured, 96 to
    1,024 columns (``bench/results/context-embedded-cpp-attention-cpu.md``;
    SmolLM2 at batch 1 with 104 columns: 51.1 against 45.7 tok/s); over another
    dtype (the torch reference) from :data:`LIVE_FROM_CAPACITY` columns up,
    the full-width torch gather below. Over an int8 cache (CPU only) the
    live-width attention too: its C++ kernel, or its torch reference."""
    if device.type == "cuda":
        return "triton"
    if kv_dtype in (*KV_DTYPES, torch.int8) or capacity >= LIVE_FROM_CAPACITY:
        return "live"
    return "torch"


class TorchPagedBackend:
    """The :class:`graphrunner.declare.hooks.GraphBackend` of the torch paged attention.

    Plan/run split, made as small as this backend allows: the per-step metadata
    (slot gather + length mask, :meth:`decode_metadata`) is two fused ops that
    read only the batch tensors, so it runs inside the graph and the very same
    forward is the eager reference. What the hooks own is the host side:

    - ``init_graph_state``: checks once, before any capture, that row 0 of
      ``req_to_token`` is all zeros (padded rows gather it; it may sync here).
    - ``init_capture_metadata``: checks the capture view's width against
      ``max_bs`` (host shapes only).
    - ``validate_inputs`` (every step, graph or eager): checks the host
      mirrors: ``seq_lens_cpu`` in ``1..max_context_len`` (a longer sequence
      would be silently truncated by the fixed-width gather; a 0 would attend
      to nothing: NaN) and ``req_pool_indices_cpu`` in ``1..num_reqs``. Reads
      host memory only, never the device.
    - ``init_replay_metadata``: nothing to do.

    ``seq_len_fill_value`` is 1: a padded row attends to exactly one key, slot 0.
    ``metadata_on_device`` is True: both decode attentions (the torch gather
    and the Triton kernel, whose split count is a function of the shapes) read
    only device tensors of the step, so a multi-step phase
    (:mod:`graphrunner.phases.multistep`) may change them between its steps.

    ``kernel`` picks the decode attention: ``"torch"`` (the gather above, the
    reference) or ``"triton"`` (the split-KV kernel through an opaque op, with
    ``kv_heads`` and the batch size fixing its split count); prompts (extend)
    always take the torch attention. Settable until a runner captures. With
    ``heads`` and ``head_dim`` given, the Triton kernel's scratch is allocated
    here, for ``num_reqs`` rows, and grown to ``max_bs`` by ``init_graph_state``.
    ``layout`` is the Triton kernel's split launch (one of
    :data:`~graphrunner_ref.model.kernels.decode_attention.LAYOUTS`; ``"per_head"``, the
    measured default, or ``"all_heads"``), settable like ``kernel``.
    """

    seq_len_fill_value: int = 1
    metadata_on_device: bool = True

    def __init__(
        self,
        req_to_token: torch.Tensor,
        *,
        kernel: str = "torch",
        kv_heads: int = 1,
        heads: int = 0,
        head_dim: int = 0,
        layout: str = "per_head",
    ) -> None:
        self.req_to_token = req_to_token  # int32 [num_reqs + 1, max_context_len]
        self.max_context_len = req_to_token.shape[1]
        self.kv_columns = torch.arange(self.max_context_len, device=req_to_token.device)
        self.max_bs = 0
        self.kv_heads, self.heads, self.head_dim = kv_heads, heads, head_dim
        self.scratch: DecodeScratch | None = None
        self.kernel = kernel
        self.layout = layout
        #: Launch the Triton kernel programmatically (PDL; see
        #: :func:`~graphrunner_ref.model.programmatic_launch.use_programmatic_launch`).
        self.programmatic_launch = False

    def use(self, attention: str) -> None:
        """Run the decode attention named ``attention`` (a key of :data:`ATTENTIONS`)."""
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: expected one of {tuple(ATTENTIONS)}")
        self.kernel, self.layout = ATTENTIONS[attention]

    @property
    def layout(self) -> str:
        """The Triton kernel's split launch: ``"per_head"`` or ``"all_heads"``."""
        return self._layout

    @layout.setter
    def layout(self, layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
        self._layout = layout

    @property
    def kernel(self) -> str:
        """The decode attention: ``"torch"``, ``"triton"`` or ``"live"``."""
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: str) -> None:
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"kernel={kernel!r}: expected one of {ATTENTION_KERNELS}")
        if kernel == "live" and self.req_to_token.device.type == "cuda":
            # Its width is a host read per step: no CUDA graph could hold it.
            raise ValueError(
                "kernel='live' on a CUDA device: expected 'triton' (which reads only the "
                "live tokens on the device) or 'torch'"
            )
        if kernel == "live":  # its C++ op registered before a saved program calls it
            cpp_attention_status()
        self._kernel = kernel
        self._size_scratch(self.req_to_token.shape[0] - 1)

    def _size_scratch(self, rows: int) -> None:
        """Scratch for ``rows`` decode rows, allocated only when the Triton kernel
        runs and the current one is smaller (host-side, never in a step)."""
        if self._kernel != "triton" or not self.heads or not self.head_dim:
            return
        if self.scratch is None or self.scratch.partial_out.shape[0] < rows:
            self.scratch = DecodeScratch.allocate(
                rows, self.heads, self.head_dim, device=self.req_to_token.device
            )

    def decode_metadata(self, inputs: BufferView, group: int) -> AttnMetadata:
        """Slots ``[bs, max_context_len]`` and mask ``[bs, 1, group, max_context_len]``."""
        return self.rows_metadata(inputs.req_pool_indices, inputs.seq_lens, group)

    def rows_metadata(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, group: int
    ) -> AttnMetadata:
        """:meth:`decode_metadata` of rows given as tensors (int64 ``[n]``): each
        row reads ``req_to_token[req_pool_indices, :seq_lens]``."""
        if self._kernel == "live":  # the op gathers its own live columns
            none = seq_lens.new_zeros(seq_lens.shape[0], 0)
            rows = LiveRows(self.req_to_token, req_pool_indices, seq_lens)
            return AttnMetadata(none, none.bool()[:, None, None, :], decode=True, live=rows)
        slots, mask, keys = decode_columns(
            self.req_to_token, req_pool_indices, seq_lens, self.kv_columns, group
        )
        paged = None
        if self._kernel == "triton":
            splits = choose_splits(
                seq_lens.shape[0], self.kv_heads, self.max_context_len, layout=self._layout
            )
            paged = PagedRows(
                self.req_to_token, req_pool_indices, seq_lens, splits, self.scratch,
                self._layout, self.programmatic_launch,
            )  # fmt: skip
        return AttnMetadata(slots, mask, decode=True, keys=keys, paged=paged)

    def token_batch_metadata(self, inputs: BufferView, group: int) -> AttnMetadata:
        """A token batch's metadata (:mod:`graphrunner.phases.token_batch`).
        Where its host layout is declared and the step runs on the CPU: each
        request's range, planned on the host (one fused attention per
        request). Otherwise (a CUDA graph holds no host loop): one decode row
        per token, its request's row up to its position, read from the
        device tensors by this backend's decode attention."""
        lens = getattr(inputs, "extend_lens_cpu", None)
        if lens is not None and self.req_to_token.device.type == "cpu":
            layout = TokenLayout(
                self.req_to_token, inputs.req_pool_indices, inputs.seq_lens_cpu, lens
            )
            none = inputs.seq_lens.new_zeros(0, 0)
            return AttnMetadata(none, none.bool(), decode=False, tokens=layout)
        return self.rows_metadata(inputs.token_req_pool_indices, inputs.positions + 1, group)

    def extend_metadata(
        self, req_pool_index: int, positions: torch.Tensor, width: int, group: int
    ) -> AttnMetadata:
        """Causal metadata for one request whose new tokens sit at ``positions [n]``
        (the last one is ``width - 1``): slots ``[1, width]``, mask
        ``[1, 1, n * group, width]``."""
        slots = self.req_to_token[req_pool_index, :width].long()[None, :]
        mask = self.kv_columns[:width] <= positions[:, None]  # [n, width]
        mask = mask[:, None, :].expand(-1, group, -1).reshape(1, 1, -1, width)
        return AttnMetadata(slots, mask, decode=False)

    def init_graph_state(self, max_bs: int) -> None:
        if int(self.req_to_token[0].abs().sum()) != 0:
            raise ValueError(
                "req_to_token row 0 is not all zeros; padded rows would read "
                "live KV slots (row 0 is reserved for padding)"
            )
        self.max_bs = max_bs
        self._size_scratch(max_bs)

    def init_capture_metadata(self, bs: int, view: BufferView) -> None:
        if not 1 <= bs <= self.max_bs or view.bs != bs:
            raise ValueError(
                f"capture bs={bs} (view of {view.bs} rows): "
                f"expected 1..max_bs={self.max_bs} rows; call init_graph_state first"
            )

    def validate_inputs(self, raw_bs: Size, inputs: object) -> None:
        self._check_host_range("req_pool_indices_cpu", inputs, 1, self.req_to_token.shape[0] - 1)
        self._check_host_range("seq_lens_cpu", inputs, 1, self.max_context_len)

    def _check_host_range(self, name: str, inputs: object, lo: int, hi: int) -> None:
        """Every value of host mirror ``name`` in ``lo..hi`` (host reads only)."""
        values = getattr(inputs, name, None)
        if not isinstance(values, torch.Tensor):
            raise ValueError(
                f"{name} is {type(values).__name__}; this backend needs the host mirror "
                f"(CPU int64 [bs])"
            )
        bounds = host_range(inputs, name, values)
        if bounds is None:
            return
        low, high = bounds
        if low < lo or high > hi:
            bad = int(((values < lo) | (values > hi)).nonzero()[0, 0])
            raise ValueError(f"{name}[{bad}]={int(values[bad])}: expected {lo}..{hi}")

    def init_replay_metadata(
        self, bs: Size, raw_bs: Size, view: BufferView, inputs: object
    ) -> None:
        pass  # the metadata is computed inside the graph from the static buffers
