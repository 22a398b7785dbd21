"""The kernel interface as torch custom ops, so that `torch.compile` treats a decode step's kernels as opaque calls.

These operations cross the boundary (`torch.library.custom_op`, each with a fake implementation that only gives
shapes); each is declared once, with the PyTorch reference as its implementation for every device and, where a
kernel exists, the CUDA one registered for CUDA:
- `oscar_hf::decode_attention`: a `DecodeCall` (one layer's single-token attention over its device-counted BF16
  rows and history), its history given as runs of KV heads (one run for an ordinary history; several for a
  history split by code widths, `HeadSplitTensors`). Both counts are int32 `[1]` device tensors, so one compiled
  graph, or one captured CUDA graph, serves every step of a demotion cycle;
- `oscar_hf::demote_kv`: a `DemoteCall` (rotate, clip, quantize and pack rows into its output views, which it
  mutates), or nothing where its device flag `only_if` holds 0;
- `oscar_hf::demote_into`: the same straight into a quantized history's buffers at a device row (a counted decode
  step's demotion: one kernel, no staging block);
- `oscar_hf::write_rows`: rows into a full-precision history's buffers at a device row (the `none` method);
- `oscar_hf::gather_rows`: rows of a BF16 buffer moved within it (the window's shift after a demotion, the sink of
  a left-padded row taking real tokens), every source row read before any is written.

A call object is not an op argument: `_decode_arguments` / `_decode_call` (and `_demote_arguments` /
`DemoteCall`) are the one place that flattens a call into the op's schema and back. A backend is named by its spec
(`kernels.select.backend_spec`: its kind and settings as a string), which the op turns back into the shared
backend of those settings (`backend_from_spec`) on CUDA, and into the reference of the same history chunk
elsewhere (`reference_for`): a compiled graph holds a description, not an object, and no registry of backend
objects exists.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from oscar_hf.kernels.interface import (
    Backend,
    DecodeCall,
    DemoteCall,
    HeadRun,
    HeadSplitTensors,
    HistoryTensors,
    block_start,
)
from oscar_hf.kernels.select import backend_from_spec, backend_spec, reference_for

_reference = lru_cache(maxsize=None)(reference_for)  # a compiled step calls it every step: parse each spec once


# ---------------------------------------------------------------------------------------------- decode
def _decode_arguments(call: DecodeCall, spec: str) -> tuple:
    """`call` in `oscar_hf::decode_attention`'s schema (`_decode_call` reads it back)."""
    h = call.history
    runs = () if h is None else h.runs if isinstance(h, HeadSplitTensors) else (HeadRun(0, call.keys.shape[1], h),)
    return (call.query, call.keys, call.values, call.dense_length, call.dense_start, call.history_start,
            None if h is None else h.length_ptr, [b for r in runs for b in (r.start, r.stop)],
            [r.history.bits for r in runs], [r.history.keys for r in runs],
            [r.history.key_scale_zero for r in runs], [r.history.values for r in runs],
            [r.history.value_scale_zero for r in runs], call.key_rotation, call.value_rotation, float(call.scaling),
            None if call.softcap is None else float(call.softcap), call.sinks, spec)


def _decode_call(query, keys, values, dense_length, dense_start, history_start, history_length, run_bounds,
                 run_bits, history_keys, history_key_scale_zero, history_values, history_value_scale_zero,
                 key_rotation, value_rotation, scaling, softcap, sinks) -> DecodeCall:
    """The `DecodeCall` an op call's arguments flatten (`_decode_arguments`)."""
    runs = tuple(
        HeadRun(run_bounds[2 * i], run_bounds[2 * i + 1], HistoryTensors(k, v, kz, vz, k.shape[2], bits,
                                                                          history_length))
        for i, (k, kz, v, vz, bits) in enumerate(zip(history_keys, history_key_scale_zero, history_values,
                                                     history_value_scale_zero, run_bits)))
    whole = len(runs) == 1 and runs[0].start == 0 and runs[0].stop == keys.shape[1]
    history = None if not runs else runs[0].history if whole else HeadSplitTensors(runs)
    return DecodeCall(query, keys, values, dense_length, history, key_rotation, value_rotation, scaling, softcap,
                      dense_start, history_start, sinks)


@torch.library.custom_op("oscar_hf::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dense_length: torch.Tensor,
    dense_start: torch.Tensor | None, history_start: torch.Tensor | None, history_length: torch.Tensor | None,
    run_bounds: list[int], run_bits: list[int], history_keys: list[torch.Tensor],
    history_key_scale_zero: list[torch.Tensor | None], history_values: list[torch.Tensor],
    history_value_scale_zero: list[torch.Tensor | None], key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None, scaling: float, softcap: float | None, sinks: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """`[B, 1, Hq, D]` in the query dtype; run i holds KV heads `[run_bounds[2i], run_bounds[2i + 1])` (see the
    module docstring)."""
    return _reference(backend).decode_attention(_decode_call(*_call_fields(locals())))


@decode_attention.register_kernel("cuda")
def _decode_attention_cuda(query, keys, values, dense_length, dense_start, history_start, history_length,
                           run_bounds, run_bits, history_keys, history_key_scale_zero, history_values,
                           history_value_scale_zero, key_rotation, value_rotation, scaling, softcap, sinks, backend):
    return backend_from_spec(backend).decode_attention(_decode_call(*_call_fields(locals())))


@decode_attention.register_fake
def _(query, keys, values, dense_length, dense_start, history_start, history_length, run_bounds, run_bits,
      history_keys, history_key_scale_zero, history_values, history_value_scale_zero, key_rotation, value_rotation,
      scaling, softcap, sinks, backend):
    batch, heads, q_len, dim = query.shape
    return query.new_empty((batch, q_len, heads, dim))


# ---------------------------------------------------------------------------------------------- demotion
def _demote_arguments(call: DemoteCall, spec: str) -> tuple:
    """`call` in the demotion ops' schema, up to `only_if` (its fields in order: `DemoteCall(*fields)` reads it
    back)."""
    return (call.keys, call.values, call.key_rotation, call.value_rotation, call.key_clip_ratio,
            call.value_clip_ratio, call.bits, call.encoder, call.key_codes, call.key_scale_zero, call.value_codes,
            call.value_scale_zero, spec, call.only_if)


def _call_fields(arguments: dict) -> tuple:
    """An op's arguments without its backend spec and ordering inputs, in schema order (what `_decode_call` and
    `DemoteCall` take)."""
    return tuple(v for k, v in arguments.items() if k not in ("backend", "at", "after"))


@torch.library.custom_op("oscar_hf::demote_kv",
                         mutates_args=("key_codes", "key_scale_zero", "value_codes", "value_scale_zero"))
def demote_kv(
    keys: torch.Tensor, values: torch.Tensor, key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None,
    key_clip_ratio: float | None, value_clip_ratio: float | None, bits: int, encoder: str, key_codes: torch.Tensor,
    key_scale_zero: torch.Tensor, value_codes: torch.Tensor, value_scale_zero: torch.Tensor, backend: str,
    only_if: torch.Tensor | None = None,
) -> None:
    _reference(backend).demote_kv(DemoteCall(*_call_fields(locals())))


@demote_kv.register_kernel("cuda")
def _demote_kv_cuda(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits, encoder,
                    key_codes, key_scale_zero, value_codes, value_scale_zero, backend, only_if=None):
    backend_from_spec(backend).demote_kv(DemoteCall(*_call_fields(locals())))


@demote_kv.register_fake
def _(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits, encoder, key_codes,
      key_scale_zero, value_codes, value_scale_zero, backend, only_if=None):
    return None


@torch.library.custom_op("oscar_hf::demote_into", mutates_args=())
def demote_into(
    keys: torch.Tensor, values: torch.Tensor, key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None,
    key_clip_ratio: float | None, value_clip_ratio: float | None, bits: int, encoder: str, key_codes: torch.Tensor,
    key_scale_zero: torch.Tensor, value_codes: torch.Tensor, value_scale_zero: torch.Tensor, backend: str,
    only_if: torch.Tensor, at: torch.Tensor, after: torch.Tensor,
) -> torch.Tensor:
    """A counted decode step's demotion, written straight into the history buffers at the device row `at`
    (`Backend.demote_kv_at`); returns the tokens lost to a full history (int32 `[1]`).

    The buffers are written in place but not declared mutated, as in `write_rows` (whose docstring says why):
    `after` (the attention output that read them) orders the write after that read, and the rows written lie
    beyond the count until the caller advances it."""
    return _reference(backend).demote_kv_at(DemoteCall(*_call_fields(locals())), at)


@demote_into.register_kernel("cuda")
def _demote_into_cuda(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits, encoder,
                      key_codes, key_scale_zero, value_codes, value_scale_zero, backend, only_if, at, after):
    return backend_from_spec(backend).demote_kv_at(DemoteCall(*_call_fields(locals())), at)


@demote_into.register_fake
def _(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits, encoder, key_codes,
      key_scale_zero, value_codes, value_scale_zero, backend, only_if, at, after):
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
    graph holds them as opaque calls, naming the backend by its spec), and straight to `backend` otherwise: the ops
    run exactly that, and an eager op call costs tens of microseconds of dispatch on the host, per op, layer and
    step. A backend without a spec (not one of the package's) runs eagerly only."""

    def __init__(self, backend: Backend):
        self.inner = backend
        self.name = backend.name
        self.decodes_split_histories = getattr(backend, "decodes_split_histories", False)
        try:  # read now: json is not traced
            self.spec, self.no_spec = backend_spec(backend), None
        except TypeError as error:
            self.spec, self.no_spec = None, str(error)

    def _traced_spec(self) -> str:
        if self.spec is None:
            raise TypeError(self.no_spec)
        return self.spec

    def demote_kv(self, call: DemoteCall) -> None:
        if not torch.compiler.is_compiling():
            self.inner.demote_kv(call)
            return
        torch.ops.oscar_hf.demote_kv(*_demote_arguments(call, self._traced_spec()))

    def demote_kv_at(self, call: DemoteCall, at: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.inner.demote_kv_at(call, at)
        return torch.ops.oscar_hf.demote_into(*_demote_arguments(call, self._traced_spec()), at,
                                              after if after is not None else call.only_if)

    def decode_attention(self, call: DecodeCall) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.inner.eager_decode_attention(call)
        return torch.ops.oscar_hf.decode_attention(*_decode_arguments(call, self._traced_spec()))
