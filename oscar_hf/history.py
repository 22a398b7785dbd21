"""The history tier of one layer: demoted tokens in the rotated basis, append-only, amortized growth.

`QuantizedHistory` stores packed codes `[B, H, capacity, d * bits / 8]` (uint8) and per-row (scale, zero)
`[B, H, capacity, 2]` (scale dtype) for keys and values. `FullPrecisionHistory` stores rotated rows in the model
dtype (the `none` method: same tiers and merge, no quantization). Both grow by at least an eighth of their size
(geometric, so appending costs amortized O(new tokens), never a copy of the whole history per step; an eighth
rather than a half so that spare capacity stays under 12.5% of a long context's history).

`HeadSplitHistory` keeps a layer's history as runs of adjacent KV heads, each a `QuantizedHistory` of its own code
width (`OscarConfig.high_precision_heads`; the attention over it: `head_groups`).

`pin(capacity)` prepares a history for device-counted decode (`oscar_hf.counted_decode`), whose steps a compiled
graph or a CUDA graph replays: the buffers get a fixed capacity and the length is also kept on the device
(`device_length`, int32 `[1]`). Appends then write at that device position, so a replayed append lands at the
right place every time; the kernels read the length from `device_length`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from oscar_hf.config import OscarConfig
from oscar_hf.head_groups import head_runs
from oscar_hf.kernels.interface import DemoteCall, HeadRun, HeadSplitTensors, HistoryTensors, heads_of
from oscar_hf.kernels.ops import write_rows_eagerly  # also registers torch.ops.oscar_hf
from oscar_hf.kernels.reference.attention import history_rows
from oscar_hf.rotations.math import rotate

DECODE_RESERVE = 8192  # history tokens a layer makes room for when decoding starts, unless told otherwise
CAPACITY_BUCKET = 4096  # history capacities are multiples of this, so prompts of similar length share one graph


def history_capacity(tokens: int, reserve: int, block: int, bucket: bool = True) -> int:
    """The history capacity counted decode uses for `tokens` stored plus `reserve` to come: with two demotion
    blocks of slack, rounded up to `CAPACITY_BUCKET` unless `bucket` is False (an exact `max_cache_len`); in
    buckets a compiled step's buffers keep their shapes across prompts of similar length, and its graph is reused
    instead of recompiled."""
    needed = tokens + reserve + 2 * block
    return -(-needed // CAPACITY_BUCKET) * CAPACITY_BUCKET if bucket else needed


@dataclasses.dataclass(frozen=True)
class DecodeRoom:
    """The history room counted decode makes (`counted_decode`; `OscarCache(max_cache_len)`): `DECODE_RESERVE`
    tokens beyond those stored, capacities in buckets; with `max_cache_len`, exactly up to it."""

    max_cache_len: int | None = None

    def reserve(self, tokens: int) -> tuple[int, bool]:
        """(history tokens to make room for beyond the `tokens` cached, whether capacities come in buckets)."""
        if self.max_cache_len is None:
            return DECODE_RESERVE, True
        return max(self.max_cache_len - tokens, 1), False


def _grown(buffer: torch.Tensor | None, used: int, needed: int, shape_tail: tuple, dtype, device, batch, heads):
    """`buffer` with room for `needed` tokens along dim 2 (reallocated and copied when too small)."""
    if buffer is not None and buffer.shape[2] >= needed:
        return buffer
    capacity = needed if buffer is None else max(needed, buffer.shape[2] + buffer.shape[2] // 8, 64)
    capacity += capacity % 2  # even: each KV head's compact pairs start on a 4-byte word, which the CUDA kernel reads
    fresh = torch.empty((batch, heads, capacity, *shape_tail), dtype=dtype, device=device)
    if buffer is not None and used:
        fresh[:, :, :used] = buffer[:, :, :used]
    return fresh


class _History:
    """Shared bookkeeping: buffers by name, their length, batch operations."""

    _names: tuple[str, ...] = ()
    bits = 2  # the code width `HistoryTensors` records (unquantized histories have none)

    def __init__(self, batch: int, num_heads: int, device: torch.device):
        self.batch, self.num_heads, self.device = batch, num_heads, device
        self.length = 0
        self.device_length: torch.Tensor | None = None  # set by `pin`
        self._staging: dict[int, dict[str, torch.Tensor]] = {}
        for name in self._names:
            setattr(self, name, None)

    @property
    def capacity(self) -> int:
        buffer = getattr(self, self._names[0])
        return buffer.shape[2] if buffer is not None else 0

    def pin(self, capacity: int, stored: int | None = None) -> None:
        """Allocate room for `capacity` tokens now and track the length on the device from here on. `stored`: the
        tokens stored so far, where the host's count trails them (counted decode counts on the device); kept."""
        if stored is not None:
            self.length = stored
        self._reserve(max(capacity - self.length, 0))
        if self.device_length is None:
            self.device_length = torch.tensor([self.length], dtype=torch.int32, device=self.device)

    def _targets(self, n: int, reserve: bool = True) -> dict[str, torch.Tensor]:
        """Where an append of `n` tokens writes: the buffers' next rows, or a staging block once pinned
        (`reserve=False`: counted decode, whose buffers are sized ahead and whose host length is stale; reading it
        would also make a compiled step depend on it)."""
        if reserve:
            self._reserve(n)
            if self.device_length is None:
                return {name: getattr(self, name)[:, :, self.length : self.length + n] for name in self._names}
        if torch.compiler.is_compiling():
            # a compiled step's block is a buffer of its own graph (a CUDA graph keeps it in its pool), not a graph
            # input: inputs cost a guard each on every call, and a model has layers times four of these
            return self._new_staging(n)
        staging = self._staging.get(n)
        if staging is None or staging[self._names[0]].shape[0] != self.batch:
            staging = self._staging[n] = self._new_staging(n)
        return staging

    def _new_staging(self, n: int) -> dict[str, torch.Tensor]:
        staging = {name: torch.empty((self.batch, self.num_heads, n, *tail), dtype=dtype, device=self.device)
                   for name, (tail, dtype) in self._layout().items()}
        staging["_offsets"] = torch.arange(n, device=self.device)
        return staging

    def _commit(self, n: int, targets: dict[str, torch.Tensor], advance: torch.Tensor | None = None,
                after: torch.Tensor | None = None, at: torch.Tensor | None = None) -> torch.Tensor | None:
        """Make the `n` rows written into `targets` part of the history. Counted decode passes `advance` (int32
        `[1]`: 0 or n, decided on the device) and `at` (its history count, int32 `[1]`): the rows are written after
        `at` and the caller's counts advance; returns the tokens a full history had no room for (int32 `[1]`), see
        `kernels.ops.write_rows` (`after`: a tensor the write must wait for)."""
        if advance is not None and not torch.compiler.is_compiling():
            return write_rows_eagerly([getattr(self, name) for name in self._names],
                                      [targets[name] for name in self._names], at, advance)
        if advance is not None:
            return torch.ops.oscar_hf.write_rows([getattr(self, name) for name in self._names],
                                                 [targets[name] for name in self._names], at, advance,
                                                 after if after is not None else advance)
        if self.device_length is not None:
            rows = targets["_offsets"] + self.device_length
            for name in self._names:
                getattr(self, name).index_copy_(2, rows, targets[name])
            self.device_length += n
        self.length += n

    def prepare_staging(self, n: int) -> None:
        """Allocate the staging block of `n`-row appends now (a compiled step must not allocate it)."""
        self._targets(n)

    def kernel_buffers(self) -> tuple:
        """(keys, values, key scale-zero, value scale-zero) as `HistoryTensors` takes them, whatever the length."""
        raise NotImplementedError

    def counted_view(self, length_ptr: torch.Tensor) -> HistoryTensors:
        """The whole buffers as a counted decode step reads them: the length on the device (int32 `[1]`)."""
        return HistoryTensors(*self.kernel_buffers(), self.capacity, self.bits, length_ptr)

    def buffers(self) -> list[torch.Tensor]:
        """Every stored buffer (what an in-place batch reorder rewrites)."""
        return [getattr(self, name) for name in self._names]

    def set_length(self, stored: int) -> None:
        """Set the host's count and its device copy to `stored` (back from counted decode, which counted on the
        device; host-counted appends write at the device copy)."""
        self.length = stored
        self.device_length.fill_(stored)

    def static_tensors(self) -> list[torch.Tensor]:
        """The buffers and staging blocks a compiled step reads and writes in place."""
        staged = [t for block in self._staging.values() for t in block.values()]
        return [getattr(self, name) for name in self._names] + staged

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more tokens now (one allocation instead of a growth later)."""
        self._reserve(extra)

    def _reserve(self, extra: int) -> None:
        for name, (tail, dtype) in self._layout().items():
            setattr(self, name, _grown(getattr(self, name), self.length, self.length + extra, tail, dtype,
                                       self.device, self.batch, self.num_heads))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim operation (index_select, repeat_interleave, ...) to every buffer."""
        for name in self._names:
            buffer = getattr(self, name)
            if buffer is not None:
                setattr(self, name, fn(buffer[:, :, : self.length]).contiguous())
                self.batch = getattr(self, name).shape[0]

    def nbytes(self, length: int | None = None) -> int:
        """Bytes of the stored tokens (not of spare capacity): the first `length` (default: the host's count)."""
        return self.batch * self.num_heads * (self.length if length is None else length) * self.token_bytes()

    def token_bytes(self) -> int:
        """Bytes one token of one KV head stores, keys and values together."""
        raise NotImplementedError

    def kernel_view(self) -> HistoryTensors | None:
        """The buffers as the kernel backends read them; None while the history is empty."""
        raise NotImplementedError

    def dequantize(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 rotated keys and values of tokens [start, end): `[B, H, end - start, d]` (`end` is not checked
        against the host's count: in counted decode the device keeps it)."""
        return history_rows(HistoryTensors(*self.kernel_buffers(), end, self.bits), start, end)

    def allocated_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (getattr(self, n) for n in self._names) if b is not None)

    def _layout(self) -> dict:
        raise NotImplementedError


class QuantizedHistory(_History):
    _names = ("key_codes", "key_scale_zero", "value_codes", "value_scale_zero")

    def __init__(self, batch: int, num_heads: int, key_dim: int, value_dim: int, config: OscarConfig,
                 device: torch.device):
        self.key_dim, self.value_dim, self.config = key_dim, value_dim, config
        self.format = config.row_format
        super().__init__(batch, num_heads, device)

    @property
    def bits(self) -> int:
        return self.format.bits

    def _layout(self) -> dict:
        pairs = self.format.pair_dtype
        return {
            "key_codes": ((self.format.code_bytes(self.key_dim),), torch.uint8),
            "key_scale_zero": ((2,), pairs),
            "value_codes": ((self.format.code_bytes(self.value_dim),), torch.uint8),
            "value_scale_zero": ((2,), pairs),
        }

    def token_bytes(self) -> int:
        return self.format.row_bytes(self.key_dim) + self.format.row_bytes(self.value_dim)

    def kernel_buffers(self) -> tuple:
        return self.key_codes, self.value_codes, self.key_scale_zero, self.value_scale_zero

    def kernel_view(self) -> HistoryTensors | None:
        if not self.length:
            return None
        return HistoryTensors(self.key_codes, self.value_codes, self.key_scale_zero, self.value_scale_zero,
                              self.length, self.format.bits, self.device_length)

    def append(self, keys: torch.Tensor, values: torch.Tensor, key_rotation, value_rotation, backend,
               advance: torch.Tensor | None = None, after: torch.Tensor | None = None,
               at: torch.Tensor | None = None) -> torch.Tensor | None:
        """Rotate, clip, quantize and pack `keys`/`values` `[B, H, n, d]` (model basis) onto the end (`advance`,
        `at`, what it returns: see `_commit`)."""
        n = keys.shape[2]
        if n == 0:
            return None
        f = self.format
        stored_as = (key_rotation, value_rotation, f.key_clip_ratio, f.value_clip_ratio, f.bits, f.encoder)
        if advance is not None:
            # counted decode: one kernel quantizes the block straight into the buffers, only when it is demoted
            # (`advance` > 0, decided on the device)
            call = DemoteCall(keys, values, *stored_as, self.key_codes, self.key_scale_zero, self.value_codes,
                              self.value_scale_zero, only_if=advance)
            return backend.demote_kv_at(call, at, after)
        out = self._targets(n)
        backend.demote_kv(DemoteCall(keys, values, *stored_as, out["key_codes"], out["key_scale_zero"],
                                     out["value_codes"], out["value_scale_zero"]))
        return self._commit(n, out)

    def prepare_staging(self, n: int) -> None:
        """Nothing: counted decode's demotion writes straight into the buffers (`Backend.demote_kv_at`)."""


class FullPrecisionHistory(_History):
    _names = ("keys", "values")

    def __init__(self, batch: int, num_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.key_dim, self.value_dim, self.dtype = key_dim, value_dim, dtype
        super().__init__(batch, num_heads, device)

    def _layout(self) -> dict:
        return {"keys": ((self.key_dim,), self.dtype), "values": ((self.value_dim,), self.dtype)}

    def token_bytes(self) -> int:
        return (self.key_dim + self.value_dim) * self.dtype.itemsize

    def kernel_buffers(self) -> tuple:
        return self.keys, self.values, None, None

    def kernel_view(self) -> HistoryTensors | None:
        if not self.length:
            return None
        return HistoryTensors(self.keys, self.values, None, None, self.length, length_ptr=self.device_length)

    def append(self, keys: torch.Tensor, values: torch.Tensor, key_rotation, value_rotation, backend=None,
               advance: torch.Tensor | None = None, after: torch.Tensor | None = None,
               at: torch.Tensor | None = None) -> torch.Tensor | None:
        n = keys.shape[2]
        if n == 0:
            return None
        out = self._targets(n, reserve=advance is None)
        out["keys"].copy_(rotate(keys, key_rotation))
        out["values"].copy_(rotate(values, value_rotation))
        return self._commit(n, out, advance, after, at)


class HeadSplitHistory:
    """One layer's history as runs of adjacent KV heads, each a `QuantizedHistory` with its own settings: the heads
    `config.high_precision_heads` names at `config.high_precision()`, the others at `config`. Every run holds the
    same tokens; the operations of a history apply to each run, the keys, values and per-head rotations sliced to
    its heads."""

    def __init__(self, batch: int, num_heads: int, key_dim: int, value_dim: int, config: OscarConfig,
                 device: torch.device):
        high = config.high_precision()
        low = dataclasses.replace(config, high_precision_heads=())
        runs = head_runs(num_heads, (head for _, head in config.high_precision_heads))
        self.parts = [(start, stop, QuantizedHistory(batch, stop - start, key_dim, value_dim, high if is_high else low,
                                                     device)) for start, stop, is_high in runs]
        self.batch, self.num_heads, self.device, self.config = batch, num_heads, device, config
        self.key_dim, self.value_dim = key_dim, value_dim

    def _histories(self) -> list[QuantizedHistory]:
        return [history for _, _, history in self.parts]

    @property
    def length(self) -> int:
        return self.parts[0][2].length

    @length.setter
    def length(self, value: int) -> None:
        for history in self._histories():
            history.length = value

    @property
    def device_length(self) -> torch.Tensor | None:
        return self.parts[0][2].device_length

    @property
    def capacity(self) -> int:
        return self.parts[0][2].capacity

    def pin(self, capacity: int, stored: int | None = None) -> None:
        for history in self._histories():
            history.pin(capacity, stored)

    def set_length(self, stored: int) -> None:
        for history in self._histories():
            history.set_length(stored)

    def reserve(self, extra: int) -> None:
        for history in self._histories():
            history.reserve(extra)

    def prepare_staging(self, n: int) -> None:
        for history in self._histories():
            history.prepare_staging(n)

    def static_tensors(self) -> list[torch.Tensor]:
        return [t for history in self._histories() for t in history.static_tensors()]

    def buffers(self) -> list[torch.Tensor]:
        return [t for history in self._histories() for t in history.buffers()]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for history in self._histories():
            history.map_batch(fn)
        self.batch = self.parts[0][2].batch

    def nbytes(self, length: int | None = None) -> int:
        return sum(history.nbytes(length) for history in self._histories())

    def allocated_nbytes(self) -> int:
        return sum(history.allocated_nbytes() for history in self._histories())

    def append(self, keys: torch.Tensor, values: torch.Tensor, key_rotation, value_rotation, backend,
               advance: torch.Tensor | None = None, after: torch.Tensor | None = None,
               at: torch.Tensor | None = None) -> torch.Tensor | None:
        """`QuantizedHistory.append` run by run; every run drops the same tokens when full (one count).

        A counted step's demotions are ops whose writes are not declared (`kernels.ops.demote_into`), so each one
        lives in a compiled graph only through its output: every run's output goes into the one returned."""
        dropped = [history.append(keys[:, start:stop], values[:, start:stop], heads_of(key_rotation, start, stop),
                                  heads_of(value_rotation, start, stop), backend, advance, after, at)
                   for start, stop, history in self.parts]
        if dropped[0] is None:
            return None
        lost = dropped[0]
        for more in dropped[1:]:
            lost = torch.maximum(lost, more)
        return lost

    def kernel_view(self) -> HeadSplitTensors | None:
        if not self.length:
            return None
        return HeadSplitTensors(tuple(HeadRun(start, stop, history.kernel_view())
                                      for start, stop, history in self.parts))

    def counted_view(self, length_ptr: torch.Tensor) -> HeadSplitTensors:
        return HeadSplitTensors(tuple(HeadRun(start, stop, history.counted_view(length_ptr))
                                      for start, stop, history in self.parts))

    def dequantize(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 rotated keys and values of tokens [start, end): `[B, H, end - start, d]`, every head."""
        parts = [history.dequantize(start, end) for history in self._histories()]
        return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)


def splits_by_heads(config: OscarConfig) -> bool:
    """Whether a layer with settings `config` keeps its history split by KV heads (`HeadSplitHistory`)."""
    return config.quantize and bool(config.high_precision_heads)


def make_history(config: OscarConfig, batch: int, num_heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, device: torch.device) -> _History | HeadSplitHistory:
    """The history of one layer with settings `config` (`OscarConfig.for_layer`)."""
    if not config.quantize:
        return FullPrecisionHistory(batch, num_heads, key_dim, value_dim, dtype, device)
    if splits_by_heads(config):
        return HeadSplitHistory(batch, num_heads, key_dim, value_dim, config, device)
    return QuantizedHistory(batch, num_heads, key_dim, value_dim, config, device)
