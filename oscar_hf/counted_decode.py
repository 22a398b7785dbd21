"""Device-counted decode: one layer's single-token steps with every count that changes on the device.

After a prefill, a layer's single-token forwards run here. The BF16 buffers have a fixed capacity
C = S + R + b (sink, recent window, demotion block; `counted_bf16_capacity`) and the history a fixed capacity; the
counts that change from step to step (BF16 rows in use, history rows, tokens) are device tensors. The layer's
`tiers.Tiers` own the buffers and are the only ones to write them; a `CountedDecode` holds the counts and tells
the tiers where a step writes and what it demotes. A step
1. writes the new token's K/V at BF16 row `rows` (an `index_copy_` at a device position);
2. attends through `kernels.ops.decode_attention`, which reads both counts on the device;
3. settles: the b oldest recent rows (for left-padded rows, those `Tiers.demote` picks) are quantized into
   history rows `[history, history + b)` every step, and the counts advance only when the window is full (the
   decode rule of `demotion.tokens_to_demote`, decided on the device). Otherwise it is a no-op: history rows
   beyond the count are never read. The window shifts down by b the same way (an `index_select` whose source
   moves by b only when demoting).
So the host state is the same before every step, and one compiled graph, or one captured CUDA graph, serves every
phase of the demotion cycle.

The counts are one int32 tensor per layer, `counts` = (BF16 rows, tokens, demoted tokens dropped by a full history);
the history's count is derived from them (tokens - rows - dropped). Every tensor a compiled step reads from the
cache is an input that dynamo guards, and the compiled call checks on every step: one tensor of counts instead of
four, and the window and staging blocks made inside the graph, leave a layer with seven inputs (its BF16 buffers,
the four history buffers, the counts) where it had fifteen.

Eager steps also keep the counts on the host (`mirror`): the host then knows when a step demotes, and skips the
no-op demotion and window shift of the other steps (seven of eight), which otherwise cost an eager step most of
its launches. A compiled step cannot update the mirror; it drops it, and the next eager step reads the counts
back once. For the same reason eager steps keep the history count and the padded rows' starts that the attention
reads in tensors of their own (`segment_counts`), refreshed only after a demotion: the attention's tensors then
keep their addresses from step to step, and its kernels replay from a CUDA graph (`kernels.replay`).

The history holds `reserve` more tokens than it had when decoding started (`OscarCache(max_cache_len=...)` sets
it), rounded up to a multiple of `CAPACITY_BUCKET`; eager steps grow it when it is about to fill, compiled steps
cannot (growing changes the buffers' shapes).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from oscar_hf.demotion import padded_starts
from oscar_hf.handoff import HistorySegment
from oscar_hf.history import history_capacity
from oscar_hf.host_counts import HostCounts
from oscar_hf.kernels.interface import block_fits

logger = logging.get_logger(__name__)

def counted_bf16_capacity(sink: int, recent: int, block: int) -> int:
    """Rows of the BF16 buffers during counted decode: the sink, the recent window and the block that fills it
    before a demotion."""
    return sink + recent + block


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these tensors keep their address (cudagraphs then neither copy them nor re-record)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_static_address(t)


ROWS, TOKENS, DROPPED = 0, 1, 2  # the entries of `CountedDecode.counts`


class CountedDecode:
    """One layer's counted decode over its `tiers` (`OscarLayer.start_counted_decode`), whose BF16 buffers are
    sized `counted_bf16_capacity` rows: the device counts and index tensors, what a step writes where, and its
    demotion. The tiers write their buffers; this says which rows."""

    counted = True  # a counting mode (`host_counts.HostCounts` is the other)

    def __init__(self, tiers, length: int, bf16_length: int, reserve: int, bucket: bool = True):
        cfg = tiers.config
        self.tiers = tiers
        self.layer_idx = tiers.layer_idx
        self.sink, self.recent, self.block = tiers.sink_size, cfg.recent_tokens, cfg.demote_block
        self.capacity = counted_bf16_capacity(self.sink, self.recent, self.block)
        if tiers.keys_buffer.shape[2] != self.capacity or tiers.values_buffer.shape[2] != self.capacity:
            raise ValueError(f"layer {self.layer_idx}: counted decode needs BF16 buffers of {self.capacity} rows, "
                             f"got {tiers.keys_buffer.shape[2]} and {tiers.values_buffer.shape[2]} (resize them "
                             "first: OscarLayer.start_counted_decode)")
        self.device = device = tiers.keys_buffer.device
        self.counts = torch.tensor([bf16_length, length, 0], dtype=torch.int32, device=device)
        self.mirror: list[int] | None = [bf16_length, length, 0]  # `counts` on the host, or None
        self.history_start = tiers.history.length
        self.reserve = reserve
        self.bucket = bucket
        self.eager_steps = 0
        self.warned_dropped = False
        self.window = torch.arange(self.sink, self.sink + self.recent, device=device)
        # what eager steps' attention reads (`segment_counts`): valid while `_segment_fresh`
        self._stored = torch.zeros(1, dtype=torch.int32, device=device)
        row_start = tiers.row_start
        self._starts = None if row_start is None else (
            torch.zeros_like(row_start, dtype=torch.int32), torch.zeros_like(row_start, dtype=torch.int32))
        self._segment_fresh = False
        self.unclosed = False  # a step's write not closed yet (`append`, `close`)

    # ------------------------------------------------------------------------------------------ the mode
    def seq_length(self) -> torch.Tensor:
        """Tokens cached, a 0-d device tensor (as `StaticLayer` gives it): reading it neither synchronizes nor
        changes a compiled step."""
        return self.tokens

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """A counted step reads no mask, so any width fixed while counting serves (one compiled graph): the
        capacity in positions, which is at least every position held, since mask functions may index
        per-position data by it (Gemma 4 Unified's image blocks). A forward of several tokens, which leaves
        counted decode, gets the host's width."""
        if query_length == 1:
            return self.capacity + self.tiers.history.capacity, 0
        return self.host_counts()[0] + query_length, 0

    def takes(self, key_states: torch.Tensor) -> bool:
        """Whether an update of `key_states` is a counted step (one token per row, same batch)."""
        return key_states.shape[-2] == 1 and key_states.shape[0] == self.tiers.batch_size

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A step's write: the token at the BF16 row the counts give; the whole buffers returned (the segment's
        `dense_length` rows are in use). The step is open until `close`."""
        self.unclosed = True
        tiers, history = self.tiers, self.tiers.history
        if self.book_step(history.capacity):
            history.pin(self.grow(), stored=self.host_counts()[2])
            mark_static(*history.static_tensors())
        tiers.write_at(self.rows.long(), key_states, value_states)
        self.counts[ROWS : TOKENS + 1].add_(1)
        return tiers.keys_buffer, tiers.values_buffer

    def settle(self, backends, room=None) -> None:
        """Close a step no attention closed (an `update` outside a forward), as its close would have."""
        if self.unclosed:
            self.close(None, backends, room)

    def close(self, attention_mask, backends, room=None, output: torch.Tensor | None = None) -> None:
        """A step's attention is done: its demotion, after `output` (the attention that read the history rows it
        overwrites). The mask is not read (a counted step has no padding to learn), nor `room` (the history
        capacity was fixed when counting began)."""
        self.unclosed = False
        if not self.demotes(self.tiers.history.capacity):
            return
        full = (self.rows - self.sink >= self.recent + self.block).to(torch.int32)  # the window holds R + b
        advance, stored = full * self.block, self.history_count()
        window = self._window() + advance.long()
        dropped = self.tiers.demote(stored, self.block, window, backends.op, full, advance=advance, after=output,
                                    at=stored)
        self.counts[ROWS : ROWS + 1].sub_(advance)
        self.counts[DROPPED : DROPPED + 1].add_(dropped)
        self._segment_fresh = False

    def segment(self, backends, **fields) -> HistorySegment:
        """The history layout a step's attention reads (`handoff.HistorySegment`; `fields`: the layer's)."""
        tiers = self.tiers
        stored, dense_start, history_start = self.segment_counts(tiers.row_start)
        return HistorySegment(history=tiers.history.counted_view(stored), backend=backends.op_attention,
                              sink_length=self.sink, query_rotation=tiers.query_rotation,
                              value_rotation=tiers.value_rotation, counted=True, dense_start=dense_start,
                              dense_length=self.rows, history_start=history_start, **fields)

    def host_view(self) -> HostCounts:
        """The counts as host counting would hold them, changing nothing (the counts read on the device: a
        synchronization); a step no attention closed is an unsettled token there."""
        tokens, rows, history = self.host_counts()
        return HostCounts(self.tiers, tokens, rows, unsettled=int(self.unclosed), history_rows=history)

    def to_host(self) -> HostCounts:
        """The hand-over back to host counting (before a multi-token forward, a batch operation, a crop, ...): the
        history's host and device counts set from the device's, which host-counted appends then write at."""
        tokens, rows, history = self.host_counts()
        self.tiers.history.set_length(history)
        return HostCounts(self.tiers, tokens, rows, unsettled=int(self.unclosed))

    def reorder_in_place(self, beam_idx: torch.Tensor) -> bool:
        """Reorder the rows in place where the batch keeps its size (True), keeping every address."""
        if beam_idx.shape[0] != self.tiers.batch_size:
            return False
        self.tiers.reorder_in_place(beam_idx)
        self._segment_fresh = False
        return True

    def history_capacity(self) -> int:
        """The history capacity these steps need (`history_capacity` of the tokens stored when they began)."""
        return history_capacity(self.history_start, self.reserve, self.block, self.bucket)

    def static_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors of its own a compiled step reads at fixed addresses."""
        return self.counts, self.window

    @property
    def rows(self) -> torch.Tensor:
        """BF16 rows in use (int32 `[1]`, a view of `counts`)."""
        return self.counts[ROWS : ROWS + 1]

    @property
    def tokens(self) -> torch.Tensor:
        """Tokens cached (int64, 0-d), as `get_seq_length` gives them."""
        return self.counts[TOKENS].long()

    # ------------------------------------------------------------------------------------------ a step
    def book_step(self, history_capacity: int) -> bool:
        """Count one more token on the host (an eager step; a compiled one drops the mirror, as it changes the
        counts where the host cannot follow). True when the history, of `history_capacity` rows, must first grow
        (`grow`): eager steps can grow it, compiled steps cannot."""
        if torch.compiler.is_compiling():
            self.mirror = None
            return False
        self.eager_steps += 1
        if self.mirror is not None:
            self.mirror[ROWS] += 1
            self.mirror[TOKENS] += 1
        return self.history_start + self.eager_steps + self.block > history_capacity - self.block

    def grow(self) -> int:
        """The history capacity to grow to (twice the reserve; the next compile sees the new shapes)."""
        self.reserve *= 2
        return self.history_capacity()

    def demotes(self, history_capacity: int) -> bool:
        """Whether the step's close may demote: always in a compiled step (the device decides), and in an eager
        one only where the window is full, after booking the demotion in the mirror (the device's own decision
        then agrees), so that the other steps skip a no-op demotion and window shift."""
        if torch.compiler.is_compiling():
            return True
        rows, tokens, dropped = self._mirrored()
        if rows - self.sink < self.recent + self.block:
            return False
        self.mirror[ROWS] -= self.block
        if not block_fits(tokens - rows - dropped, self.block, history_capacity):
            self.mirror[DROPPED] += self.block
        return True

    def _mirrored(self) -> list[int]:
        """The host's copy of `counts`, read from the device once if compiled steps dropped it."""
        if self.mirror is None:
            self.mirror = self.counts.tolist()
        return self.mirror

    def _window(self) -> torch.Tensor:
        """The recent window's BF16 rows (long `[R]`); a compiled step computes them inside its graph (one guarded
        input fewer per layer), eager steps reuse `window`."""
        if torch.compiler.is_compiling():
            return torch.arange(self.sink, self.sink + self.recent, device=self.device)
        return self.window

    def history_count(self) -> torch.Tensor:
        """History tokens stored (int32 `[1]`): tokens - BF16 rows - dropped. Derived rather than kept, so a step
        changes its counts only through plain in-place ops on `counts`, which functionalization orders (a count
        that a custom op advanced in place was observed read after that write by a fused kernel)."""
        c = self.counts
        return c[TOKENS : TOKENS + 1] - c[ROWS : ROWS + 1] - c[DROPPED : DROPPED + 1]

    def segment_counts(self, row_start: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                      torch.Tensor | None]:
        """(history tokens stored, each row's leading pad rows among its BF16 rows and among its history rows), the
        counts a step's attention reads (`demotion.padded_starts`; None, None without padding). Eager steps get
        the same tensors every step, refreshed after a demotion (module docstring); compiled steps derive them."""
        if torch.compiler.is_compiling():
            self._segment_fresh = False  # a compiled step changes them where the host cannot follow
            stored = self.history_count()
            return (stored, *((None, None) if row_start is None else padded_starts(row_start, stored)))
        if not self._segment_fresh:
            self._stored.copy_(self.history_count())
            if row_start is not None:
                for kept, fresh in zip(self._starts, padded_starts(row_start, self._stored)):
                    kept.copy_(fresh)
            self._segment_fresh = True
        return (self._stored, *((None, None) if row_start is None else self._starts))

    def host_counts(self) -> tuple[int, int, int]:
        """(tokens, BF16 rows, history rows), read from the device; warns once when a full history dropped
        demoted tokens (compiled steps cannot grow it)."""
        if self.mirror is None and torch.compiler.is_compiling():
            raise RuntimeError(
                f"layer {self.layer_idx}: this compiled forward needs the cache's length on the host (a forward of "
                "several tokens builds its mask from it), and after compiled decode steps only the device holds it. "
                "Run this forward eagerly, or through generate with OscarCache(..., compile_decode=True): generate "
                "builds the mask outside the forward for a cache that says it is compileable.")
        rows, tokens, dropped = self._mirrored()
        if dropped and not self.warned_dropped:
            self.warned_dropped = True
            logger.warning(
                "layer %d: the history was full and %d demoted tokens were dropped (compiled decode steps cannot "
                "grow it); pass OscarCache(..., max_cache_len=<prompt + new tokens>)", self.layer_idx, dropped)
        return tokens, rows, tokens - rows - dropped
