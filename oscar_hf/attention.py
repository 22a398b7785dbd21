"""The "oscar" attention implementation registered with transformers.

With an `OscarCache` the key/value it receives are the BF16 tiers (sink + recent + this forward's tokens), and
a `HistorySegment` describes the quantized history between them. The BF16 tiers and the history are attended
separately, each giving (output, log-sum-exp), and merged exactly in float32; the history is never materialized
as a dense BF16 tensor. Without a segment (any other cache, or no history yet) it is transformers' SDPA path.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .compat import take_segment
from .partials import causal_mask, dense_partial, split_mask  # noqa: F401  (causal_mask, split_mask: public here)

OSCAR_ATTENTION = "oscar"


def tiered_attention(query, key, value, attention_mask, segment, scaling, softcap=None,
                     dense_start=None) -> torch.Tensor:
    """Attention over BF16 tiers + quantized history; output `[B, Lq, Hq, D]` in the query dtype.

    Computed by the layer's backend (`oscar_hf.backend`): the reference composes partials, the Triton backend runs
    fused kernels.
    """
    layer = segment.layer
    history = layer.history if segment.history_length else None
    return layer.backend.tiered_attention(query, key, value, attention_mask, history, segment.sink_length,
                                          layer.key_rotation, layer.value_rotation, scaling, softcap, dense_start)


@torch.compiler.disable
def oscar_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry: `query` `[B, Hq, Lq, D]`, `key`/`value` `[B, Hkv, Lk, D]` -> (`[B, Lq, Hq, D]`, None)."""
    segment = take_segment(key, kwargs)
    softcap = kwargs.get("softcap")
    dense_start = None
    if segment is not None and segment.layer.decode_without_mask and query.shape[2] == 1:
        attention_mask = None  # see OscarLayer.decode_without_mask
        dense_start = segment.layer.row_padding
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if segment is None or (segment.history_length == 0 and softcap is None and dense_start is None):
        if softcap is None:
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, **kwargs)
        else:
            out = _softcapped_dense(query, key, value, attention_mask, scaling, softcap)
    else:
        if segment.layer_idx != getattr(module, "layer_idx", segment.layer_idx):
            raise RuntimeError(f"OSCAR segment of layer {segment.layer_idx} reached layer {module.layer_idx}")
        out = tiered_attention(query, key, value, attention_mask, segment, scaling, softcap, dense_start)
    if segment is not None:
        segment.layer.settle(attention_mask)
    return out, None


def _softcapped_dense(query, key, value, attention_mask, scaling, softcap):
    q_len = query.shape[2]
    if attention_mask is None and q_len > 1:
        attention_mask = causal_mask(q_len, key.shape[2], query.device)
    out, _ = dense_partial(query, key, value, attention_mask, scaling, softcap)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def register() -> None:
    """Register "oscar" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(OSCAR_ATTENTION, oscar_attention_forward)
    AttentionMaskInterface.register(OSCAR_ATTENTION, sdpa_mask)
