"""The kernel interface as torch custom ops, so that `torch.compile` treats a decode step's kernels as opaque calls.

These operations cross the boundary (`torch.library.custom_op`, each with a fake implementation that only gives
shapes):
- `oscar_hf::decode_attention`: one layer's single-token attention over its BF16 rows (the first `dense_length`
  of `keys`/`values`, minus each row's `dense_start` leading pads) and its history (the first `history_length`
  rows, minus each row's `history_start` leading pads). Both lengths are int32 `[1]` device tensors, so one
  compiled graph, or one captured CUDA graph, serves every step of a demotion cycle;
- `oscar_hf::split_decode_attention`: the same over a history kept as runs of KV heads of different code widths
  (`kernels.interface.HeadSplitTensors`), each run's buffers in lists, for a backend that takes such a history
  whole (`decodes_split_histories`);
- `oscar_hf::demote_kv`: rotate, clip, quantize and pack rows into given output tensors (it mutates them), or
  nothing where the device flag `only_if` holds 0;
- `oscar_hf::demote_into`: the same, straight into a quantized history's buffers at a device row (a counted
  decode step's demotion: one kernel, no staging block);
- `oscar_hf::write_rows`: rows into a full-precision history's buffers at a device row (the `none` method);
- `oscar_hf::gather_rows`: rows of a BF16 buffer moved within it (the window's shift after a demotion, the sink of
  a left-padded row taking real tokens), every source row read before any is written.

A backend instance is not a tensor, so an op names it by a string: `register_backend` gives each backend a key
while it lives, and the op looks it up (`OpBackend` wraps a backend so that callers use the ops the way they use the
backend). The lookup holds backends weakly, so a freed cache's backend leaves it, and keys are issued by a counter,
so a key never names another backend than the one it was given for. One backend keeps one key: a compiled graph,
which holds the key as a constant, then serves every cache of that backend (`kernels.select` shares one per device).
"""

from __future__ import annotations

import copy
import itertools
import weakref

import torch

from oscar_hf.kernels.interface import Backend, HeadRun, HeadSplitTensors, HistoryTensors, block_start

_BACKENDS: weakref.WeakValueDictionary[str, Backend] = weakref.WeakValueDictionary()
_KEY_NUMBERS = itertools.count(1)


def register_backend(backend: Backend) -> str:
    """The key the ops name `backend` by: the one it was given while it lives, else a new one. The lookup does
    not keep `backend` alive; its holder (an `OpBackend`) does."""
    for key, known in _BACKENDS.items():
        if known is backend:
            return key
    key = f"{backend.name}:{next(_KEY_NUMBERS)}"
    _BACKENDS[key] = backend
    return key


def _backend(key: str) -> Backend:
    backend = _BACKENDS.get(key)
    if backend is None:
        raise RuntimeError(f"no kernel backend under {key!r}: its cache was freed (register_backend)")
    return backend


@torch.library.custom_op("oscar_hf::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dense_length: torch.Tensor,
    dense_start: torch.Tensor | None, history_keys: torch.Tensor | None, history_key_scale_zero: torch.Tensor | None,
    history_values: torch.Tensor | None, history_value_scale_zero: torch.Tensor | None,
    history_length: torch.Tensor | None, bits: int, key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None, scaling: float, softcap: float | None, backend: str,
    history_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, 1, Hq, D]` in the query dtype (see the module docstring)."""
    history = None
    if history_keys is not None:
        history = HistoryTensors(history_keys, history_values, history_key_scale_zero, history_value_scale_zero,
                                 history_keys.shape[2], bits, history_length)
    return _backend(backend).decode_attention(query, keys, values, dense_length, dense_start, history, key_rotation,
                                              value_rotation, scaling, softcap, history_start)


@decode_attention.register_fake
def _(query, keys, values, dense_length, dense_start, history_keys, history_key_scale_zero, history_values,
      history_value_scale_zero, history_length, bits, key_rotation, value_rotation, scaling, softcap, backend,
      history_start=None):
    batch, heads, q_len, dim = query.shape
    return query.new_empty((batch, q_len, heads, dim))


@torch.library.custom_op("oscar_hf::split_decode_attention", mutates_args=())
def split_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dense_length: torch.Tensor,
    dense_start: torch.Tensor | None, run_bounds: list[int], history_keys: list[torch.Tensor],
    history_key_scale_zero: list[torch.Tensor], history_values: list[torch.Tensor],
    history_value_scale_zero: list[torch.Tensor], history_length: torch.Tensor, bits: list[int],
    key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None, scaling: float, softcap: float | None,
    backend: str, history_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, 1, Hq, D]` in the query dtype; run i holds KV heads `[run_bounds[2i], run_bounds[2i + 1])`."""
    runs = tuple(
        HeadRun(run_bounds[2 * i], run_bounds[2 * i + 1],
                HistoryTensors(k, v, kz, vz, k.shape[2], width, history_length))
        for i, (k, kz, v, vz, width) in enumerate(zip(history_keys, history_key_scale_zero, history_values,
                                                      history_value_scale_zero, bits)))
    return _backend(backend).decode_attention(query, keys, values, dense_length, dense_start, HeadSplitTensors(runs),
                                              key_rotation, value_rotation, scaling, softcap, history_start)


@split_decode_attention.register_fake
def _(query, keys, values, dense_length, dense_start, run_bounds, history_keys, history_key_scale_zero,
      history_values, history_value_scale_zero, history_length, bits, key_rotation, value_rotation, scaling, softcap,
      backend, history_start=None):
    batch, heads, q_len, dim = query.shape
    return query.new_empty((batch, q_len, heads, dim))


@torch.library.custom_op("oscar_hf::demote_kv",
                         mutates_args=("key_codes", "key_scale_zero", "value_codes", "value_scale_zero"))
def demote_kv(
    keys: torch.Tensor, values: torch.Tensor, key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None,
    key_clip_ratio: float | None, value_clip_ratio: float | None, bits: int, key_codes: torch.Tensor,
    key_scale_zero: torch.Tensor, value_codes: torch.Tensor, value_scale_zero: torch.Tensor, encoder: str,
    backend: str, only_if: torch.Tensor | None = None,
) -> None:
    _backend(backend).demote_kv(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits,
                                key_codes, key_scale_zero, value_codes, value_scale_zero, encoder, only_if)


@demote_kv.register_fake
def _(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits, key_codes, key_scale_zero,
      value_codes, value_scale_zero, encoder, backend, only_if=None):
    return None


@torch.library.custom_op("oscar_hf::demote_into", mutates_args=())
def demote_into(
    keys: torch.Tensor, values: torch.Tensor, key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None,
    key_clip_ratio: float | None, value_clip_ratio: float | None, bits: int, key_codes: torch.Tensor,
    key_scale_zero: torch.Tensor, value_codes: torch.Tensor, value_scale_zero: torch.Tensor, encoder: str,
    backend: str, only_if: torch.Tensor, at: torch.Tensor, after: torch.Tensor,
) -> torch.Tensor:
    """A counted decode step's demotion, written straight into the history buffers at the device row `at`
    (`Backend.demote_kv_at`); returns the tokens lost to a full history (int32 `[1]`).

    The buffers are written in place but not declared mutated, as in `write_rows` (whose docstring says why):
    `after` (the attention output that read them) orders the write after that read, and the rows written lie
    beyond the count until the caller advances it."""
    return _backend(backend).demote_kv_at(keys, values, key_rotation, value_rotation, key_clip_ratio,
                                          value_clip_ratio, bits, key_codes, key_scale_zero, value_codes,
                                          value_scale_zero, encoder, only_if, at)


@demote_into.register_fake
def _(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits, key_codes, key_scale_zero,
      value_codes, value_scale_zero, encoder, backend, only_if, at, after):
    return torch.empty_like(only_if)


@torch.library.custom_op("oscar_hf::write_rows", mutates_args=())
def write_rows(buffers: list[torch.Tensor], rows: list[torch.Tensor], length: torch.Tensor, advance: torch.Tensor,
               after: torch.Tensor) -> torch.Tensor:
    """Write `rows[i]` `[B, H, n, ...]` into `buffers[i]` at rows `[length, length + n)` (`length`: int32 `[1]`),
    where they count once the caller adds `advance` (int32 `[1]`, 0 or n) to its count. The last n rows of a
    buffer are never counted: a block that would reach them is written there instead and lost, so a full history
    keeps its rows and nothing is written out of bounds. Returns the tokens lost (int32 `[1]`): `advance` for such
    a block, else 0 (the host warns when it next reads the counts).

    The buffers are written in place but not declared mutated: inductor clones a declared-mutated graph input it
    cannot prove free (here: a whole history, twice per layer and step). What the declaration would guarantee is
    kept by hand: `after` (the attention output that read the buffers) orders the write after that read, and the
    rows written lie beyond the count until the caller advances it, so no other op of the step reads them."""
    return write_rows_eagerly(buffers, rows, length, advance)


def write_rows_eagerly(buffers: list[torch.Tensor], rows: list[torch.Tensor], length: torch.Tensor,
                       advance: torch.Tensor) -> torch.Tensor:
    """`write_rows` without the op's dispatch (what it runs; eager callers save the dispatcher's host time)."""
    n = rows[0].shape[2]
    start, lost = block_start(length, n, buffers[0].shape[2], advance)
    positions = torch.arange(n, device=length.device) + start
    for buffer, block in zip(buffers, rows):
        buffer.index_copy_(2, positions, block)
    return lost


@write_rows.register_fake
def _(buffers, rows, length, advance, after):
    return torch.empty_like(advance)


@torch.library.custom_op("oscar_hf::gather_rows", mutates_args=("buffers",))
def gather_rows(buffers: list[torch.Tensor], index: torch.Tensor, start: int,
                after: torch.Tensor | None = None) -> None:
    """`buffer[:, :, start + j] = buffer[b, :, index[b, j]]` for each buffer `[B, H, rows, d]` and index (long
    `[B, n]`, or `[1, n]` for every row alike) with `index[b, j] >= start + j` (rows move down), every source row
    read before any row is written. The reference runs on any device; CUDA runs `triton.move_rows`.

    An op, declared as mutating, because the same move written as tensor code (`buffer[..., window] =
    buffer.index_select(...)`) reads and writes one graph input, and inductor fuses the two into one kernel that
    reads rows other threads (CPU) or programs (GPU) have already overwritten: compiled steps stored wrong rows
    (on the CPU with 8 threads, every layer but the first, a block per demotion). `after`: a tensor computed by the
    last reader of the rows being overwritten (a counted step's attention, through its history write); without it
    the graph may order that reader after this op, and inductor then copies the whole buffer to keep the old rows
    for it."""
    _gather_rows_reference(buffers, index, start)


def _gather_rows_reference(buffers: list[torch.Tensor], index: torch.Tensor, start: int) -> None:
    n = index.shape[1]
    for buffer in buffers:
        batch, heads, _, dim = buffer.shape
        source = buffer.gather(2, index[:, None, :, None].expand(batch, heads, n, dim))  # a copy: read all first
        buffer[:, :, start : start + n].copy_(source)


@gather_rows.register_kernel("cuda")
def _gather_rows_cuda(buffers, index, start, after=None):
    from oscar_hf.kernels.triton.move_rows import move_rows as triton_move_rows

    triton_move_rows(buffers, index, start)


@gather_rows.register_fake
def _(buffers, index, start, after=None):
    return None


def move_rows(buffers: list[torch.Tensor], index: torch.Tensor, start: int, after: torch.Tensor | None = None) -> None:
    """`gather_rows` through the op while `torch.compile` traces; straight to the device's implementation
    otherwise (an eager op call costs tens of microseconds of dispatch on the host)."""
    if torch.compiler.is_compiling():
        torch.ops.oscar_hf.gather_rows(buffers, index, start, after)
    elif buffers[0].is_cuda:
        _gather_rows_cuda(buffers, index, start)
    else:
        _gather_rows_reference(buffers, index, start)


class OpBackend:
    """`backend`'s demotion and decode attention through the custom ops while `torch.compile` traces (so that the
    graph holds them as opaque calls), and straight to `backend` otherwise: the ops run exactly that, and an eager
    op call costs tens of microseconds of dispatch on the host, per op, layer and step."""

    def __init__(self, backend: Backend):
        self.inner = backend
        self.name = backend.name
        self.key = register_backend(backend)
        self.decodes_split_histories = getattr(backend, "decodes_split_histories", False)

    def __deepcopy__(self, memo):
        # a copied backend is a backend of its own, with its own key; a shared one (in `memo`) keeps its key
        return OpBackend(copy.deepcopy(self.inner, memo))

    def demote_kv(self, keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits,
                  key_codes_out, key_scale_zero_out, value_codes_out, value_scale_zero_out, encoder="minmax",
                  only_if=None) -> None:
        if not torch.compiler.is_compiling():
            self.inner.demote_kv(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits,
                                 key_codes_out, key_scale_zero_out, value_codes_out, value_scale_zero_out, encoder,
                                 only_if)
            return
        torch.ops.oscar_hf.demote_kv(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits,
                                     key_codes_out, key_scale_zero_out, value_codes_out, value_scale_zero_out,
                                     encoder, self.key, only_if)

    def demote_kv_at(self, keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits,
                     key_codes, key_scale_zero, value_codes, value_scale_zero, encoder, only_if, at,
                     after=None) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.inner.demote_kv_at(keys, values, key_rotation, value_rotation, key_clip_ratio,
                                           value_clip_ratio, bits, key_codes, key_scale_zero, value_codes,
                                           value_scale_zero, encoder, only_if, at)
        return torch.ops.oscar_hf.demote_into(keys, values, key_rotation, value_rotation, key_clip_ratio,
                                              value_clip_ratio, bits, key_codes, key_scale_zero, value_codes,
                                              value_scale_zero, encoder, self.key, only_if, at,
                                              after if after is not None else only_if)

    def decode_attention(self, query, keys, values, dense_length, dense_start, history: HistoryTensors | None,
                         key_rotation, value_rotation, scaling, softcap=None, history_start=None) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.inner.eager_decode_attention(query, keys, values, dense_length, dense_start, history,
                                                     key_rotation, value_rotation, scaling, softcap, history_start)
        h = history
        if isinstance(h, HeadSplitTensors):
            return torch.ops.oscar_hf.split_decode_attention(
                query, keys, values, dense_length, dense_start, [b for r in h.runs for b in (r.start, r.stop)],
                [r.history.keys for r in h.runs], [r.history.key_scale_zero for r in h.runs],
                [r.history.values for r in h.runs], [r.history.value_scale_zero for r in h.runs], h.length_ptr,
                [r.history.bits for r in h.runs], key_rotation, value_rotation, float(scaling),
                None if softcap is None else float(softcap), self.key, history_start,
            )
        return torch.ops.oscar_hf.decode_attention(
            query, keys, values, dense_length, dense_start,
            None if h is None else h.keys, None if h is None else h.key_scale_zero,
            None if h is None else h.values, None if h is None else h.value_scale_zero,
            None if h is None else h.length_ptr, 2 if h is None else h.bits, key_rotation, value_rotation,
            float(scaling), None if softcap is None else float(softcap), self.key, history_start,
        )
