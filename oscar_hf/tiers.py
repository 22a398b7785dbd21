"""`Tiers`: where one full-attention layer's tokens are stored, and in which basis.

- `keys_buffer` / `values_buffer` `[B, Hkv, capacity, d]` (model dtype, model basis): the sink tokens followed by
  the recent tokens; which of their rows are in use is a count the layer's counting mode keeps (`host_counts`,
  `counted_decode`), not the tiers.
- `history`: the demoted tokens, rotated and quantized (`history.py`).
- the rotations: keys are stored as `k @ key_rotation`; the history's attention rotates the query by
  `query_rotation`, the same matrix unless the keys are smoothed (`Rotations.key_transforms`: then `key_rotation`
  times `query_rotation`ᵀ is the identity, and stored rows go back to keys through `query_rotation`ᵀ).
- `sink_size` (fixed at the first demotion) and `row_start` (int32 `[B]`: each row's leading pad columns; None
  without padding, `demotion`, left padding).

The tiers are the only writer of their buffers: the counting modes say where and how many rows, the tiers move
them.
"""

from __future__ import annotations

import torch

from oscar_hf.config import OscarConfig
from oscar_hf.demotion import demotion_index, time_order_index
from oscar_hf.handoff import without_segment
from oscar_hf.history import make_history
from oscar_hf.kernels.ops import move_rows
from oscar_hf.rotations.math import rotate


def row_leading_padding(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Leading masked-out key columns of each row (int32 `[B or 1]`, on the mask's device), read from the last
    query row; None without a mask."""
    if mask is None:
        return None
    last_row = mask[:, 0, -1, :]
    allowed = last_row if last_row.dtype == torch.bool else last_row == 0
    return (allowed.int().cumsum(dim=-1) == 0).sum(dim=-1).to(torch.int32)


class Tiers:
    def __init__(self, layer_idx: int, config: OscarConfig, key_rotation: torch.Tensor | None,
                 value_rotation: torch.Tensor | None, query_rotation: torch.Tensor | None = None):
        self.layer_idx = layer_idx
        self.config = config
        self.key_rotation = key_rotation
        self._query_rotation = query_rotation
        self.value_rotation = value_rotation
        self.keys_buffer = self.values_buffer = None
        self.history = None
        self.sink_size: int | None = None
        self.row_start: torch.Tensor | None = None

    def emptied(self) -> Tiers:
        """Tiers of the same settings and rotations, holding nothing (a layer's `reset`)."""
        return Tiers(self.layer_idx, self.config, self.key_rotation, self.value_rotation, self._query_rotation)

    def __getstate__(self) -> dict:
        """What pickle stores: the buffers without the segment a counted step's `update` attached to them (it
        holds the layer's close callback, `handoff.without_segment`)."""
        return {name: without_segment(value) for name, value in self.__dict__.items()}

    @property
    def query_rotation(self) -> torch.Tensor | None:
        """What the history's attention rotates the query by (module docstring)."""
        return self.key_rotation if self._query_rotation is None else self._query_rotation

    @property
    def is_allocated(self) -> bool:
        return self.keys_buffer is not None

    @property
    def batch_size(self) -> int:
        return self.keys_buffer.shape[0] if self.is_allocated else 0

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers and history for states like these `[B, Hkv, q, d]`; the rotations checked against their heads
        and moved to their device."""
        batch, heads, _, key_dim = key_states.shape
        value_dim = value_states.shape[-1]
        for kind, rotation, dim in (("key", self.key_rotation, key_dim), ("value", self.value_rotation, value_dim),
                                    ("query", self._query_rotation, key_dim)):
            if rotation is not None and (rotation.shape[-1] != dim
                                         or (rotation.dim() != 2 and rotation.shape[0] != heads)):
                raise ValueError(
                    f"layer {self.layer_idx}: {kind} rotation of shape {tuple(rotation.shape)} does not fit "
                    f"{kind} states with {heads} heads of size {dim}"
                )
        device = key_states.device
        for name in ("key_rotation", "_query_rotation", "value_rotation"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device, torch.float32))
        self.history = make_history(self.config, batch, heads, key_dim, value_dim, key_states.dtype, device)
        self.keys_buffer = key_states.new_empty((batch, heads, self.steady_capacity(), key_dim))
        self.values_buffer = value_states.new_empty((batch, heads, self.steady_capacity(), value_dim))

    def sink(self) -> int:
        """The sink size: as fixed (at the first demotion, or when counted decode begins), the config's until then."""
        return self.config.sink_tokens if self.sink_size is None else self.sink_size

    def fix_sink(self) -> None:
        """Fix the sink size (`sink`); a fixed one stays."""
        self.sink_size = self.sink()

    def steady_capacity(self) -> int:
        """BF16 rows that host-counted storage keeps between demotions: sink, window and two blocks of slack."""
        cfg = self.config
        return self.sink() + cfg.recent_tokens + 2 * cfg.demote_block

    def resize(self, capacity: int, rows: int, zeroed: bool = False) -> None:
        """Replace the BF16 buffers by ones of `capacity` rows, the first `rows` (those in use) copied over, the
        others zeros where `zeroed`, else uninitialized."""
        for name in ("keys_buffer", "values_buffer"):
            old = getattr(self, name)
            make = old.new_zeros if zeroed else old.new_empty
            fresh = make((old.shape[0], old.shape[1], capacity, old.shape[3]))
            fresh[:, :, :rows] = old[:, :, :rows]
            setattr(self, name, fresh)

    # ------------------------------------------------------------------------------------------ writes
    def write(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write the states at BF16 rows `[start, start + q)`, growing the buffers if needed; the views of rows
        `[0, start + q)`."""
        end = start + key_states.shape[-2]
        if end > self.keys_buffer.shape[2]:
            self.resize(max(end, self.steady_capacity()), start)
        self.keys_buffer[:, :, start:end] = key_states
        self.values_buffer[:, :, start:end] = value_states
        return self.keys_buffer[:, :, :end], self.values_buffer[:, :, :end]

    def write_at(self, position: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one token per row at the BF16 row `position` (long `[1]`, on the device)."""
        self.keys_buffer.index_copy_(2, position, key_states)
        self.values_buffer.index_copy_(2, position, value_states)

    def demote(self, stored, tokens: int, window_rows: torch.Tensor, backend, demoting: torch.Tensor | None = None,
               **append) -> torch.Tensor | None:
        """Move `tokens` tokens from the BF16 buffers into the history, which holds `stored` tokens before them (an
        int, or an int32 `[1]` on the device), and the recent window from `window_rows` (long `[R]`) to just
        after the sink. Unpadded: the oldest recent rows. Left-padded rows hand pads from their sink to the
        history and take real tokens into the sink in their place (`demotion.demotion_index`), where `demoting`,
        a device flag, holds 1 or is None. `append`: the history's (a device-counted step's `advance`, `after`,
        `at`); returns what the history says it dropped (None on the host path)."""
        sink = self.sink_size
        if self.row_start is None:
            keys = self.keys_buffer[:, :, sink : sink + tokens]
            values = self.values_buffer[:, :, sink : sink + tokens]
            sink_rows = None
        else:
            appended, sink_rows = demotion_index(self.row_start, stored, sink, tokens, demoting)
            keys, values = (buffer.gather(2, appended[:, None, :, None].expand(-1, buffer.shape[1], -1,
                                                                              buffer.shape[3]))
                            for buffer in (self.keys_buffer, self.values_buffer))
        dropped = self.history.append(keys, values, self.key_rotation, self.value_rotation, backend, **append)
        # the demoted rows leave the BF16 buffer whether the history kept them or not; one move for both tiers
        # (`kernels.ops.move_rows`), after the history's write (a counted step's, after its attention)
        buffers = [self.keys_buffer, self.values_buffer]
        after = dropped if append else None
        if sink_rows is None:
            move_rows(buffers, window_rows[None], sink, after)
        else:
            index = torch.cat([sink_rows, window_rows[None].expand(sink_rows.shape[0], -1)], dim=1)
            move_rows(buffers, index, 0, after)
        return dropped

    def note_padding(self, attention_mask: torch.Tensor | None, history_rows: int) -> None:
        """Read each row's left padding from `attention_mask` (its leading masked columns).

        A row's padding only grows while every column seen so far was padding (a prompt fed in chunks): its tiers
        then hold pads alone, laid out alike for any larger padding (`demotion`), so taking the maximum is exact.
        Padding that first shows after tokens were demoted as unpadded is not taken: those tokens were real to
        the cache, as they are to DynamicCache without a mask."""
        if attention_mask is None or not self.is_allocated or (self.row_start is None and history_rows):
            return
        pads = row_leading_padding(attention_mask).to(self.keys_buffer.device)
        if pads.shape[0] != self.batch_size:
            pads = pads.expand(self.batch_size)
        if self.row_start is not None:
            torch.maximum(self.row_start, pads, out=self.row_start)
        elif bool(pads.any()):
            self.row_start = pads.contiguous()

    def clamp_padding(self, tokens: int) -> None:
        """After a crop to `tokens` tokens: a row cropped back into its padding holds padding only."""
        if self.row_start is not None:
            self.row_start.clamp_(max=tokens)

    def map_batch(self, fn) -> None:
        """Apply `fn` (a selection, reorder or repeat along the batch) to every per-row tensor."""
        self.keys_buffer = fn(self.keys_buffer)
        self.values_buffer = fn(self.values_buffer)
        self.history.map_batch(fn)
        if self.row_start is not None:
            self.row_start = fn(self.row_start).contiguous()

    def reorder_in_place(self, beam_idx: torch.Tensor) -> None:
        """Reorder the rows without reallocating: counted decode's buffers keep their addresses (a compiled step
        keeps its graph)."""
        index = beam_idx.to(self.keys_buffer.device)
        for t in [self.keys_buffer, self.values_buffer, self.row_start, *self.history.buffers()]:
            if t is not None:
                t.copy_(t.index_select(0, index))

    def static_tensors(self) -> list[torch.Tensor | None]:
        """What a compiled step reads of the tiers at fixed addresses."""
        return [self.keys_buffer, self.values_buffer, self.key_rotation, self.query_rotation, self.value_rotation,
                self.row_start, *self.history.static_tensors()]

    # ------------------------------------------------------------------------------------------ reads
    def dense_kv(self, bf16_rows: int, history_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token's K/V in the model basis and dtype, history dequantized, in time order (the order of
        the mask's columns): `[B, Hkv, bf16_rows + history_rows, d]`."""
        keys, values = self.keys_buffer[:, :, :bf16_rows], self.values_buffer[:, :, :bf16_rows]
        if not history_rows:
            return keys, values
        hist_k, hist_v = self.history.dequantize(0, history_rows)
        hist_k = rotate(hist_k, self.query_rotation, transpose=True).to(keys.dtype)
        hist_v = rotate(hist_v, self.value_rotation, transpose=True).to(values.dtype)
        s = self.sink_size
        out = []
        for tiers, history in ((keys, hist_k), (values, hist_v)):
            older = torch.cat([tiers[:, :, :s], history], dim=2)
            if self.row_start is not None:  # padded rows: back to time order
                order = time_order_index(self.row_start.to(older.device), history_rows, s)
                older = older.gather(2, order[:, None, :, None].expand(-1, older.shape[1], -1, older.shape[3]))
            out.append(torch.cat([older, tiers[:, :, s:]], dim=2))
        return out[0], out[1]

    def nbytes(self, bf16_rows: int, history_rows: int, tier_dtype: torch.dtype | None = None) -> int:
        """Bytes of the stored tokens: BF16 rows in use plus the history's (codes and scales); spare capacity is
        not counted. `tier_dtype`: count the BF16 rows as stored in that dtype."""
        batch, heads, _, key_dim = self.keys_buffer.shape
        element = (tier_dtype or self.keys_buffer.dtype).itemsize
        per_token = batch * heads * (key_dim + self.values_buffer.shape[3]) * element
        return per_token * bf16_rows + self.history.nbytes(history_rows)

    def num_elements(self, tokens: int) -> int:
        """K and V elements of `tokens` tokens (what a dense cache would store)."""
        b, h, _, dk = self.keys_buffer.shape
        return tokens * b * h * (dk + self.values_buffer.shape[3])

    def allocated_nbytes(self) -> int:
        buffers = (self.keys_buffer, self.values_buffer)
        return sum(b.numel() * b.element_size() for b in buffers) + self.history.allocated_nbytes()
