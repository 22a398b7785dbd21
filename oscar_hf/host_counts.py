"""Host-counted storage: a layer's counts as Python ints, and the demotion rule run on the host.

One of a layer's two counting modes (the other: `counted_decode.CountedDecode`, single-token steps with the counts
on the device). Prefill, prefill chunks, eager steps before counted decode starts and every batch operation run
here. The counts: `length` (sink + history + recent tokens), `bf16_length` (rows in use in the BF16 buffers: sink +
recent), `unsettled` (tokens appended by forwards not settled yet); the history's count is the history's own.

Settling demotes by `demotion.tokens_to_demote`: with S = sink size, R = `recent_tokens` and b = `demote_block`,
- after a multi-token forward (prefill, prefill chunk), the oldest tokens beyond S + R are demoted at once, so a
  prompt of L tokens leaves min(L, S) sink, max(L - S - R, 0) history and min(L - S, R) recent tokens;
- after a single-token (decode) forward, tokens are demoted only once the recent window exceeds R + b - 1, then
  down to R: b tokens every b steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_hf.demotion import tokens_to_demote
from oscar_hf.handoff import HistorySegment
from oscar_hf.history import DecodeRoom, history_capacity
from oscar_hf.tiers import Tiers


@dataclass
class HostCounts:
    tiers: Tiers
    length: int = 0
    bf16_length: int = 0
    unsettled: int = 0
    # history rows of a view of counted decode's counts (`CountedDecode.host_view`), whose history keeps its count
    # on the device; None: the history's own count
    history_rows: int | None = None

    counted = False  # a counting mode (`counted_decode.CountedDecode` is the other)

    def host_counts(self) -> tuple[int, int, int]:
        """(tokens, BF16 rows, history rows)."""
        history = self.tiers.history
        stored = self.history_rows if self.history_rows is not None else history.length if history is not None else 0
        return self.length, self.bf16_length, stored

    def seq_length(self) -> int:
        return self.length

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def takes(self, key_states: torch.Tensor) -> bool:
        """Host counting takes every update."""
        return True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write new states after the rows in use; the BF16 tiers (sink + recent + new) as views."""
        keys, values = self.tiers.write(self.bf16_length, key_states, value_states)
        new = key_states.shape[-2]
        self.bf16_length += new
        self.length += new
        self.unsettled += new
        return keys, values

    def pending_demotion(self) -> tuple[int | None, int]:
        """(sink size, tokens to demote) that settling the unsettled tokens would give, changing nothing; the sink
        is None while it is not fixed yet (it is fixed at the first demotion)."""
        cfg, fixed = self.tiers.config, self.tiers.sink_size
        if not self.unsettled:
            return fixed, 0
        sink = self.tiers.sink()
        recent = self.bf16_length - min(self.bf16_length, sink)
        demote = tokens_to_demote(recent, self.unsettled, cfg.recent_tokens, cfg.demote_block)
        return (sink if demote or fixed is not None else None), demote

    def settle(self, backends, room: DecodeRoom | None) -> None:
        """Demote the oldest recent tokens once the window overflows (module docstring). `room`: what counted
        decode will add to the history after these (None: no counted decode follows), so that the prompt's history
        and the decode steps after it take one allocation."""
        if not self.unsettled:
            return
        sink, demote = self.pending_demotion()
        self.unsettled = 0
        tiers, cfg = self.tiers, self.tiers.config
        if sink is not None:
            tiers.fix_sink()
        if not demote:
            return
        history = tiers.history
        if room is not None:
            reserve, bucket = room.reserve(self.length)
            target = history_capacity(history.length + demote, reserve, cfg.demote_block, bucket=bucket)
            history.reserve(target - history.length)
        # a history pinned by counted decode keeps its count on the device too, and appends write at that count
        stored = history.device_length if history.device_length is not None else history.length
        window = torch.arange(sink + demote, self.bf16_length, device=tiers.keys_buffer.device)
        tiers.demote(stored, demote, window, backends.plain)
        self.bf16_length = sink + cfg.recent_tokens
        if tiers.keys_buffer.shape[2] > 2 * tiers.steady_capacity():
            tiers.resize(tiers.steady_capacity(), self.bf16_length)

    def close(self, attention_mask: torch.Tensor | None, backends, room: DecodeRoom | None,
              output: torch.Tensor | None = None) -> None:
        """A forward's attention is done with the tiers: learn the rows' padding from its mask, settle. `output` is
        not read: a host-counted forward settles after its attention has run."""
        self.tiers.note_padding(attention_mask, self.host_counts()[2])
        self.settle(backends, room)

    def segment(self, backends, **fields) -> HistorySegment:
        """The history layout a forward's attention reads (`handoff.HistorySegment`; `fields`: the layer's)."""
        tiers = self.tiers
        history = self.host_counts()[2]
        return HistorySegment(history=tiers.history.kernel_view(), backend=backends.attention,
                              sink_length=tiers.sink_size if history else 0, query_rotation=tiers.query_rotation,
                              value_rotation=tiers.value_rotation, row_start=tiers.row_start, **fields)

    def host_view(self) -> HostCounts:
        """Itself (`CountedDecode.host_view`: the counts as host counting would hold them)."""
        return self

    def to_host(self) -> HostCounts:
        """Itself (`CountedDecode.to_host`: the hand-over back to host counting)."""
        return self

    def reorder_in_place(self, beam_idx: torch.Tensor) -> bool:
        """False: host-counted storage reorders by reallocating (`Tiers.map_batch`)."""
        return False

    def croppable(self) -> int:
        """The newest tokens that would still be in BF16 once pending tokens are settled."""
        sink, demote = self.pending_demotion()
        history = self.host_counts()[2]
        return self.bf16_length - demote - ((sink or 0) if history + demote else 0)

    def crop(self, remove: int, backends, room: DecodeRoom | None) -> None:
        """Drop the newest `remove` tokens (`croppable` of them at most: the caller checks)."""
        self.settle(backends, room)
        self.bf16_length -= remove
        self.length -= remove
        self.tiers.clamp_padding(self.length)
