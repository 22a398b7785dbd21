"""`OscarLayer`: one full-attention layer's token pool, BF16 sink | quantized history | BF16 recent.

Storage, per layer:
- `keys_buffer` / `values_buffer` `[B, Hkv, capacity, d]` (model dtype, model basis): the sink tokens followed
  by the recent tokens, `bf16_length` of them; `update` writes new tokens here and returns views of the buffer
  (no per-step concatenation of the history).
- `history`: the demoted tokens, rotated and quantized (`history.py`).

Logical order of the tokens is sink, history, recent; the mask columns of the attention follow it.

Demotion ("settling") runs after the attention of each forward (called by the attention function, or lazily by
the next `update`), so a forward always attends to its own tokens in BF16. With S = sink size, R =
`recent_tokens` and b = `demote_block`:
- after a multi-token forward (prefill, prefill chunk), the oldest tokens beyond S + R are demoted at once, so a
  prompt of L tokens leaves min(L, S) sink, max(L - S - R, 0) history and min(L - S, R) recent tokens;
- after a single-token (decode) forward, tokens are demoted only once the recent window exceeds R + b - 1, then
  down to R: b tokens every b steps.
The sink size is fixed at the first demotion to `sink_tokens` plus the batch's largest left padding, so every row
keeps `sink_tokens` real sink tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from .backend import backend_for
from .config import OscarConfig
from .history import make_history
from .rotation import rotate


@dataclass
class HistorySegment:
    """What the attention function needs beyond the BF16 tensors `update` returned.

    Mask columns `[0, sink_length)` and `[sink_length + history_length, kv_len)` are the BF16 tensors;
    `[sink_length, sink_length + history_length)` is the quantized history.
    """

    layer: "OscarLayer"
    layer_idx: int
    sink_length: int
    history_length: int


def leading_padding(mask: torch.Tensor | None) -> int:
    """Largest number of leading masked-out key columns over the batch, read from the last query row."""
    if mask is None:
        return 0
    last_row = mask[:, 0, -1, :]
    allowed = last_row if last_row.dtype == torch.bool else last_row == 0
    return int((allowed.int().cumsum(dim=-1) == 0).sum(dim=-1).max().item())


class OscarLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, layer_idx: int, config: OscarConfig, key_rotation: torch.Tensor | None,
                 value_rotation: torch.Tensor | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.key_rotation = key_rotation
        self.value_rotation = value_rotation
        # Set by `graph_decode`: a single-token forward attends to every cached token but its row's leading pads
        # (`row_padding`, skipped by count), so the mask transformers materializes while a CUDA graph is captured
        # (its width fixed at capture) is dropped instead of being replayed against later lengths.
        self.decode_without_mask = False
        self.row_padding: torch.Tensor | None = None  # int32 [B]: leading pad columns per row, with the above
        self.max_row_padding = 0
        self._clear()

    def _clear(self) -> None:
        self.keys_buffer = self.values_buffer = None
        self.history = None
        self.length = 0  # logical tokens: sink + history + recent
        self.bf16_length = 0  # tokens in the BF16 buffers: sink + recent
        self.sink_size: int | None = None  # fixed at the first demotion
        self.unsettled = 0  # tokens appended by forwards not settled yet
        self.segment_open = False
        self.is_initialized = False

    # ------------------------------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        value_dim = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        for kind, rotation, dim in (("key", self.key_rotation, key_dim), ("value", self.value_rotation, value_dim)):
            if rotation is None:
                continue
            if rotation.shape[-1] != dim or (rotation.dim() == 3 and rotation.shape[0] != heads):
                raise ValueError(
                    f"layer {self.layer_idx}: {kind} rotation of shape {tuple(rotation.shape)} does not fit "
                    f"{kind} states with {heads} heads of size {dim}"
                )
        if self.key_rotation is not None:
            self.key_rotation = self.key_rotation.to(self.device, torch.float32)
        if self.value_rotation is not None:
            self.value_rotation = self.value_rotation.to(self.device, torch.float32)
        self.history = make_history(self.config, batch, heads, key_dim, value_dim, self.dtype, self.device)
        self.keys_buffer = key_states.new_empty((batch, heads, self._steady_capacity(), key_dim))
        self.values_buffer = value_states.new_empty((batch, heads, self._steady_capacity(), value_dim))
        self.backend = backend_for(self.device, self.config.history_chunk)
        self.is_initialized = True

    def _steady_capacity(self) -> int:
        cfg = self.config
        sink = cfg.sink_tokens if self.sink_size is None else self.sink_size
        return sink + cfg.recent_tokens + 2 * cfg.demote_block

    def _resize_buffers(self, capacity: int) -> None:
        for name in ("keys_buffer", "values_buffer"):
            old = getattr(self, name)
            fresh = old.new_empty((old.shape[0], old.shape[1], capacity, old.shape[3]))
            fresh[:, :, : self.bf16_length] = old[:, :, : self.bf16_length]
            setattr(self, name, fresh)

    @property
    def batch_size(self) -> int:
        return self.keys_buffer.shape[0] if self.is_initialized else 0

    @property
    def history_length(self) -> int:
        return self.history.length if self.history is not None else 0

    @property
    def sink_length(self) -> int:
        """Sink tokens in the BF16 buffer (meaningful once history exists)."""
        return self.sink_size if self.history_length else 0

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, Hkv, q, d]` states; return the BF16 tiers (sink + recent + new) as views, model basis."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch_size:
            raise ValueError(
                f"layer {self.layer_idx}: the cache holds a batch of {self.batch_size} but received "
                f"{key_states.shape[0]} sequences; use a fresh OscarCache for a new batch"
            )
        if self.segment_open:
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous forward's attention never consumed the OSCAR history. "
                "The model's attention must be the 'oscar' implementation for every layer (see oscar_hf.attention); "
                "call cache.reset() to reuse this cache."
            )
        self.settle()
        new = key_states.shape[-2]
        end = self.bf16_length + new
        if end > self.keys_buffer.shape[2]:
            self._resize_buffers(max(end, self._steady_capacity()))
        self.keys_buffer[:, :, self.bf16_length : end] = key_states
        self.values_buffer[:, :, self.bf16_length : end] = value_states
        self.bf16_length = end
        self.length += new
        self.unsettled += new
        return self.keys_buffer[:, :, :end], self.values_buffer[:, :, :end]

    def open_segment(self) -> HistorySegment:
        """Hand the attention function the history layout of the current forward (it must `settle` after)."""
        self.segment_open = True
        return HistorySegment(self, self.layer_idx, self.sink_length, self.history_length)

    def settle(self, attention_mask: torch.Tensor | None = None) -> None:
        """Demote the oldest recent tokens once the window overflows (see module docstring)."""
        self.segment_open = False
        if not self.unsettled:
            return
        cfg = self.config
        limit = cfg.recent_tokens + (cfg.demote_block - 1 if self.unsettled == 1 else 0)
        self.unsettled = 0
        sink_size = cfg.sink_tokens if self.sink_size is None else self.sink_size
        if self.bf16_length - min(self.bf16_length, sink_size) <= limit:
            return
        if self.sink_size is None:
            self.sink_size = cfg.sink_tokens + max(leading_padding(attention_mask), self.max_row_padding)
            if self.bf16_length - min(self.bf16_length, self.sink_size) <= limit:
                return
        sink = self.sink_size
        demote = self.bf16_length - sink - cfg.recent_tokens
        keep = slice(sink + demote, self.bf16_length)
        self.history.append(
            self.keys_buffer[:, :, sink : sink + demote], self.values_buffer[:, :, sink : sink + demote],
            self.key_rotation, self.value_rotation, self.backend,
        )
        for name in ("keys_buffer", "values_buffer"):
            buffer = getattr(self, name)
            buffer[:, :, sink : sink + cfg.recent_tokens] = buffer[:, :, keep].clone()
        self.bf16_length = sink + cfg.recent_tokens
        if self.keys_buffer.shape[2] > 2 * self._steady_capacity():
            self._resize_buffers(self._steady_capacity())

    # ------------------------------------------------------------------------------------------ graph replay
    def at_cycle_start(self) -> bool:
        """True right after a demotion: history present and exactly `recent_tokens` recent tokens (see
        `oscar_hf.graph_decode`: from here, decode steps repeat with period `demote_block`)."""
        return (self.history_length > 0 and not self.unsettled and not self.segment_open
                and self.bf16_length - self.sink_length == self.config.recent_tokens)

    def set_row_padding(self, row_padding: torch.Tensor | None) -> None:
        """Leading pad columns per row (int `[B]`), for single-token steps that attend without a mask
        (`decode_without_mask`); the sink grows to hold the largest, as it does from a mask."""
        self.row_padding = None if row_padding is None else row_padding.to(torch.int32).contiguous()
        self.max_row_padding = 0 if row_padding is None else int(row_padding.max())

    def host_state(self) -> tuple:
        """The host-side counters (what a replayed CUDA graph cannot update)."""
        return (self.length, self.bf16_length, self.sink_size, self.unsettled, self.segment_open,
                self.history_length)

    def restore_host_state(self, state: tuple, advance: int = 0) -> None:
        """Set the counters to `state`, with `advance` more tokens both in total and in the history (whole
        demotion cycles replayed since `state` was taken)."""
        length, self.bf16_length, self.sink_size, self.unsettled, self.segment_open, history_length = state
        self.length = length + advance
        self.history.length = history_length + advance

    # ------------------------------------------------------------------------------------------ views
    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached K/V in the model basis and dtype, history dequantized: `[B, Hkv, length, d]`.

        The slow but exact fallback for attention implementations other than 'oscar'.
        """
        keys, values = self.keys_buffer[:, :, : self.bf16_length], self.values_buffer[:, :, : self.bf16_length]
        if not self.history_length:
            return keys, values
        hist_k, hist_v = self.history.dequantize(0, self.history_length)
        hist_k = rotate(hist_k, self.key_rotation, transpose=True).to(self.dtype)
        hist_v = rotate(hist_v, self.value_rotation, transpose=True).to(self.dtype)
        s = self.sink_length
        return (torch.cat([keys[:, :, :s], hist_k, keys[:, :, s:]], dim=2),
                torch.cat([values[:, :, :s], hist_v, values[:, :, s:]], dim=2))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # ------------------------------------------------------------------------------------------ batch ops
    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys_buffer = fn(self.keys_buffer)
        self.values_buffer = fn(self.values_buffer)
        self.history.map_batch(fn)
        if self.row_padding is not None:
            self.row_padding = fn(self.row_padding)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens; they must still be in the BF16 recent window.

        A negative value removes that many tokens; a positive value (legacy) keeps that many.
        """
        remove = self.length - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if remove <= 0:
            return
        self.settle()
        croppable = self.bf16_length - self.sink_length
        if remove > croppable:
            raise ValueError(
                f"layer {self.layer_idx}: cannot crop {remove} tokens, only the newest {croppable} are still in "
                "BF16; older tokens are already quantized"
            )
        self.bf16_length -= remove
        self.length -= remove

    def reset(self) -> None:
        self._clear()

    def offload(self) -> None:
        raise NotImplementedError("OscarCache does not support CPU offloading")

    def prefetch(self) -> None:
        raise NotImplementedError("OscarCache does not support CPU offloading")

    # ------------------------------------------------------------------------------------------ memory
    def nbytes(self) -> int:
        """Bytes of the stored tokens: the BF16 tiers plus the history (codes and scales)."""
        if not self.is_initialized:
            return 0
        per_token = self.keys_buffer.shape[0] * self.keys_buffer.shape[1] * (
            self.keys_buffer.shape[3] + self.values_buffer.shape[3]) * self.keys_buffer.element_size()
        return per_token * self.bf16_length + self.history.nbytes()

    def num_elements(self) -> int:
        """K and V elements of the logical tokens (what a dense cache would store)."""
        if not self.is_initialized:
            return 0
        b, h, _, dk = self.keys_buffer.shape
        return self.length * b * h * (dk + self.values_buffer.shape[3])

    def allocated_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        buffers = (self.keys_buffer, self.values_buffer)
        return sum(b.numel() * b.element_size() for b in buffers) + self.history.allocated_nbytes()

    def __repr__(self) -> str:
        return (f"OscarLayer(idx={self.layer_idx}, tokens={self.length}, sink={self.sink_length}, "
                f"history={self.history_length}, bf16={self.bf16_length})")
