"""What the cache asks of a kernel backend, and the view of a history that every backend reads.

A backend is picked once per layer (`kernels.select.backend_for(device)`, or passed to `OscarCache(backend=...)`)
and then called through these operations only:

- `demote_kv(call: DemoteCall)`: rotate, clip, quantize and pack rows `[B, H, n, d]` of keys and values into the
  call's output views (nothing where its device flag `only_if` holds 0);
- `demote_kv_at(call: DemoteCall, at) -> lost`: the same straight into whole history buffers at the device row
  `at` (a counted decode step's demotion);
- `tiered_attention(query, key, value, mask, history, sink_length, key_rotation, value_rotation, scaling, softcap,
  dense_start, history_start, sinks) -> [B, Lq, Hq, D]`: one layer's attention over its BF16 tiers `key`/`value` (model
  basis) and its history (a `HistoryTensors`, or None), which sits between mask columns `sink_length` and
  `sink_length + history.length`; `dense_start` / `history_start` (int32 `[B]` or None): leading dense keys and
  leading history rows of each row to ignore (left padding, `demotion.padded_starts`); `sinks` (float `[Hq]` or
  None): learned sink logits that every row's softmax adds to its denominator (gpt-oss;
  `reference.attention.add_sinks`);
- `decode_attention(call: DecodeCall) -> [B, 1, Hq, D]`: a single-token step over device-counted BF16 rows and
  history, every one of them visible (no mask): what a compiled or graph-captured decode step runs (`kernels.ops`);
- `eager_decode_attention(call: DecodeCall)`: the same call from an eager step, with tensors that keep their
  addresses from step to step, which a backend may replay from a CUDA graph it captured (`kernels.replay`);
- `graph_capture_problem(key_dim, value_dim, encoder, scale_dtype) -> str | None`: why a decode step of a layer of
  these sizes and formats cannot be captured in a CUDA graph, or None when it can;
- `settings() -> dict`: the constructor's arguments, as data: how a compiled graph names the backend
  (`kernels.select.backend_spec`).

A backend whose `decodes_split_histories` is True also takes, in the two decode calls, a history kept as runs of
adjacent KV heads of different code widths (`HeadSplitTensors`; `decode_by_runs` is the semantics: each run
attends to its own heads as an ordinary call, the outputs side by side along the heads), so that it can serve the
whole layer in one call; other backends are called once per run (`head_groups.HeadSplitBackend`).

Rotations are `[d, d]` or `[H, d, d]`, applied as `x @ R`. `demote_kv` stores keys times its `key_rotation`, which
need not be orthogonal; the attention calls rotate the query by theirs and nothing else, so a layer whose keys are
smoothed passes its query rotation there (`OscarLayer.query_rotation`). Value rotations are orthogonal: attention
un-rotates the history's output by `value_rotation`ᵀ.

The PyTorch reference (`kernels.reference`) defines the semantics; every other backend is tested against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch


def block_fits(at, n: int, size: int):
    """Whether a counted decode step's block of `n` rows, written after the count `at`, fits history buffers of
    `size` rows, whose last n rows are never counted. `at` is an int (the host's view) or an int32 tensor (the
    device's); the answer is of the same kind."""
    return at + 2 * n <= size


def block_start(at: torch.Tensor, n: int, size: int, advance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a counted decode step writes a block of `n` rows into history buffers of `size` rows: right after the
    count `at` (int32 `[1]` on the device) if the block fits, else onto the buffers' last n rows, which are never
    counted (a full history keeps every row it counts). Returns (first row, tokens lost), int32 `[1]` each: the
    block's `advance` (0 or n, what the caller will count) when it does not fit, else 0. The Triton demotion kernel
    applies the same rule on the device."""
    fits = block_fits(at, n, size)
    return torch.where(fits, at, torch.full_like(at, size - n)), advance * (~fits).to(advance.dtype)


def kernel_head_dim(dim: int) -> bool:
    """Head sizes the GPU kernels take: powers of two from 64 (a quarter of a row feeds a 16-wide dot) to 256."""
    return 64 <= dim <= 256 and dim & (dim - 1) == 0


@dataclass(frozen=True)
class HistoryTensors:
    """The history buffers a backend reads (`[B, Hkv, capacity, ...]`, the first `length` tokens valid).

    Quantized: `keys`/`values` are packed codes (uint8, `d * bits / 8` bytes per row) and the scale-zero tensors
    (`[B, Hkv, capacity, 2]`) are set; unquantized: `keys`/`values` are rotated rows in the model dtype and the
    scale-zero tensors are None. `length_ptr` (int32 `[1]`) holds the length on the device for a history pinned for
    CUDA-graph replay; kernels then read the length from there."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scale_zero: torch.Tensor | None
    value_scale_zero: torch.Tensor | None
    length: int
    bits: int = 2
    length_ptr: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.key_scale_zero is not None

    @property
    def num_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def key_dim(self) -> int:
        return self.keys.shape[-1] * 8 // self.bits if self.quantized else self.keys.shape[-1]

    @property
    def value_dim(self) -> int:
        return self.values.shape[-1] * 8 // self.bits if self.quantized else self.values.shape[-1]

    @property
    def plan_length(self) -> int:
        """The length to cut splits for: the capacity when the kernel reads the length from the device."""
        return self.keys.shape[2] if self.length_ptr is not None else self.length


def heads_of(rotation: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """The rotation of KV heads `[start, stop)`: a slice of a per-head `[Hkv, d, d]` rotation; a shared `[d, d]` one
    as it is."""
    return rotation if rotation is None or rotation.dim() == 2 else rotation[start:stop]


@dataclass(frozen=True)
class HeadRun:
    """KV heads `[start, stop)` of a split history and their own history view (None while it is empty)."""

    start: int
    stop: int
    history: HistoryTensors | None


@dataclass(frozen=True)
class HeadSplitTensors:
    """A history kept as runs of adjacent KV heads, each an ordinary history of its own code width and pair
    format, all of the same length: one `HeadRun` per run, in head order, covering every KV head."""

    runs: tuple[HeadRun, ...]

    @property
    def length(self) -> int:
        return self.runs[0].history.length

    @property
    def length_ptr(self) -> torch.Tensor | None:
        return self.runs[0].history.length_ptr

    @property
    def plan_length(self) -> int:
        return self.runs[0].history.plan_length


@dataclass(frozen=True)
class DemoteCall:
    """One demotion: rows of keys and values `[B, H, n, d]` (model basis), the format they are stored in, and
    where the codes go.

    `key_codes` .. `value_scale_zero`: for `demote_kv`, views of exactly n rows; for `demote_kv_at`, whole history
    buffers `[B, H, capacity, ...]`. `only_if` (int32 `[1]` on the device, or None): where it holds 0, nothing is
    written (a counted decode step decides on the device whether it demotes); `demote_kv_at` requires it (0 or n:
    the rows the caller will count)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_rotation: torch.Tensor | None
    value_rotation: torch.Tensor | None
    key_clip_ratio: float | None
    value_clip_ratio: float | None
    bits: int
    encoder: str
    key_codes: torch.Tensor
    key_scale_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale_zero: torch.Tensor
    only_if: torch.Tensor | None = None

    def at_rows(self, rows: slice) -> DemoteCall:
        """The call writing `rows` of whole buffers (what `demote_kv_at` becomes once the row is known)."""
        return replace(self, key_codes=self.key_codes[:, :, rows], key_scale_zero=self.key_scale_zero[:, :, rows],
                       value_codes=self.value_codes[:, :, rows], value_scale_zero=self.value_scale_zero[:, :, rows])


@dataclass(frozen=True)
class DecodeCall:
    """One layer's single-token decode step: what its attention reads.

    `query` `[B, Hq, 1, D]`; `keys`/`values` `[B, Hkv, capacity, D]`: the BF16 buffers (model basis), of which
    the first `dense_length` rows (int32 `[1]` on the device) are in use; `history`: the quantized history (its
    count in `length_ptr`), a `HeadSplitTensors`, or None. `key_rotation`: what the history's attention rotates
    the query by (the layer's query rotation); `value_rotation`: what its output is un-rotated by. `dense_start` /
    `history_start` (int32 `[B]`, or None without left padding): leading BF16 and history rows each row ignores.
    `sinks` (float `[Hq]` or None): learned sink logits in each query head's softmax."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    dense_length: torch.Tensor
    history: HistoryTensors | HeadSplitTensors | None
    key_rotation: torch.Tensor | None
    value_rotation: torch.Tensor | None
    scaling: float
    softcap: float | None = None
    dense_start: torch.Tensor | None = None
    history_start: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    def for_run(self, run: HeadRun) -> DecodeCall:
        """The call restricted to one run's KV heads `[start, stop)`: query heads `[start * G, stop * G)`, the BF16
        rows and per-head rotations of those heads, and the run's own history."""
        groups = self.query.shape[1] // self.keys.shape[1]
        return replace(self, query=self.query[:, run.start * groups : run.stop * groups],
                       keys=self.keys[:, run.start : run.stop], values=self.values[:, run.start : run.stop],
                       history=run.history, key_rotation=heads_of(self.key_rotation, run.start, run.stop),
                       value_rotation=heads_of(self.value_rotation, run.start, run.stop),
                       sinks=None if self.sinks is None else self.sinks[run.start * groups : run.stop * groups])


class Backend(Protocol):
    """The operations a layer calls (see the module docstring)."""

    name: str

    def demote_kv(self, call: DemoteCall) -> None: ...

    def demote_kv_at(self, call: DemoteCall, at: torch.Tensor) -> torch.Tensor: ...

    def tiered_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         mask: torch.Tensor | None, history: HistoryTensors | None, sink_length: int,
                         key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None, scaling: float,
                         softcap: float | None = None, dense_start: torch.Tensor | None = None,
                         history_start: torch.Tensor | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def decode_attention(self, call: DecodeCall) -> torch.Tensor: ...

    def eager_decode_attention(self, call: DecodeCall) -> torch.Tensor: ...

    def graph_capture_problem(self, key_dim: int, value_dim: int, encoder: str,
                              scale_dtype: torch.dtype = torch.float16) -> str | None: ...

    def rehearse(self, name: str, args: tuple, device: torch.device, calls: Callable[[], object]) -> None: ...

    def settings(self) -> dict: ...


def decode_by_runs(decode, call: DecodeCall) -> torch.Tensor:
    """A decode call over a split history (`decode`: a backend's `decode_attention` or `eager_decode_attention`),
    one call per run of KV heads (`DecodeCall.for_run`); the outputs concatenated along the heads (exact: a query
    head reads its own KV head only)."""
    return torch.cat([decode(call.for_run(run)) for run in call.history.runs], dim=2)
