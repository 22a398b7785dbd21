"""`OscarLayer`: one full-attention layer's token pool, BF16 sink | quantized history | BF16 recent.

Storage, per layer:
- `keys_buffer` / `values_buffer` `[B, Hkv, capacity, d]` (model dtype, model basis): the sink tokens followed
  by the recent tokens, `bf16_length` of them; `update` writes new tokens here and returns views of the buffer
  (no per-step concatenation of the history).
- `history`: the demoted tokens, rotated and quantized (`history.py`).

Logical order of the tokens is sink, history, recent; the mask columns of the attention follow it.

Demotion ("settling") runs when the attention of a forward is done with its tiers (it closes the forward's
`HistorySegment`, `handoff.py`), or lazily at the next `update`, so a forward always attends to its own tokens in
BF16. The rule is `demotion.tokens_to_demote`: with S = sink size, R = `recent_tokens` and b = `demote_block`,
- after a multi-token forward (prefill, prefill chunk), the oldest tokens beyond S + R are demoted at once, so a
  prompt of L tokens leaves min(L, S) sink, max(L - S - R, 0) history and min(L - S, R) recent tokens;
- after a single-token (decode) forward, tokens are demoted only once the recent window exceeds R + b - 1, then
  down to R: b tokens every b steps.
Left padding: each row keeps its own first `sink_tokens` real tokens as its sink, and its pads go into the history
ahead of its real history tokens (`demotion`, left padding; `row_start` holds each row's pad count, read from the
mask of the first forward that is settled). So a mixed-length batch stores about what its rows would alone, plus
the codes of the padding.

After a forward the "oscar" attention consumed (a prefill, or any eager step), single-token forwards run
device-counted (`counted_decode.CountedDecode`): fixed buffers and counts on the device, so that a compiled step
replays; a multi-token forward, a crop, a batch selection or a repeat returns to the host-counted storage above
first (a reorder for beam search stays counted, in place).

The kernel backend (`kernels.interface.Backend`) is given to the layer, or picked for its device on first use
(`kernels.select.backend_for`).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from oscar_hf.compat import positive_crop_refused
from oscar_hf.config import OscarConfig
from oscar_hf.counted_decode import (DECODE_RESERVE, CountedDecode, counted_bf16_capacity, history_capacity,
                                     mark_static)
from oscar_hf.demotion import demotion_index, time_order_index, tokens_to_demote
from oscar_hf.handoff import HistorySegment, layer_handle, without_segment
from oscar_hf.head_groups import HeadSplitBackend
from oscar_hf.history import HeadSplitHistory, make_history
from oscar_hf.kernels.interface import Backend
from oscar_hf.kernels.ops import OpBackend, move_rows
from oscar_hf.kernels.select import backend_for, has_spec
from oscar_hf.model_support import UnsupportedModelError
from oscar_hf.rotations.math import rotate


def row_leading_padding(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Leading masked-out key columns of each row (int32 `[B or 1]`, on the mask's device), read from the last
    query row; None without a mask."""
    if mask is None:
        return None
    last_row = mask[:, 0, -1, :]
    allowed = last_row if last_row.dtype == torch.bool else last_row == 0
    return (allowed.int().cumsum(dim=-1) == 0).sum(dim=-1).to(torch.int32)


class OscarLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, layer_idx: int, config: OscarConfig, key_rotation: torch.Tensor | None,
                 value_rotation: torch.Tensor | None, backend: Backend | None = None,
                 max_cache_len: int | None = None, query_rotation: torch.Tensor | None = None,
                 readers: tuple[int, ...] = ()):
        CacheLayerMixin.__init__(self)
        self.layer_idx = layer_idx
        # layers that attend to this layer's tiers after it in every forward (KV sharing, `model_support`): the
        # forward's demotion waits for the last of them
        self.readers = tuple(readers)
        self.config = config
        # keys are stored as `k @ key_rotation`; the history's attention rotates the query by `query_rotation`,
        # the same matrix unless the keys are smoothed (`Rotations.key_transforms`: then `key_rotation` times
        # `query_rotation`ᵀ is the identity, and stored rows go back to keys through `query_rotation`ᵀ)
        self.key_rotation = key_rotation
        self._query_rotation = query_rotation
        self.value_rotation = value_rotation
        self.backend = backend
        # a compiled step names its backend by its settings, which only the package's own backends state; known
        # now because `compileable_on` also runs inside traced code, where the class lookup cannot be traced
        self._backend_compiles = backend is None or has_spec(backend)
        self._compileable_answers: dict[tuple, bool] = {}  # `compileable_on`'s, per (device, head sizes, backend)
        # after a prefill consumed by the "oscar" attention, single-token forwards run device-counted
        # (`counted_decode`); False keeps every step host-counted, the rule counted decode is tested against
        self.allow_counted_decode = True
        self.max_cache_len = max_cache_len
        self.handle = layer_handle(self)  # how a compiled forward's opaque update finds this layer (`handoff`)
        self._clear()

    def __deepcopy__(self, memo):
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        clone.handle = layer_handle(clone)  # a copy is a layer of its own
        return clone

    # what pickle and `torch.save` store: the tokens and settings, host-counted, without what belongs to this
    # process (the handle's entry in the layer table, the kernel backends, a counted step's device state)
    _PROCESS_LOCAL = ("handle", "backend", "op_backend", "attention_backend", "op_attention_backend")

    def __getstate__(self) -> dict:
        if self.counted is not None:  # leave this layer's counted decode (and a compiled step's graph) alone
            clone = copy.deepcopy(self)
            clone.stop_counted_decode()
            return clone.__getstate__()
        state = {k: without_segment(v) for k, v in self.__dict__.items() if k not in self._PROCESS_LOCAL}
        state["_compileable_answers"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        """An unpickled layer selects its kernel backend for its device again (a `backend=` given to the cache is
        not stored)."""
        self.__dict__.update(state)
        self.backend = None
        self._backend_compiles = True
        self.handle = layer_handle(self)
        if self.is_initialized:
            self._attach_backends()

    def _clear(self) -> None:
        self.keys_buffer = self.values_buffer = None
        self.history = None
        self.length = 0  # logical tokens: sink + history + recent
        self.bf16_length = 0  # tokens in the BF16 buffers: sink + recent
        self.sink_size: int | None = None  # fixed at the first demotion
        self.row_start: torch.Tensor | None = None  # int32 [B]: leading pad columns per row; None: no padding
        self.unsettled = 0  # tokens appended by forwards not settled yet
        self.segment_open = False
        self.counted: CountedDecode | None = None
        self.updates = 0  # `update` calls since the last reset (eager ones: a compiled step does not count)
        self.is_initialized = False

    @property
    def query_rotation(self) -> torch.Tensor | None:
        """What the history's attention rotates the query by (see `__init__`)."""
        return self.key_rotation if self._query_rotation is None else self._query_rotation

    # ------------------------------------------------------------------------------------------ compiling
    def graph_problem(self, device: torch.device, key_dim: int, value_dim: int) -> str | None:
        """Why this layer's decode step cannot run inside a CUDA graph on `device` with heads of these sizes (its
        backend, or the one `backend_for` picks there, reads counts on the host), or None when it can."""
        backend = self.backend if self.backend is not None else backend_for(device, self.config.history_chunk)
        cfg = self.config
        settings = [cfg, cfg.high_precision()] if cfg.high_precision_heads else [cfg]
        for each in settings:
            problem = backend.graph_capture_problem(key_dim, value_dim, each.encoder if cfg.quantize else "minmax",
                                                    each.scale_dtype)
            if problem is not None:
                return problem
        return None

    def compileable_on(self, device: torch.device, key_dim: int, value_dim: int) -> bool:
        """Whether transformers may compile this layer's decode steps (device-counted, `counted_decode`; prefill
        runs eagerly). Compiled on a GPU, they replay from a CUDA graph; elsewhere the backend's host reads
        simply run inside the compiled step. A backend of the user's own class decodes eagerly only."""
        if not self._backend_compiles:
            return False
        if device.type != "cuda":
            return True
        if torch.compiler.is_compiling():  # traced code reads no host memo
            return self.graph_problem(device, key_dim, value_dim) is None
        # `generate` asks every step, for every layer: the answer is fixed by the device, the head sizes and the
        # backend, and working it out again (the high-precision config included) cost 250 us a step for 36 layers
        key = (device, key_dim, value_dim, id(self.backend))
        answer = self._compileable_answers.get(key)
        if answer is None:
            answer = self._compileable_answers[key] = self.graph_problem(device, key_dim, value_dim) is None
        return answer

    @property
    def is_compileable(self) -> bool:
        """`compileable_on` this layer's device; before the first update the cache answers with the model's
        device and head size (`OscarCache.is_compileable`)."""
        if not self.is_initialized:
            return True
        return self.compileable_on(self.device, self.keys_buffer.shape[-1], self.values_buffer.shape[-1])

    # ------------------------------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        value_dim = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        for kind, rotation, dim in (("key", self.key_rotation, key_dim), ("value", self.value_rotation, value_dim),
                                    ("query", self._query_rotation, key_dim)):
            if rotation is None:
                continue
            if rotation.shape[-1] != dim or (rotation.dim() == 3 and rotation.shape[0] != heads):
                raise ValueError(
                    f"layer {self.layer_idx}: {kind} rotation of shape {tuple(rotation.shape)} does not fit "
                    f"{kind} states with {heads} heads of size {dim}"
                )
        if self.key_rotation is not None:
            self.key_rotation = self.key_rotation.to(self.device, torch.float32)
        if self._query_rotation is not None:
            self._query_rotation = self._query_rotation.to(self.device, torch.float32)
        if self.value_rotation is not None:
            self.value_rotation = self.value_rotation.to(self.device, torch.float32)
        self.history = make_history(self.config, batch, heads, key_dim, value_dim, self.dtype, self.device)
        self.keys_buffer = key_states.new_empty((batch, heads, self._steady_capacity(), key_dim))
        self.values_buffer = value_states.new_empty((batch, heads, self._steady_capacity(), value_dim))
        self._attach_backends()
        self.is_initialized = True

    def _attach_backends(self) -> None:
        if self.backend is None:
            self.backend = backend_for(self.device, self.config.history_chunk)
        self.op_backend = OpBackend(self.backend)
        # the attention's backends: a history split by KV heads is attended run by run (`head_groups`)
        split = isinstance(self.history, HeadSplitHistory)
        self.attention_backend = HeadSplitBackend(self.backend) if split else self.backend
        self.op_attention_backend = HeadSplitBackend(self.op_backend) if split else self.op_backend

    def _steady_capacity(self) -> int:
        cfg = self.config
        sink = cfg.sink_tokens if self.sink_size is None else self.sink_size
        return sink + cfg.recent_tokens + 2 * cfg.demote_block

    def _resize_buffers(self, capacity: int, zeroed: bool = False) -> None:
        """Replace the BF16 buffers by ones of `capacity` rows (for counted decode too: `start_counted_decode`),
        the `bf16_length` rows in use copied over, the others zeros where `zeroed`, else uninitialized."""
        for name in ("keys_buffer", "values_buffer"):
            old = getattr(self, name)
            make = old.new_zeros if zeroed else old.new_empty
            fresh = make((old.shape[0], old.shape[1], capacity, old.shape[3]))
            fresh[:, :, : self.bf16_length] = old[:, :, : self.bf16_length]
            setattr(self, name, fresh)

    @property
    def batch_size(self) -> int:
        return self.keys_buffer.shape[0] if self.is_initialized else 0

    def counts(self) -> tuple[int, int, int]:
        """(tokens, BF16 rows, history rows). In counted decode the device holds them: this reads them there (a
        synchronization) and changes nothing; a compiled step reads the host's numbers of when counting began."""
        if self.counted is not None and not torch.compiler.is_compiling():
            return self.counted.host_counts()
        return self.length, self.bf16_length, (self.history.length if self.history is not None else 0)

    @property
    def history_length(self) -> int:
        return self.counts()[2]

    @property
    def sink_length(self) -> int:
        """Sink tokens in the BF16 buffer (meaningful once history exists)."""
        return self.sink_size if self.history_length else 0

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, Hkv, q, d]` states; return the BF16 tiers (sink + recent + new) as views, model basis
        (in counted decode: the whole BF16 buffer, of which the segment's `dense_length` rows are in use)."""
        if not torch.compiler.is_compiling():
            self.updates += 1  # host-side only: the cache compares it across layers (a forward that failed part-way)
        if self.counted is not None:
            if self.segment_open:  # the previous update's segment was never consumed: settle it as its close would
                self._close_counted(None)
            if self.counts_step(key_states):
                return self._counted_update(key_states, value_states)
            self.stop_counted_decode()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch_size:
            raise ValueError(
                f"layer {self.layer_idx}: the cache holds a batch of {self.batch_size} but received "
                f"{key_states.shape[0]} sequences; use a fresh OscarCache for a new batch"
            )
        # an update no attention consumed (`Cache.update` called outside a forward: prefix caching, KV transfer)
        # settles here, as its attention's close would have
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

    def _counted_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A device-counted step's write: the token at the BF16 row the counts give (the whole buffers returned)."""
        counted = self.counted
        if counted.book_step(self.history.capacity):
            self.history.length = counted.host_counts()[2]  # `pin` keeps the rows stored so far
            self.history.pin(counted.grow())
            mark_static(*self.history.static_tensors())
        position = counted.position()
        self.keys_buffer.index_copy_(2, position, key_states)
        self.values_buffer.index_copy_(2, position, value_states)
        counted.stepped()
        return self.keys_buffer, self.values_buffer

    def counts_step(self, key_states: torch.Tensor) -> bool:
        """Whether `update(key_states)` is a device-counted decode step (one token per row, same batch)."""
        return self.counted is not None and key_states.shape[-2] == 1 and key_states.shape[0] == self.batch_size

    def open_segment(self) -> HistorySegment:
        """Hand the attention function the history layout of the current forward; closing it settles (once this
        layer and every one of its `readers` have closed it)."""
        self.segment_open = True
        if self.counted is not None:
            stored, dense_start, history_start = self.counted.segment_counts(self.row_start)
            history = self.history.counted_view(stored)
            return HistorySegment(self.layer_idx, self.op_attention_backend, history, self.counted.sink,
                                  self.query_rotation, self.value_rotation,
                                  on_close=self._after_every_reader(self._close_counted), counted=True,
                                  dense_start=dense_start, dense_length=self.counted.rows,
                                  history_start=history_start, readers=self.readers)
        return HistorySegment(self.layer_idx, self.attention_backend, self.history.kernel_view(), self.sink_length,
                              self.query_rotation, self.value_rotation,
                              on_close=self._after_every_reader(self._close_segment), row_start=self.row_start,
                              readers=self.readers)

    def _after_every_reader(self, close):
        """`close`, run at the last of the 1 + len(readers) closes of one segment: a demotion rewrites the tiers
        that the segment's readers attend to after this layer."""
        left = [1 + len(self.readers)]

        def close_after_last_read(attention_mask, *, query=None, output=None):
            if left[0] == 0:  # the tiers it read had been rewritten by the first close's demotion
                raise UnsupportedModelError(
                    f"layer {self.layer_idx}'s attention read the cache twice in one forward (as DiffLlama's "
                    "differential attention does): OscarCache demotes after a layer's attention, so the second "
                    "read saw moved tiers; this model is not supported")
            left[0] -= 1
            if left[0] == 0:
                close(attention_mask, query=query, output=output)

        return close_after_last_read

    def _close_segment(self, attention_mask: torch.Tensor | None, *, query: torch.Tensor | None = None,
                       output: torch.Tensor | None = None) -> None:
        """`HistorySegment.close` of a host-counted forward: settle, then decode device-counted from the next
        step (warmed for `query`'s heads on CUDA). `output` is not read: a host-counted forward settles after its
        attention has run."""
        self.note_padding(attention_mask)
        self.settle()
        if self.allow_counted_decode and not torch.compiler.is_compiling():
            self.start_counted_decode(attention_mask)
            if query is not None and query.is_cuda:
                self._warm_counted_step(query)

    def _warm_counted_step(self, query: torch.Tensor) -> None:
        """One counted attention on a zero query, now: the kernels compile and their scratch grows for the decode
        shapes here, not inside a compiled step's CUDA-graph recording (whose pool must not keep allocations)."""
        step = query.new_zeros((query.shape[0], query.shape[1], 1, query.shape[3]))
        segment = self.open_segment()
        self.attention_backend.decode_attention(segment.decode_call(step, self.keys_buffer, self.values_buffer, 1.0))
        self.segment_open = False

    def _decode_reserve(self) -> int:
        """History tokens counted decode makes room for beyond the current ones (see `OscarCache(max_cache_len)`)."""
        return DECODE_RESERVE if self.max_cache_len is None else max(self.max_cache_len - self.length, 1)

    def _close_counted(self, attention_mask: torch.Tensor | None, *, query: torch.Tensor | None = None,
                       output: torch.Tensor | None = None) -> None:
        """`HistorySegment.close` of a counted step: its demotion, after `output` (the attention that read the
        history rows it overwrites). The mask and query are not read: a counted step has neither padding to learn
        nor a decode step to warm."""
        self.segment_open = False
        counted = self.counted
        if not counted.demotes(self.history.capacity):
            return
        full, advance, stored = counted.demotion()
        keys, values, sink_rows = self.demoted_rows(stored, counted.block, full)
        dropped = self.history.append(keys, values, self.key_rotation, self.value_rotation, self.op_backend,
                                      advance=advance, after=output, at=stored)
        # the demoted rows leave the BF16 buffer whether the history kept them or not
        self.move_tiers(sink_rows, counted.window_rows(advance), after=dropped)
        counted.demoted(advance, dropped)

    # ------------------------------------------------------------------------------------------ counted decode
    def start_counted_decode(self, attention_mask: torch.Tensor | None = None) -> None:
        """From the next single-token forward on, decode with the counts on the device (`counted_decode`); the
        sink size is fixed now, as at the first demotion (the rows' left padding is read from `attention_mask` if
        it is not known yet: `note_padding`)."""
        self.note_padding(attention_mask)
        if self.sink_size is None:
            self.sink_size = self.config.sink_tokens
        # counted decode writes into these buffers in place; their capacity is fixed while it runs
        cfg = self.config
        self._resize_buffers(counted_bf16_capacity(self.sink_size, cfg.recent_tokens, cfg.demote_block), zeroed=True)
        counted = CountedDecode(self, self._decode_reserve(), bucket=self.max_cache_len is None)
        self.history.pin(counted.history_capacity())
        self.history.prepare_staging(cfg.demote_block)
        mark_static(self.keys_buffer, self.values_buffer, *counted.static_tensors(), self.key_rotation,
                    self.query_rotation, self.value_rotation, self.row_start, *self.history.static_tensors())
        self.counted = counted

    def note_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Read each row's left padding from `attention_mask` (its leading masked columns).

        A row's padding only grows while every column seen so far was padding (a prompt fed in chunks): its tiers
        then hold pads alone, laid out alike for any larger padding (`demotion`), so taking the maximum is exact.
        Padding that first shows after tokens were demoted as unpadded is not taken: those tokens were real to
        the cache, as they are to DynamicCache without a mask."""
        if attention_mask is None or not self.is_initialized or (self.row_start is None and self.history_length):
            return
        pads = row_leading_padding(attention_mask).to(self.keys_buffer.device)
        if pads.shape[0] != self.batch_size:
            pads = pads.expand(self.batch_size)
        if self.row_start is not None:
            torch.maximum(self.row_start, pads, out=self.row_start)
        elif bool(pads.any()):
            self.row_start = pads.contiguous()

    def stop_counted_decode(self) -> None:
        """Back to host-counted storage (before a multi-token forward, a batch operation, a crop, ...)."""
        if self.counted is None:
            return
        self._refresh_host_counts()
        self.history.sync_device_length()  # the host-counted path writes at the device length from here on
        self.counted = None
        if self.segment_open:
            # the last step's token was never settled (an `update` outside a forward: no attention closed its
            # segment); it becomes an unsettled host token, which the host rule settles as the step's close would
            self.segment_open = False
            self.unsettled += 1

    def _refresh_host_counts(self) -> None:
        self.length, self.bf16_length, self.history.length = self.counted.host_counts()

    def _pending_demotion(self) -> tuple[int | None, int]:
        """(sink size, tokens to demote) that settling the unsettled tokens would give, changing nothing: the rule
        of `demotion.tokens_to_demote`, with the sink fixed at the first demotion. The sink is None while it is not
        fixed yet."""
        cfg = self.config
        if not self.unsettled:
            return self.sink_size, 0
        sink = cfg.sink_tokens if self.sink_size is None else self.sink_size
        recent = self.bf16_length - min(self.bf16_length, sink)
        demote = tokens_to_demote(recent, self.unsettled, cfg.recent_tokens, cfg.demote_block)
        return (sink if demote or self.sink_size is not None else None), demote

    def settle(self) -> None:
        """Demote the oldest recent tokens once the window overflows (see module docstring)."""
        if self.counted is not None:
            self.stop_counted_decode()
        self.segment_open = False
        if not self.unsettled:
            return
        sink, demote = self._pending_demotion()
        self.unsettled = 0
        if sink is not None:
            self.sink_size = sink
        if not demote:
            return
        cfg = self.config
        if self.allow_counted_decode:  # one allocation for the prompt's history and the decode steps after it
            target = history_capacity(self.history_length + demote, self._decode_reserve(), cfg.demote_block,
                                      bucket=self.max_cache_len is None)
            self.history.reserve(target - self.history_length)
        # a history pinned by counted decode keeps its count on the device too, and appends write at that count
        stored = self.history.device_length if self.history.device_length is not None else self.history_length
        keys, values, sink_rows = self.demoted_rows(stored, demote)
        self.history.append(keys, values, self.key_rotation, self.value_rotation, self.backend)
        self.move_tiers(sink_rows, torch.arange(sink + demote, self.bf16_length, device=self.keys_buffer.device))
        self.bf16_length = sink + cfg.recent_tokens
        if self.keys_buffer.shape[2] > 2 * self._steady_capacity():
            self._resize_buffers(self._steady_capacity())

    def demoted_rows(self, history_length, tokens: int, demoting: torch.Tensor | None = None):
        """(keys, values, sink) for a demotion of `tokens` tokens with `history_length` (an int, or an int32 `[1]`
        on the device) tokens stored before it: the rows `[B, H, tokens, d]` it appends to the history, and where
        each row's sink comes from afterwards (long `[B, S]`; None: unchanged). Unpadded: the oldest recent rows.
        Left-padded rows hand pads from their sink to the history and take real tokens into the sink in their
        place (`demotion.demotion_index`), where `demoting`, a device flag, holds 1 or is None. `move_tiers`
        rewrites the sink once the history has the rows."""
        sink = self.sink_size
        if self.row_start is None:
            return self.keys_buffer[:, :, sink : sink + tokens], self.values_buffer[:, :, sink : sink + tokens], None
        appended, kept = demotion_index(self.row_start, history_length, sink, tokens, demoting)
        rows = []
        for buffer in (self.keys_buffer, self.values_buffer):
            heads, dim = buffer.shape[1], buffer.shape[3]
            rows.append(buffer.gather(2, appended[:, None, :, None].expand(-1, heads, -1, dim)))
        return rows[0], rows[1], kept

    def move_tiers(self, sink_rows: torch.Tensor | None, window_rows: torch.Tensor,
                   after: torch.Tensor | None = None) -> None:
        """The BF16 tiers after a demotion, in one move (`kernels.ops.move_rows`): each row's sink from
        `sink_rows` (long `[B, S]`, `demoted_rows`; None: kept) and the recent window from `window_rows` (long
        `[R]`). `after`: what the move must follow (a counted step's history write, after its attention)."""
        buffers = [self.keys_buffer, self.values_buffer]
        if sink_rows is None:
            move_rows(buffers, window_rows[None], self.sink_size, after)
        else:
            index = torch.cat([sink_rows, window_rows[None].expand(sink_rows.shape[0], -1)], dim=1)
            move_rows(buffers, index, 0, after)

    # ------------------------------------------------------------------------------------------ views
    # transformers' layers hold their K/V in `keys`/`values`, and a model may read them there (Mllama on
    # transformers >= 5.24 checks every layer's `keys` for cached image states): it gets every token's K/V
    # dequantized, which is correct for any reader, at the cost of dequantizing the history on each read
    @property
    def keys(self) -> torch.Tensor | None:
        return self.dense_kv()[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value: None) -> None:  # `CacheLayerMixin.__init__` clears it; the tiers are the storage
        if value is not None:
            raise AttributeError("an OSCAR layer's keys are stored in its tiers; `keys` is a read-only view")

    @property
    def values(self) -> torch.Tensor | None:
        return self.dense_kv()[1] if self.is_initialized else None

    @values.setter
    def values(self, value: None) -> None:
        if value is not None:
            raise AttributeError("an OSCAR layer's values are stored in its tiers; `values` is a read-only view")

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached K/V in the model basis and dtype, history dequantized: `[B, Hkv, length, d]`.

        The slow but exact fallback for attention implementations other than 'oscar'. A read: in counted decode
        it takes the counts from the device (a synchronization) and the decode goes on counted.
        """
        if self.counted is not None:
            self._refresh_host_counts()
        keys, values = self.keys_buffer[:, :, : self.bf16_length], self.values_buffer[:, :, : self.bf16_length]
        if not self.history_length:
            return keys, values
        hist_k, hist_v = self.history.dequantize(0, self.history_length)
        hist_k = rotate(hist_k, self.query_rotation, transpose=True).to(self.dtype)
        hist_v = rotate(hist_v, self.value_rotation, transpose=True).to(self.dtype)
        s = self.sink_length
        out = []
        for tiers, history in ((keys, hist_k), (values, hist_v)):
            older = torch.cat([tiers[:, :, :s], history], dim=2)
            if self.row_start is not None:  # padded rows: back to time order, the order of the mask's columns
                order = time_order_index(self.row_start.to(older.device), self.history_length, s)
                older = older.gather(2, order[:, None, :, None].expand(-1, older.shape[1], -1, older.shape[3]))
            out.append(torch.cat([older, tiers[:, :, s:]], dim=2))
        return out[0], out[1]

    def get_seq_length(self) -> int:
        """Tokens cached; in counted decode a 0-d device tensor (as `StaticLayer` gives), so that reading it
        neither synchronizes nor changes a compiled step."""
        if self.counted is not None:
            return self.counted.tokens
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.counted is not None:
            if query_length == 1:
                # a counted step reads no mask, so any width fixed while counting serves (one compiled graph): the
                # capacity in positions, which is at least every position held, since mask functions may index
                # per-position data by it (Gemma 4 Unified's image blocks)
                return self.counted.capacity + self.history.capacity, 0
            self._refresh_host_counts()  # a multi-token forward is coming: it will leave counted decode
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # ------------------------------------------------------------------------------------------ batch ops
    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.stop_counted_decode()
        self.keys_buffer = fn(self.keys_buffer)
        self.values_buffer = fn(self.values_buffer)
        self.history.map_batch(fn)
        if self.row_start is not None:
            self.row_start = fn(self.row_start).contiguous()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.counted is not None and beam_idx.shape[0] == self.batch_size:
            # in place: counted decode's buffers keep their addresses (a compiled step keeps its graph)
            index = beam_idx.to(self.keys_buffer.device)
            tensors = [self.keys_buffer, self.values_buffer, self.row_start, *self.history.buffers()]
            for t in tensors:
                if t is not None:
                    t.copy_(t.index_select(0, index))
            self.counted.rows_changed()
            return
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop_problem(self, tokens_to_remove: int) -> str | None:
        """Why `crop(tokens_to_remove)` would fail, or None; changes nothing (the cache checks every layer first)."""
        if tokens_to_remove > 0 and positive_crop_refused():
            return (f"crop({tokens_to_remove}): a positive value is not supported by this transformers release; "
                    "pass a negative number, the tokens to remove")
        remove = self._tokens_to_crop(tokens_to_remove)
        croppable = self._croppable()
        if remove > croppable:
            return (f"layer {self.layer_idx}: cannot crop {remove} tokens, only the newest {croppable} are still in "
                    "BF16; older tokens are already quantized")
        return None

    def _tokens_to_crop(self, tokens_to_remove: int) -> int:
        if self.counted is not None:
            self._refresh_host_counts()
        if tokens_to_remove > 0:  # legacy (transformers 5.17): keep that many
            return max(self.length - tokens_to_remove, 0)
        return -tokens_to_remove

    def _croppable(self) -> int:
        """The newest tokens that would still be in BF16 once pending tokens are settled."""
        sink, demote = self._pending_demotion()
        return self.bf16_length - demote - ((sink or 0) if self.history_length + demote else 0)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens; they must still be in the BF16 recent window (`crop_problem` says when not).

        A negative value removes that many tokens; a positive value keeps that many, where the installed transformers
        still accepts it (5.17)."""
        self.stop_counted_decode()  # host counts from here on (the check below then reads them without a sync)
        problem = self.crop_problem(tokens_to_remove)
        if problem is not None:
            raise ValueError(problem)
        remove = self._tokens_to_crop(tokens_to_remove)
        if remove <= 0:
            return
        self.settle()
        self.bf16_length -= remove
        self.length -= remove
        if self.row_start is not None:  # a row cropped back into its padding holds padding only
            self.row_start.clamp_(max=self.length)

    def reset(self) -> None:
        self._clear()

    def offload(self) -> None:
        raise NotImplementedError("OscarCache does not support CPU offloading")

    def prefetch(self) -> None:
        raise NotImplementedError("OscarCache does not support CPU offloading")

    # ------------------------------------------------------------------------------------------ memory
    def nbytes(self, tier_dtype: torch.dtype | None = None) -> int:
        """Bytes of the stored tokens: the BF16 tiers plus the history (codes and scales); spare capacity is not
        counted. `tier_dtype`: count the tiers as stored in that dtype (e.g. what a float32 model's cache would
        store under a BF16 model)."""
        if not self.is_initialized:
            return 0
        _, bf16_rows, history_rows = self.counts()
        batch, heads, _, key_dim = self.keys_buffer.shape
        element = (tier_dtype or self.keys_buffer.dtype).itemsize
        per_token = batch * heads * (key_dim + self.values_buffer.shape[3]) * element
        return per_token * bf16_rows + self.history.nbytes(history_rows)

    def num_elements(self) -> int:
        """K and V elements of the logical tokens (what a dense cache would store)."""
        if not self.is_initialized:
            return 0
        b, h, _, dk = self.keys_buffer.shape
        return self.counts()[0] * b * h * (dk + self.values_buffer.shape[3])

    def allocated_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        buffers = (self.keys_buffer, self.values_buffer)
        return sum(b.numel() * b.element_size() for b in buffers) + self.history.allocated_nbytes()

    def __repr__(self) -> str:
        tokens, bf16_rows, history_rows = self.counts()
        sink = self.sink_size if history_rows else 0
        return (f"OscarLayer(idx={self.layer_idx}, tokens={tokens}, sink={sink}, history={history_rows}, "
                f"bf16={bf16_rows})")


class OscarHybridLayer(LinearAttentionLayer, OscarLayer):
    """A decoder layer that holds a linear-attention (or SSM / convolution) state beside its full attention
    (transformers' "hybrid" layer type, e.g. Falcon-H1, Zamba2): transformers' state as it keeps it, the full
    attention's K/V as `OscarLayer` does."""

    def __init__(self, *args, number_of_states: int = 1, **kwargs):
        OscarLayer.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # the K/V path calls it with the two states, the recurrent path with keywords only (as transformers' own
        # hybrid layer tells them apart)
        if args:
            OscarLayer.lazy_initialization(self, *args, **kwargs)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        OscarLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        OscarLayer.reorder_cache(self, beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        LinearAttentionLayer.batch_select_indices(self, indices)
        OscarLayer.batch_select_indices(self, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        LinearAttentionLayer.batch_repeat_interleave(self, repeats)
        OscarLayer.batch_repeat_interleave(self, repeats)

    def crop_problem(self, tokens_to_remove: int) -> str | None:
        return OscarLayer.crop_problem(self, tokens_to_remove)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        OscarLayer.crop(self, tokens_to_remove)

    def get_seq_length(self) -> int:
        return OscarLayer.get_seq_length(self)

    def get_max_length(self) -> int:
        return OscarLayer.get_max_length(self)

    def offload(self) -> None:
        OscarLayer.offload(self)

    def prefetch(self) -> None:
        OscarLayer.prefetch(self)

    def __repr__(self) -> str:
        return OscarLayer.__repr__(self)


def oscar_layer_for(replaced, layer_idx: int, plan, backend: Backend | None, max_cache_len: int | None) -> OscarLayer:
    """The OSCAR layer that takes the place of transformers' cache layer `replaced` (a full-attention layer, alone
    or beside a linear-attention state) for layer `layer_idx` of a `plan.LayerPlan`."""
    options = dict(max_cache_len=max_cache_len, query_rotation=plan.query_rotation, readers=plan.readers)
    args = (layer_idx, plan.config, plan.key_rotation, plan.value_rotation, backend)
    if isinstance(replaced, LinearAttentionCacheLayerMixin):
        return OscarHybridLayer(*args, number_of_states=replaced.number_of_states, **options)
    return OscarLayer(*args, **options)
