"""The handoff from a layer's `Cache.update` to the attention call that follows it.

`update` returns the BF16 tiers (what transformers passes to the attention as key/value) and publishes a
`HistorySegment` next to them: the quantized history between those tiers, the rotations, the backend that computes
the attention, and the callback that lets the cache demote once the attention is done with this forward's tiers.
The attention function reads the segment and calls `close`; it never reaches into the cache.

Where the segment travels (`compat` holds the release differences): transformers >= 5.24 passes the attention's
kwargs dict into `update`, so the segment goes into it; older releases pass nothing, so it is also attached to the
returned key tensor.

While `torch.compile` traces a forward that is not a counted decode step (a prefill, a chunk of one), `update`
changes nothing and publishes an `UpdateRequest` instead: the attention then runs the layer's update, attention and
close as one opaque op (`attention`), because they change host state (lengths, buffers that grow, the demotion)
that a graph cannot hold. The request names the layer by a handle tensor (`layer_handle`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from oscar_hf.compat import attention_kwargs_of_update
from oscar_hf.demotion import padded_starts
from oscar_hf.kernels.interface import Backend, DecodeCall, HistoryTensors
from oscar_hf.model_support import UnsupportedModelError

SEGMENT_ARGUMENT = "oscar_segment"
SEGMENT_ATTRIBUTE = "_oscar_segment"  # on the key tensor `update` returned (every release: module docstring)


@dataclass(frozen=True)
class HistorySegment:
    """What one layer's attention needs beyond the BF16 tensors `update` returned.

    Mask columns `[0, sink_length)` and `[sink_length + history_length, kv_len)` are the BF16 tensors;
    `[sink_length, sink_length + history_length)` is the history (`history`, None while it is empty).

    `row_start` (int32 `[B]`, or None without left padding): each row's leading pad columns. Once the history holds
    tokens, a padded row's sink and history are not in time order (`demotion`, left padding): `tier_mask` restates
    the mask transformers built for that layout.

    A counted decode step (`counted`) attends to every cached token except each row's first `dense_start[b]`
    BF16 rows and `history_start[b]` history rows (int32 `[B]`, left padding, or None), without a mask.
    """

    layer_idx: int
    backend: Backend
    history: HistoryTensors | None
    sink_length: int
    query_rotation: torch.Tensor | None  # what the history's attention rotates the query by (`OscarLayer`)
    value_rotation: torch.Tensor | None
    on_close: Callable[..., None]  # called as `close` is: (attention_mask, *, query, output)
    # counted decode (`counted_decode`): `history` spans the buffers' capacity with its length on the device
    # (`length_ptr`), the key/value tensors are the whole BF16 buffer of which `dense_length` rows are in use
    counted: bool = False
    dense_length: torch.Tensor | None = None
    dense_start: torch.Tensor | None = None
    history_start: torch.Tensor | None = None
    row_start: torch.Tensor | None = None
    readers: tuple[int, ...] = ()  # other layers that attend to these tiers (KV sharing), before `close` settles

    def serves(self, layer_idx: int) -> bool:
        """Whether the attention of layer `layer_idx` may read this segment: its own layer, or one that shares its
        K/V."""
        return layer_idx == self.layer_idx or layer_idx in self.readers

    @property
    def history_length(self) -> int:
        """Host-known history tokens (a counted segment's count lives on the device: see `history.length_ptr`)."""
        return self.history.length if self.history is not None else 0

    def tier_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """`mask` (over the sink, history and BF16 columns, bool or additive) with the sink and history columns
        restated from `row_start`: there a padded row holds its tokens in the order of `demotion`'s layout, not in
        time order. Later columns, and masks of unpadded or history-less layers, are returned as they are."""
        history = self.history_length
        if mask is None or self.row_start is None or not history:
            return mask
        sink = self.sink_length
        dense, first_history = padded_starts(self.row_start.to(mask.device), history)
        columns = torch.arange(sink + history, device=mask.device)[None]
        allowed = torch.where(columns < sink, columns >= dense[:, None], columns - sink >= first_history[:, None])
        batch, q_len = allowed.shape[0], mask.shape[2]
        allowed = allowed[:, None, None, :].expand(batch, 1, q_len, sink + history)
        if mask.dtype != torch.bool:
            allowed = torch.zeros(allowed.shape, dtype=mask.dtype, device=mask.device).masked_fill_(
                ~allowed, torch.finfo(mask.dtype).min)
        rest = mask[..., sink + history :].expand(batch, 1, q_len, -1)
        return torch.cat([allowed, rest], dim=-1)

    def decode_call(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> DecodeCall:
        """A counted segment's decode step for `query` `[B, Hq, 1, D]` over the whole BF16 buffers `keys`/`values`
        (what `update` returned); `sinks` `[Hq]`: the attention's learned sink logits, if any."""
        return DecodeCall(query, keys, values, self.dense_length, self.history, self.query_rotation,
                          self.value_rotation, scaling, softcap, self.dense_start, self.history_start, sinks)

    def close(self, attention_mask: torch.Tensor | None = None, *, query: torch.Tensor | None = None,
              output: torch.Tensor | None = None) -> None:
        """The attention is done with this forward's tiers: the cache may demote.

        `attention_mask`: the forward's mask, whose leading padding the cache reads once, to size the sink.
        `query` `[B, Hq, Lq, D]`: the attention's query, whose heads a CUDA cache warms its counted decode step
        for. `output` `[B, 1, Hq, D]`: a counted step's attention output, which the step's demotion (its history
        write) must follow."""
        self.on_close(attention_mask, query=query, output=output)


def after_every_reader(close: Callable[..., None], layer_idx: int, readers: tuple[int, ...]) -> Callable[..., None]:
    """`close`, run at the last of the 1 + len(readers) closes of one segment of layer `layer_idx`: its demotion
    rewrites the tiers that the layers reading its K/V (`readers`) attend to after it."""
    left = [1 + len(readers)]

    def close_after_last_read(attention_mask, *, query=None, output=None):
        if left[0] == 0:  # the tiers it read had been rewritten by the first close's demotion
            raise UnsupportedModelError(
                f"layer {layer_idx}'s attention read the cache twice in one forward (as DiffLlama's differential "
                "attention does): OscarCache demotes after a layer's attention, so the second read saw moved tiers; "
                "this model is not supported")
        left[0] -= 1
        if left[0] == 0:
            close(attention_mask, query=query, output=output)

    return close_after_last_read


@dataclass(frozen=True)
class UpdateRequest:
    """Published instead of a segment while a compiled forward's update is left to the attention (module
    docstring): `key`/`value` given to the attention are the new states, not the tiers."""

    layer_idx: int
    handle: torch.Tensor


_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def layer_handle(layer) -> torch.Tensor:
    """A new handle naming `layer` (CPU int64 `[1]`). A tensor rather than an int, so that a compiled graph takes it
    as an input, guarded by its shape, not its value: one graph then serves every cache."""
    key = next(_KEYS)
    _LAYERS[key] = layer
    return torch.tensor([key], dtype=torch.int64)


def layer_of(handle: torch.Tensor):
    """The layer `handle` names (`layer_handle`)."""
    layer = _LAYERS.get(int(handle[0]))
    if layer is None:
        raise RuntimeError(f"no OSCAR cache layer under handle {int(handle[0])} (the cache was freed)")
    return layer


# {reader layer: the segment of the layer whose K/V it reads}, from a source's update to its readers' attention.
# A reader's key tensor is not always the one `update` returned: Gemma 4 on transformers < 5.24 passes it on with
# `.to(device)`, which keeps the tensor in eager mode but, under torch.compile, gives a new one without the
# attribute. One forward at a time per process reads it, as the handoff itself assumes.
_FOR_READERS: dict[int, HistorySegment] = {}


def forget_reader_segments() -> None:
    """Drop what a forward stopped by an exception left for its readers, before the next forward publishes (a
    cache's first layer) or a forward without a cache runs (`attention.oscar_attention`)."""
    _FOR_READERS.clear()


def publish_segment(key_states: torch.Tensor, update_kwargs: dict, segment: HistorySegment | UpdateRequest) -> None:
    """Make `segment` reach the attention function on every transformers release, and the attention of every
    layer that reads this layer's K/V (`HistorySegment.readers`)."""
    attention_kwargs = attention_kwargs_of_update(update_kwargs)
    if attention_kwargs is not None:
        attention_kwargs[SEGMENT_ARGUMENT] = segment
    setattr(key_states, SEGMENT_ATTRIBUTE, segment)
    for reader in getattr(segment, "readers", ()):
        _FOR_READERS[reader] = segment


def without_segment(tensor):
    """`tensor`, or an alias of its storage without the segment `publish_segment` attached to it (a segment holds
    the layer's close callback: the buffer that `update` returned whole must pickle without it)."""
    if isinstance(tensor, torch.Tensor) and SEGMENT_ATTRIBUTE in getattr(tensor, "__dict__", {}):
        return tensor.detach()
    return tensor


def take_segment(key_states: torch.Tensor, attention_kwargs: dict,
                 layer_idx: int | None = None) -> HistorySegment | UpdateRequest | None:
    """The segment (or update request) published for this attention call of layer `layer_idx`, or None (another
    cache, or no cache)."""
    for_reader = _FOR_READERS.pop(layer_idx, None) if _FOR_READERS else None
    segment = attention_kwargs.pop(SEGMENT_ARGUMENT, None)
    if segment is None:
        segment = getattr(key_states, SEGMENT_ATTRIBUTE, None)
    return segment if segment is not None else for_reader
