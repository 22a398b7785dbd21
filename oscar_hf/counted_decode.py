"""Device-counted decode: one layer's single-token steps with every count that changes on the device.

After a prefill, a layer's single-token forwards run here. The BF16 buffers have a fixed capacity
C = S + R + b (sink, recent window, demotion block; `counted_bf16_capacity`) and the history a fixed capacity; the
counts that change from step to step (BF16 rows in use, history rows, tokens) are device tensors. The layer owns
the buffers and is the only one that writes them; a `CountedDecode` holds the counts, says where a step writes and
whether it demotes, and advances the counts. A step
1. writes the new token's K/V at BF16 row `rows` (an `index_copy_` at a device position);
2. attends through `kernels.ops.decode_attention`, which reads both counts on the device;
3. settles: the b oldest recent rows (for left-padded rows, `OscarLayer.demoted_rows`) are quantized into
   history rows `[history, history + b)` every step, and the counts advance only when the window is full (the
   decode rule of `demotion.tokens_to_demote`, decided on the device). Otherwise it is a no-op: history rows beyond the count are never read. The window shifts down by b
   the same way (an `index_select` whose source moves by b only when demoting).
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
from oscar_hf.kernels.interface import block_fits

logger = logging.get_logger(__name__)

DECODE_RESERVE = 8192  # history tokens a layer makes room for when decoding starts, unless told otherwise
CAPACITY_BUCKET = 4096  # history capacities are multiples of this, so prompts of similar length share one graph


def history_capacity(tokens: int, reserve: int, block: int, bucket: bool = True) -> int:
    """The history capacity counted decode uses for `tokens` stored plus `reserve` to come: with two demotion
    blocks of slack, rounded up to `CAPACITY_BUCKET` unless `bucket` is False (an exact `max_cache_len`); in
    buckets a compiled step's buffers keep their shapes across prompts of similar length, and its graph is reused
    instead of recompiled."""
    needed = tokens + reserve + 2 * block
    return -(-needed // CAPACITY_BUCKET) * CAPACITY_BUCKET if bucket else needed


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
    """The device counts and index tensors of one layer's counted decode (`OscarLayer.start_counted_decode`),
    over the layer's BF16 buffers, which the layer has sized `counted_bf16_capacity` rows. It reads the layer once,
    here; from then on the layer asks it where to write and whether to demote, and writes its buffers itself."""

    def __init__(self, layer, reserve: int, bucket: bool = True):
        cfg = layer.config
        self.layer_idx = layer.layer_idx
        self.sink, self.recent, self.block = layer.sink_size, cfg.recent_tokens, cfg.demote_block
        self.capacity = counted_bf16_capacity(self.sink, self.recent, self.block)
        if layer.keys_buffer.shape[2] != self.capacity or layer.values_buffer.shape[2] != self.capacity:
            raise ValueError(f"layer {layer.layer_idx}: counted decode needs BF16 buffers of {self.capacity} rows, "
                             f"got {layer.keys_buffer.shape[2]} and {layer.values_buffer.shape[2]} (resize them "
                             "first: OscarLayer.start_counted_decode)")
        self.device = device = layer.keys_buffer.device
        self.counts = torch.tensor([layer.bf16_length, layer.length, 0], dtype=torch.int32, device=device)
        self.mirror: list[int] | None = [layer.bf16_length, layer.length, 0]  # `counts` on the host, or None
        self.history_start = layer.history_length
        self.reserve = reserve
        self.bucket = bucket
        self.eager_steps = 0
        self.warned_dropped = False
        self.window = torch.arange(self.sink, self.sink + self.recent, device=device)
        # what eager steps' attention reads (`segment_counts`): valid while `_segment_fresh`
        self._stored = torch.zeros(1, dtype=torch.int32, device=device)
        self._starts = None if layer.row_start is None else (
            torch.zeros_like(layer.row_start, dtype=torch.int32), torch.zeros_like(layer.row_start, dtype=torch.int32))
        self._segment_fresh = False

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

    def position(self) -> torch.Tensor:
        """The BF16 row the step's token goes to (long `[1]`, on the device)."""
        return self.rows.long()

    def stepped(self) -> None:
        """The step's token is written: one more BF16 row and one more token."""
        self.counts[ROWS : TOKENS + 1].add_(1)

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

    def demotion(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(full, advance, stored), int32 `[1]` each, on the device: whether the window holds R + b, the rows a
        demotion then moves (`block` or 0), and the history rows stored before it (where they go)."""
        full = (self.rows - self.sink >= self.recent + self.block).to(torch.int32)
        return full, full * self.block, self.history_count()

    def window_rows(self, advance: torch.Tensor) -> torch.Tensor:
        """The recent window's BF16 rows after a demotion of `advance` rows (long `[R]`)."""
        return self._window() + advance.long()

    def demoted(self, advance: torch.Tensor, dropped: torch.Tensor) -> None:
        """The demotion moved `advance` rows out of the BF16 buffer, and the history dropped `dropped` of them."""
        self.counts[ROWS : ROWS + 1].sub_(advance)
        self.counts[DROPPED : DROPPED + 1].add_(dropped)
        self._segment_fresh = False

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

    def rows_changed(self) -> None:
        """The rows' padding changed in place (a beam reorder): refresh what `segment_counts` keeps."""
        self._segment_fresh = False

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
