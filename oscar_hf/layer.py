"""`OscarLayer`: one full-attention layer's cache, BF16 sink | quantized history | BF16 recent, in transformers'
cache-layer interface.

A layer joins three parts:
- its `tiers.Tiers`: the BF16 buffers, the history and the rotations, and the only writer of them;
- its counting mode: `host_counts.HostCounts` (the counts on the host: prefill, prefill chunks, batch operations)
  or, once a forward that the "oscar" attention consumed has settled, `counted_decode.CountedDecode` (single-token
  steps with the counts on the device, so that a compiled step replays). The layer hands one over to the other
  (`start_counted_decode`, `stop_counted_decode`) and asks whichever is current for everything else; a
  multi-token forward, a crop, a batch selection or a repeat returns to host counting first (a reorder for beam
  search stays counted, in place);
- the handoff to the attention (`handoff.HistorySegment`): `update` returns the BF16 tiers, `open_segment` what
  else the attention reads, and closing the segment settles (demotes) once this layer and every layer that reads
  its K/V (`readers`) are done with it, so a forward always attends to its own tokens in BF16. An update that no
  attention consumed settles at the next `update`.

The tokens' logical order is sink, history, recent, and the attention's mask columns follow it. Left padding: each
row keeps its own first `sink_tokens` real tokens as its sink, and its pads go into the history ahead of its real
history tokens (`demotion`); `row_start` holds each row's pad count, read from the mask of the first forward that
is settled. So a mixed-length batch stores about what its rows would alone, plus the codes of the padding.

The kernel backend (`kernels.interface.Backend`) is given to the layer, or picked for its device on first use
(`kernels.select.backend_for`).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin

from oscar_hf.compat import positive_crop_refused
from oscar_hf.config import OscarConfig
from oscar_hf.counted_decode import CountedDecode, counted_bf16_capacity, mark_static
from oscar_hf.handoff import HistorySegment, after_every_reader, layer_handle
from oscar_hf.head_groups import layer_backends
from oscar_hf.history import DecodeRoom, splits_by_heads
from oscar_hf.host_counts import HostCounts
from oscar_hf.kernels.interface import Backend
from oscar_hf.kernels.select import backend_for, decode_compiles, has_spec
from oscar_hf.tiers import Tiers


def _of_tiers(name: str) -> property:
    """A layer attribute that lives in its tiers (read and set there)."""
    return property(lambda self: getattr(self.tiers, name), lambda self, value: setattr(self.tiers, name, value))


class OscarLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    config = _of_tiers("config")
    key_rotation = _of_tiers("key_rotation")
    value_rotation = _of_tiers("value_rotation")
    query_rotation = property(lambda self: self.tiers.query_rotation)
    keys_buffer = _of_tiers("keys_buffer")
    values_buffer = _of_tiers("values_buffer")
    history = _of_tiers("history")
    sink_size = _of_tiers("sink_size")
    row_start = _of_tiers("row_start")

    def __init__(self, layer_idx: int, config: OscarConfig, key_rotation: torch.Tensor | None,
                 value_rotation: torch.Tensor | None, backend: Backend | None = None,
                 max_cache_len: int | None = None, query_rotation: torch.Tensor | None = None,
                 readers: tuple[int, ...] = ()):
        self.tiers = Tiers(layer_idx, config, key_rotation, value_rotation, query_rotation)
        CacheLayerMixin.__init__(self)
        self.layer_idx = layer_idx
        # layers that attend to this layer's tiers after it in every forward (KV sharing, `model_support`): the
        # forward's demotion waits for the last of them
        self.readers = tuple(readers)
        self.backend, self.backends = backend, None
        # a compiled step names its backend by its settings, which only the package's own backends state; known
        # now because `compileable_on` also runs inside traced code, where the class lookup cannot be traced
        self._backend_compiles = backend is None or has_spec(backend)
        self._compileable_answers: dict[tuple, bool] = {}  # `compileable_on`'s, per (device, head sizes, backend)
        # after a prefill consumed by the "oscar" attention, single-token forwards run device-counted
        # (`counted_decode`); False keeps every step host-counted, the rule counted decode is tested against
        self.allow_counted_decode = True
        self.room = DecodeRoom(max_cache_len)  # the history room counted decode makes
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
    # process (the handle's entry in the layer table, the kernel backends)
    def __getstate__(self) -> dict:
        if self.mode.counted:  # leave this layer's counted decode (and a compiled step's graph) alone
            clone = copy.deepcopy(self)
            clone.stop_counted_decode()
            return clone.__getstate__()
        state = {k: v for k, v in self.__dict__.items() if k not in ("handle", "backend", "backends")}
        state["_compileable_answers"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        """An unpickled layer selects its kernel backend for its device again (a `backend=` given to the cache is
        not stored)."""
        self.__dict__.update(state)
        self.backend, self.backends, self._backend_compiles = None, None, True
        self.handle = layer_handle(self)
        if self.is_initialized:
            self._attach_backends()

    def _clear(self) -> None:
        self.mode: HostCounts | CountedDecode = HostCounts(self.tiers)
        self.segment_open = False
        self.updates = 0  # `update` calls since the last reset (eager ones: a compiled step does not count)
        self.is_initialized = False

    @property
    def counted(self) -> CountedDecode | None:
        """The counted decode under way, or None while the layer counts on the host."""
        return self.mode if self.mode.counted else None

    # ------------------------------------------------------------------------------------------ compiling
    def compileable_on(self, device: torch.device, key_dim: int, value_dim: int) -> bool:
        """Whether transformers may compile this layer's decode steps (device-counted, `counted_decode`; prefill
        runs eagerly). Compiled on a GPU, they replay from a CUDA graph; elsewhere the backend's host reads
        simply run inside the compiled step. A backend of the user's own class decodes eagerly only."""
        return self._backend_compiles and decode_compiles(self.backend, self.config, device, key_dim, value_dim,
                                                          self._compileable_answers)

    @property
    def is_compileable(self) -> bool:
        """`compileable_on` this layer's device; before the first update the cache answers with the model's
        device and head size (`OscarCache.is_compileable`)."""
        return not self.is_initialized or self.compileable_on(self.device, self.keys_buffer.shape[-1],
                                                              self.values_buffer.shape[-1])

    # ------------------------------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._attach_backends()
        self.tiers.allocate(key_states, value_states)
        self.is_initialized = True

    def _attach_backends(self) -> None:
        if self.backend is None:
            self.backend = backend_for(self.device, self.config.history_chunk)
        self.backends = layer_backends(self.backend, splits_by_heads(self.config))

    max_cache_len = property(lambda self: self.room.max_cache_len)

    def _room(self) -> DecodeRoom | None:
        """The history room counted decode will want, or None where it does not follow (`allow_counted_decode`)."""
        return self.room if self.allow_counted_decode else None

    batch_size = property(lambda self: self.tiers.batch_size)

    def counts(self) -> tuple[int, int, int]:
        """(tokens, BF16 rows, history rows). In counted decode the device holds them: this reads them there (a
        synchronization) and changes nothing."""
        return self.mode.host_counts()

    history_length = property(lambda self: self.counts()[2])

    @property
    def sink_length(self) -> int:
        """Sink tokens in the BF16 buffer (meaningful once history exists)."""
        return self.sink_size if self.history_length else 0

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, Hkv, q, d]` states; return the BF16 tiers (sink + recent + new) as views, model basis
        (in counted decode: the whole BF16 buffers, of which the segment's `dense_length` rows are in use)."""
        if self.is_initialized and key_states.shape[0] != self.batch_size:
            raise ValueError(f"layer {self.layer_idx}: the cache holds a batch of {self.batch_size} but received "
                             f"{key_states.shape[0]} sequences; use a fresh OscarCache for a new batch")
        if not torch.compiler.is_compiling():
            self.updates += 1  # host-side only: the cache compares it across layers (a forward that failed part-way)
        self.settle()
        if not self.mode.takes(key_states):
            self.stop_counted_decode()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.mode.append(key_states, value_states)

    def counts_step(self, key_states: torch.Tensor) -> bool:
        """Whether `update(key_states)` is a device-counted decode step (one token per row, same batch)."""
        return self.mode.counted and self.mode.takes(key_states)

    def settle(self) -> None:
        """Settle what earlier updates left that no attention closed (`Cache.update` called outside a forward:
        prefix caching, KV transfer), as its close would have: the host rule's demotion, or a counted step's."""
        self.segment_open = False
        self.mode.settle(self.backends, self._room())

    def open_segment(self) -> HistorySegment:
        """Hand the attention function the history layout of the current forward; closing it settles (once this
        layer and every one of its `readers` have closed it)."""
        self.segment_open = True
        return self.mode.segment(self.backends, layer_idx=self.layer_idx, readers=self.readers,
                                 on_close=after_every_reader(self._close, self.layer_idx, self.readers))

    def _close(self, attention_mask: torch.Tensor | None, *, query: torch.Tensor | None = None,
               output: torch.Tensor | None = None) -> None:
        """`HistorySegment.close`: the mode settles the forward (a host-counted one after reading the rows'
        padding from `attention_mask`; a counted step after `output`, the attention that read the history rows its
        demotion overwrites). A host-counted one then hands over to counted decode, warmed for `query`'s heads on
        CUDA; first, the kernels of this close and the steps after it compile at once (`_rehearse_hand_over`)."""
        self.segment_open = False
        if hands_over := self.allow_counted_decode and not (self.mode.counted or torch.compiler.is_compiling()):
            _rehearse_hand_over(self, attention_mask, query)
        self.mode.close(attention_mask, self.backends, self._room(), output)
        if not hands_over:
            return
        self.start_counted_decode(attention_mask)
        if query is not None and query.is_cuda:
            self._warm_counted_step(query)

    def _warm_counted_step(self, query: torch.Tensor) -> None:
        """One counted attention on a zero query, now: the kernels compile and their scratch grows for the decode
        shapes here, not inside a compiled step's CUDA-graph recording (whose pool must not keep allocations)."""
        step = _zero_step(query)
        segment = self.open_segment()
        self.backends.attention.decode_attention(segment.decode_call(step, self.keys_buffer, self.values_buffer, 1.0))
        self.segment_open = False

    # ------------------------------------------------------------------------------------------ hand-overs
    def start_counted_decode(self, attention_mask: torch.Tensor | None = None) -> None:
        """Count on the device from the next single-token forward on (`counted_decode`); the sink size is fixed
        now, as at the first demotion (the rows' left padding is read from `attention_mask` if it is not known
        yet)."""
        tokens, bf16_rows, history_rows = self.mode.host_counts()
        tiers, cfg = self.tiers, self.config
        tiers.note_padding(attention_mask, history_rows)
        tiers.fix_sink()
        # counted decode writes into these buffers in place; their capacity is fixed while it runs
        tiers.resize(counted_bf16_capacity(tiers.sink_size, cfg.recent_tokens, cfg.demote_block), bf16_rows,
                     zeroed=True)
        counted = CountedDecode(tiers, tokens, bf16_rows, *self.room.reserve(tokens))
        tiers.history.pin(counted.history_capacity())
        tiers.history.prepare_staging(cfg.demote_block)
        mark_static(*tiers.static_tensors(), *counted.static_tensors())
        self.mode = counted

    def stop_counted_decode(self) -> None:
        """Back to host counting (before a multi-token forward, a batch operation, a crop, ...)."""
        self.mode = self.mode.to_host()

    # ------------------------------------------------------------------------------------------ views
    # transformers' layers hold their K/V in `keys`/`values`, and a model may read them there (Mllama on
    # transformers >= 5.24 checks every layer's `keys` for cached image states): it gets every token's K/V
    # dequantized, which is correct for any reader, at the cost of dequantizing the history on each read. The
    # setters take only the None of `CacheLayerMixin.__init__`: the tiers are the storage.
    def _refuse_assignment(self, value) -> None:
        if value is not None:
            raise AttributeError("an OSCAR layer's keys and values are stored in its tiers; they are read-only views")

    keys = property(lambda self: self.dense_kv()[0] if self.is_initialized else None, _refuse_assignment)
    values = property(lambda self: self.dense_kv()[1] if self.is_initialized else None, _refuse_assignment)

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached K/V in the model basis and dtype, history dequantized: `[B, Hkv, length, d]`. The slow but
        exact fallback for attention implementations other than 'oscar'; in counted decode it reads the counts on
        the device (a synchronization), and the decode goes on counted."""
        _, bf16_rows, history_rows = self.counts()
        return self.tiers.dense_kv(bf16_rows, history_rows)

    def get_seq_length(self) -> int:
        """Tokens cached; in counted decode a 0-d device tensor (as `StaticLayer` gives), so that reading it
        neither synchronizes nor changes a compiled step."""
        return self.mode.seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.mode.mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1

    # ------------------------------------------------------------------------------------------ batch ops
    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self.stop_counted_decode()
            self.tiers.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.mode.reorder_in_place(beam_idx):
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
        counts = self.mode.host_view()
        remove, croppable = _tokens_to_crop(tokens_to_remove, counts.length), counts.croppable()
        if remove > croppable:
            return (f"layer {self.layer_idx}: cannot crop {remove} tokens, only the newest {croppable} are still in "
                    "BF16; older tokens are already quantized")
        return None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens, which must still be in the BF16 recent window (`crop_problem` says when not):
        `_tokens_to_crop(tokens_to_remove)` of them."""
        self.stop_counted_decode()
        problem = self.crop_problem(tokens_to_remove)
        if problem is not None:
            raise ValueError(problem)
        remove = _tokens_to_crop(tokens_to_remove, self.mode.length)
        if remove > 0:
            self.segment_open = False
            self.mode.crop(remove, self.backends, self._room())

    def reset(self) -> None:
        self.tiers = self.tiers.emptied()
        self._clear()

    def offload(self) -> None:
        raise NotImplementedError("OscarCache does not support CPU offloading")

    prefetch = offload

    # ------------------------------------------------------------------------------------------ memory
    def nbytes(self, tier_dtype: torch.dtype | None = None) -> int:
        """Bytes of the stored tokens: the BF16 tiers plus the history (codes and scales); spare capacity is not
        counted. `tier_dtype`: count the tiers as stored in that dtype (e.g. what a float32 model's cache would
        store under a BF16 model)."""
        return self.tiers.nbytes(*self.counts()[1:], tier_dtype) if self.is_initialized else 0

    def num_elements(self) -> int:
        """K and V elements of the logical tokens (what a dense cache would store)."""
        return self.tiers.num_elements(self.counts()[0]) if self.is_initialized else 0

    def allocated_nbytes(self) -> int:
        return self.tiers.allocated_nbytes() if self.is_initialized else 0

    def __repr__(self) -> str:
        tokens, bf16_rows, history_rows = self.counts()
        sink = self.sink_size if history_rows else 0
        return (f"OscarLayer(idx={self.layer_idx}, tokens={tokens}, sink={sink}, history={history_rows}, "
                f"bf16={bf16_rows})")


def _rehearse_hand_over(layer: OscarLayer, attention_mask: torch.Tensor | None, query: torch.Tensor | None) -> None:
    """Compile in one pass of the backend (`Backend.rehearse`: on CUDA, once per shape) the kernels of `layer`'s
    host-counted close that hands over to counted decode (its demotion, the warm-up) and of a demotion block's
    counted steps after it (attention, and the demotion and window shift of the step that fills the window). They
    compile at once instead of at the close, the first step and the first demotion, one after another. The pass
    runs all of it on a copy of `layer` that shares its backends and waits for no reader: no kernel runs, and the
    copy's own tensor operations touch only its own tensors."""

    def rehearsal() -> None:
        scratch = copy.deepcopy(layer, {id(layer.backend): layer.backend, id(layer.backends): layer.backends})
        scratch.readers = ()
        scratch._close(attention_mask, query=query)
        step = _zero_step(query)
        keys, values = (buffer.new_zeros((*buffer.shape[:2], 1, buffer.shape[-1]))
                        for buffer in (scratch.keys_buffer, scratch.values_buffer))
        for _ in range(layer.config.demote_block):
            stored_keys, stored_values = scratch.update(keys, values)
            segment = scratch.open_segment()
            segment.close(output=segment.backend.decode_attention(
                segment.decode_call(step, stored_keys, stored_values, 1.0)))

    if query is not None:  # None: a close outside the attention, which warms nothing either
        args = (query, attention_mask, layer.config, *layer.tiers.static_tensors())
        layer.backends.plain.rehearse("hand-over", args, query.device, rehearsal)


def _zero_step(query: torch.Tensor) -> torch.Tensor:
    """A zero query of one position `[B, Hq, 1, D]` in `query`'s heads, size and dtype: what warms a decode step."""
    return query.new_zeros((query.shape[0], query.shape[1], 1, query.shape[3]))


def _tokens_to_crop(tokens_to_remove: int, length: int) -> int:
    """Tokens a `crop(tokens_to_remove)` removes from `length`: a negative value removes that many, a positive one
    keeps that many (legacy, transformers 5.17)."""
    return max(length - tokens_to_remove, 0) if tokens_to_remove > 0 else -tokens_to_remove
