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
from .partials import dense_partial

OSCAR_ATTENTION = "oscar"


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """bool `[1, 1, q_len, kv_len]`, queries aligned to the last `q_len` key positions."""
    rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]


def split_mask(mask: torch.Tensor | None, sink: int, history: int):
    """(mask of the BF16 columns, mask of the history columns) from a mask over all `kv_len` columns."""
    if mask is None:
        return None, None
    dense = torch.cat([mask[..., :sink], mask[..., sink + history :]], dim=-1)
    return dense, mask[..., sink : sink + history]


def tiered_attention(query, key, value, attention_mask, segment, scaling, softcap=None) -> torch.Tensor:
    """Attention over BF16 tiers + quantized history; output `[B, Lq, Hq, D]` in the query dtype."""
    layer, sink, history = segment.layer, segment.sink_length, segment.history_length
    q_len = query.shape[2]
    if attention_mask is None and q_len > 1:
        attention_mask = causal_mask(q_len, history + key.shape[2], query.device)
    dense_mask, history_mask = split_mask(attention_mask, sink, history)
    backend = layer.backend
    parts = [backend.dense_attention(query, key, value, dense_mask, scaling, softcap)]
    if history:
        parts.append(backend.history_attention(query, layer.history, layer.key_rotation, layer.value_rotation,
                                               history_mask, scaling, softcap))
    out, _ = backend.merge(parts)
    return out.to(query.dtype).transpose(1, 2).contiguous()


@torch.compiler.disable
def oscar_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry: `query` `[B, Hq, Lq, D]`, `key`/`value` `[B, Hkv, Lk, D]` -> (`[B, Lq, Hq, D]`, None)."""
    segment = take_segment(key, kwargs)
    softcap = kwargs.get("softcap")
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if segment is None or (segment.history_length == 0 and softcap is None):
        if softcap is None:
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, **kwargs)
        else:
            out = _softcapped_dense(query, key, value, attention_mask, scaling, softcap)
    else:
        if segment.layer_idx != getattr(module, "layer_idx", segment.layer_idx):
            raise RuntimeError(f"OSCAR segment of layer {segment.layer_idx} reached layer {module.layer_idx}")
        out = tiered_attention(query, key, value, attention_mask, segment, scaling, softcap)
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
