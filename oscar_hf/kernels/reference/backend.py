"""`ReferenceBackend`: the backend operations (`kernels.interface`) in plain PyTorch; defines the semantics, runs
anywhere."""

from __future__ import annotations

from dataclasses import replace

import torch

from oscar_hf.kernels.interface import DecodeCall, DemoteCall, HeadSplitTensors, block_start, decode_by_runs
from oscar_hf.kernels.reference.attention import dense_partial, history_partial, merge_partials, tiered_reference
from oscar_hf.kernels.reference.quantize import quantize_pack
from oscar_hf.rotations.math import rotate


def refuse_capture(x: torch.Tensor, operation: str) -> None:
    """Raise a clear error where a CUDA graph is being captured around a reference operation that reads device
    counts on the host (the capture would fail deep inside CUDA, or record a read of the wrong step)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"a CUDA graph is being captured around an OSCAR {operation} that runs on the PyTorch reference (head "
            f"size {x.shape[-1]}, {x.dtype}; the GPU kernels take head sizes that are powers of two from 64 to 256, "
            "the same for keys and values, and the 'minmax' encoder), which reads the decode counts on the host. "
            "Compile without mode='reduce-overhead', or decode eagerly; generate's own compile skips such caches.")


class ReferenceBackend:
    """PyTorch reference of every backend operation, plus the partial ops `tiered_attention` composes.

    Args:
        history_chunk: history tokens dequantized at a time by `history_attention` (bounds its memory).
    """

    name = "reference"
    decodes_split_histories = True  # run by run (`kernels.interface.decode_by_runs`), so that a compiled step
    # holds one op per layer for them too

    def __init__(self, history_chunk: int = 4096):
        self.history_chunk = history_chunk

    def demote(self, x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder="minmax") -> None:
        """Rotate, clip, quantize and pack rows `x` `[B, H, n, d]` into `codes_out` / `scale_zero_out`."""
        packed, scale_zero = quantize_pack(rotate(x, rotation), bits, clip_ratio, scale_zero_out.dtype, encoder)
        codes_out.copy_(packed)
        scale_zero_out.copy_(scale_zero)

    def demote_kv(self, call: DemoteCall) -> None:
        if call.only_if is not None:
            refuse_capture(call.keys, "decode step's demotion")
        if call.only_if is not None and not bool(call.only_if):  # read on the host: never graph-captured
            return
        self.demote(call.keys, call.key_rotation, call.key_clip_ratio, call.bits, call.key_codes, call.key_scale_zero,
                    call.encoder)
        self.demote(call.values, call.value_rotation, call.value_clip_ratio, call.bits, call.value_codes,
                    call.value_scale_zero, call.encoder)

    def demote_kv_at(self, call: DemoteCall, at: torch.Tensor) -> torch.Tensor:
        """`demote_kv` of `n` rows straight into whole history buffers `[B, H, capacity, ...]`, at rows
        `[at, at + n)` (`at`: int32 `[1]` on the device), where `call.only_if` (int32 `[1]`: 0 or n) is not 0. The
        buffers' last n rows are never counted: a block that would reach them is written there instead and lost.
        Returns the tokens lost (int32 `[1]`): `only_if` for such a block, else 0."""
        refuse_capture(call.keys, "decode step's demotion")
        n = call.keys.shape[2]
        start, lost = block_start(at, n, call.key_codes.shape[2], call.only_if)
        if bool(call.only_if):  # read on the host: the reference is never graph-captured
            self.demote_kv(replace(call.at_rows(slice(int(start), int(start) + n)), only_if=None))
        return lost

    def dense_attention(self, query, key, value, mask, scaling, softcap=None):
        """The BF16 tiers' partial `(out, lse)` (`reference.attention.dense_partial`)."""
        return dense_partial(query, key, value, mask, scaling, softcap)

    def history_attention(self, query, history, key_rotation, value_rotation, mask, scaling, softcap=None):
        """The history's partial `(out, lse)` in the model basis; `history` a `HistoryTensors`."""
        return history_partial(query, history, key_rotation, value_rotation, mask, scaling, softcap,
                               chunk=self.history_chunk)

    def merge(self, parts):
        return merge_partials(parts)

    def tiered_attention(self, query, key, value, mask, history, sink_length, key_rotation, value_rotation, scaling,
                         softcap=None, dense_start=None, history_start=None, sinks=None):
        return tiered_reference(self, query, key, value, mask, history, sink_length, key_rotation, value_rotation,
                                scaling, softcap, dense_start, history_start, sinks)

    def decode_attention(self, call: DecodeCall) -> torch.Tensor:
        """One query per row over the first `dense_length` BF16 rows (row b from `dense_start[b]`) and the first
        `history.length_ptr` history rows (row b from `history_start[b]`; `kernels.interface`); reads the lengths
        on the host. A split history (`HeadSplitTensors`) is read run by run."""
        if isinstance(call.history, HeadSplitTensors):  # each run's call refuses a capture it cannot serve
            return decode_by_runs(self.decode_attention, call)
        refuse_capture(call.query, "decode step's attention")
        dense = int(call.dense_length)
        history = call.history
        if history is not None:
            length = int(history.length_ptr)
            history = replace(history, length=length, length_ptr=None) if length else None
        return tiered_reference(self, call.query, call.keys[:, :, :dense], call.values[:, :, :dense], None, history,
                                0, call.key_rotation, call.value_rotation, call.scaling, call.softcap,
                                call.dense_start, call.history_start, call.sinks)

    def eager_decode_attention(self, call: DecodeCall) -> torch.Tensor:
        """`decode_attention` as an eager step calls it (the reference has nothing to replay)."""
        return self.decode_attention(call)

    def rehearse(self, name: str, args: tuple, device: torch.device, calls) -> None:
        """Compile the kernels `calls()` would launch (`kernels.triton.precompile.ParallelCompile.rehearse`): the
        reference has none, and runs nothing."""

    def settings(self) -> dict:
        """The constructor's arguments, as data (`kernels.select.backend_spec`)."""
        return {"history_chunk": self.history_chunk}

    def graph_capture_problem(self, key_dim: int, value_dim: int, encoder: str,
                              scale_dtype: torch.dtype = torch.float16) -> str | None:
        return "the PyTorch reference backend runs no kernels to capture (the kernels run on CUDA devices)"
