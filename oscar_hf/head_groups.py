"""Precision per KV head: one layer's history kept as runs of adjacent KV heads, each at its own code width, and
the attention over such a history, one call per run.

A query head of a GQA layer attends to its own KV head only, so a layer's attention splits exactly along its KV
heads: the run of KV heads `[start, stop)` takes query heads `[start * G, stop * G)`, its slice of the BF16 tiers
and of per-head rotations, and its own history; the runs' outputs, side by side along the heads, are the layer's
output. Each run is one ordinary call of the layer's backend, so every backend serves a split layer unchanged; a
run is a view of the tensors, never a copy. A decode step goes to a backend that `decodes_split_histories` (the
kernel backends) whole instead, so that the layer's query rotation, BF16 tiers and merge run once and only the
history's reads are per run (`kernels.interface.HeadSplitTensors`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from oscar_hf.kernels.interface import DecodeCall, HeadSplitTensors, decode_by_runs, heads_of
from oscar_hf.kernels.ops import OpBackend


def head_runs(num_heads: int, high: Iterable[int]) -> list[tuple[int, int, bool]]:
    """Maximal runs of adjacent KV heads of one precision: `(start, stop, high)`, in head order."""
    chosen = set(high)
    unknown = sorted(h for h in chosen if not 0 <= h < num_heads)
    if unknown:
        raise ValueError(f"high-precision KV heads {unknown} do not exist: the layer has {num_heads} KV heads")
    runs: list[tuple[int, int, bool]] = []
    for head in range(num_heads):
        if runs and runs[-1][2] == (head in chosen):
            runs[-1] = (runs[-1][0], head + 1, runs[-1][2])
        else:
            runs.append((head, head + 1, head in chosen))
    return runs


class HeadSplitBackend:
    """The attention of `inner` (a kernel backend, or `kernels.ops.OpBackend`) over a `HeadSplitTensors` history:
    one `inner` call per run of KV heads, except for decode calls that `inner` takes whole (module docstring).
    Other histories pass straight through."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def tiered_attention(self, query, key, value, mask, history, sink_length, key_rotation, value_rotation, scaling,
                         softcap=None, dense_start=None, history_start=None, sinks=None) -> torch.Tensor:
        if not isinstance(history, HeadSplitTensors):
            return self.inner.tiered_attention(query, key, value, mask, history, sink_length, key_rotation,
                                               value_rotation, scaling, softcap, dense_start, history_start, sinks)
        groups = query.shape[1] // key.shape[1]
        return torch.cat([
            self.inner.tiered_attention(query[:, r.start * groups : r.stop * groups], key[:, r.start : r.stop],
                                        value[:, r.start : r.stop], mask, r.history, sink_length,
                                        heads_of(key_rotation, r.start, r.stop),
                                        heads_of(value_rotation, r.start, r.stop), scaling, softcap, dense_start,
                                        history_start,
                                        None if sinks is None else sinks[r.start * groups : r.stop * groups])
            for r in history.runs], dim=2)

    def decode_attention(self, call: DecodeCall) -> torch.Tensor:
        return self._decode(self.inner.decode_attention, call)

    def eager_decode_attention(self, call: DecodeCall) -> torch.Tensor:
        return self._decode(self.inner.eager_decode_attention, call)

    def _decode(self, decode, call: DecodeCall) -> torch.Tensor:
        if not isinstance(call.history, HeadSplitTensors) or getattr(self.inner, "decodes_split_histories", False):
            return decode(call)
        return decode_by_runs(decode, call)


@dataclass(frozen=True)
class LayerBackends:
    """The backends one layer calls, built from its kernel backend (`layer_backends`): `plain` demotes on the host
    path, `op` demotes in a counted step (through the custom ops while `torch.compile` traces,
    `kernels.ops.OpBackend`), `attention` and `op_attention` attend (run by run over a history split by KV
    heads)."""

    plain: object
    op: OpBackend
    attention: object
    op_attention: object


def layer_backends(backend, split: bool) -> LayerBackends:
    """`LayerBackends` of kernel backend `backend` for a layer whose history is split by KV heads where `split`."""
    op = OpBackend(backend)
    if split:
        return LayerBackends(backend, op, HeadSplitBackend(backend), HeadSplitBackend(op))
    return LayerBackends(backend, op, backend, op)
