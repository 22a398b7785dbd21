"""The one dispatch point between the PyTorch reference and the Triton kernels.

A backend implements these operations; `backend_for(device)` picks one per device, once:
- `demote(x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder="minmax")`: rotate, clip, quantize
  and pack rows `x` `[B, H, n, d]` into the given output views (`encoder`: `OscarConfig.encoder`);
- `demote_kv(keys, values, ...)`: `demote` for a layer's keys and values together (one kernel launch);
- `dense_attention(query, key, value, mask, scaling, softcap) -> (out, lse)`: the BF16 tiers' partial;
- `history_attention(query, history, key_rotation, value_rotation, mask, scaling, softcap) -> (out, lse)`: the
  quantized tier's partial, in the model basis;
- `merge(parts) -> (out, lse)`;
- `tiered_attention(query, key, value, mask, history, sink_length, key_rotation, value_rotation, scaling,
  softcap, dense_start) -> out [B, Lq, Hq, D]`: one layer's whole attention (what `attention.py` calls);
  `dense_start` (int32 `[B]` or None): leading dense keys of each row to ignore (left padding). The reference composes
  the partial ops above (`partials.tiered_reference`); the Triton backend fuses them.
"""

from __future__ import annotations

import os

import torch

from .partials import dense_partial, history_partial, merge_partials, tiered_reference
from .quantize import quantize_pack
from .rotation import rotate


class ReferenceBackend:
    """PyTorch reference: defines the semantics; runs anywhere."""

    name = "reference"

    def __init__(self, history_chunk: int = 4096):
        self.history_chunk = history_chunk

    def demote(self, x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder="minmax") -> None:
        packed, scale_zero = quantize_pack(rotate(x, rotation), bits, clip_ratio, scale_zero_out.dtype, encoder)
        codes_out.copy_(packed)
        scale_zero_out.copy_(scale_zero)

    def demote_kv(self, keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits,
                  key_codes_out, key_scale_zero_out, value_codes_out, value_scale_zero_out, encoder="minmax") -> None:
        self.demote(keys, key_rotation, key_clip_ratio, bits, key_codes_out, key_scale_zero_out, encoder)
        self.demote(values, value_rotation, value_clip_ratio, bits, value_codes_out, value_scale_zero_out, encoder)

    def dense_attention(self, query, key, value, mask, scaling, softcap=None):
        return dense_partial(query, key, value, mask, scaling, softcap)

    def history_attention(self, query, history, key_rotation, value_rotation, mask, scaling, softcap=None):
        return history_partial(query, history, key_rotation, value_rotation, mask, scaling, softcap,
                               chunk=self.history_chunk)

    def merge(self, parts):
        return merge_partials(parts)

    def tiered_attention(self, query, key, value, mask, history, sink_length, key_rotation, value_rotation, scaling,
                         softcap=None, dense_start=None):
        return tiered_reference(self, query, key, value, mask, history, sink_length, key_rotation, value_rotation,
                                scaling, softcap, dense_start)


_BACKENDS: dict[str, object] = {}


def backend_for(device: torch.device, history_chunk: int = 4096):
    """The backend for tensors on `device`: Triton kernels on CUDA when available, else the reference.

    `OSCAR_HF_BACKEND=reference` forces the reference everywhere.
    """
    forced = os.environ.get("OSCAR_HF_BACKEND", "").lower()
    use_kernels = device.type == "cuda" and forced != "reference" and _kernels_available()
    key = f"{'triton' if use_kernels else 'reference'}:{history_chunk}"
    if key not in _BACKENDS:
        if use_kernels:
            from .kernels.backend import TritonBackend

            _BACKENDS[key] = TritonBackend(history_chunk=history_chunk)
        else:
            _BACKENDS[key] = ReferenceBackend(history_chunk=history_chunk)
    return _BACKENDS[key]


def _kernels_available() -> bool:
    try:
        from .kernels import backend  # noqa: F401
    except ImportError:
        return False
    return True
