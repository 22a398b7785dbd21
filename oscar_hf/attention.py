"""The "oscar" attention implementation registered with transformers, the only one this package registers.

With an `OscarCache` the key/value it receives are the BF16 tiers (sink + recent + this forward's tokens), and a
`HistorySegment` (`handoff.py`) describes the quantized history between them. The segment's backend attends to the
BF16 tiers and to the history separately, each giving (output, log-sum-exp), and merges them exactly in float32;
the history is never materialized as a dense BF16 tensor. Without a segment (any other cache, or no history yet)
it is transformers' SDPA path (with a softcap, the reference attention).

Hooks: code that needs to see or replace the attention of a forward without a cache of its own (the calibration
statistics, the diagnostics' capture, the decode-equivalent evaluation) passes `oscar_hook=hook` to the model's
forward. Every attention call then gives `hook(AttentionCall)`; a hook that returns a tensor `[B, Lq, Hq, D]`
replaces the call's output, one that returns None lets the call run as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from oscar_hf.handoff import HistorySegment, take_segment
from oscar_hf.kernels.reference.attention import causal_mask, dense_partial
from oscar_hf.model_support import UnsupportedModelError, text_config_of

OSCAR_ATTENTION = "oscar"
HOOK_ARGUMENT = "oscar_hook"


@dataclass(frozen=True)
class AttentionCall:
    """One attention call, as a hook sees it: `query` `[B, Hq, Lq, D]`, `key`/`value` `[B, Hkv, Lk, D]` (post-RoPE,
    what the cache stores), the mask transformers built (`[B or 1, 1, Lq, Lk]` or None), the softmax scaling and
    softcap, and the cache's segment (None without an `OscarCache`)."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    softcap: float | None
    segment: HistorySegment | None

    @property
    def layer_idx(self) -> int | None:
        return getattr(self.module, "layer_idx", None)


AttentionHook = Callable[[AttentionCall], "torch.Tensor | None"]


def oscar_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry: `query` `[B, Hq, Lq, D]`, `key`/`value` `[B, Hkv, Lk, D]` ->
    (`[B, Lq, Hq, D]`, None).

    A counted decode step (`counted_decode`) is one custom op (`kernels.ops`), which `torch.compile` keeps whole;
    everything else runs eagerly."""
    segment = take_segment(key, kwargs)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if segment is not None and segment.counted and query.shape[2] == 1 and kwargs.get(HOOK_ARGUMENT) is None:
        out = segment.backend.decode_attention(query, key, value, segment.dense_length, segment.dense_start,
                                               segment.history, segment.key_rotation, segment.value_rotation,
                                               scaling, kwargs.get("softcap"), segment.history_start)
        segment.close(None, out)  # the demotion's history write follows this read of the history
        return out, None
    return _eager_attention_forward(module, query, key, value, attention_mask, dropout, scaling, segment, kwargs)


@torch.compiler.disable
def _eager_attention_forward(module, query, key, value, attention_mask, dropout, scaling, segment, kwargs):
    hook = kwargs.pop(HOOK_ARGUMENT, None)
    softcap = kwargs.get("softcap")
    out = None
    if hook is not None:
        out = hook(AttentionCall(module, query, key, value, attention_mask, scaling, softcap, segment))
    if out is None:
        out = _attend(module, query, key, value, attention_mask, dropout, scaling, softcap, segment, kwargs)
    if segment is not None:
        segment.close(attention_mask, query)
    return out, None


def _attend(module, query, key, value, attention_mask, dropout, scaling, softcap, segment, kwargs) -> torch.Tensor:
    if segment is not None:
        attention_mask = segment.tier_mask(attention_mask)
    if segment is None or (segment.history_length == 0 and softcap is None):
        if softcap is None:
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, **kwargs)
            return out
        return _softcapped_dense(query, key, value, attention_mask, scaling, softcap)
    if segment.layer_idx != getattr(module, "layer_idx", segment.layer_idx):
        raise RuntimeError(f"OSCAR segment of layer {segment.layer_idx} reached layer {module.layer_idx}")
    return segment.backend.tiered_attention(query, key, value, attention_mask, segment.history, segment.sink_length,
                                            segment.key_rotation, segment.value_rotation, scaling, softcap)


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


def switch_to_oscar_attention(model) -> str | None:
    """Register "oscar" and switch `model` to it; returns the implementation it had. Raises
    `UnsupportedModelError` when the model does not take attention implementations from transformers'
    AttentionInterface (its attention could not see the cache's history)."""
    register()
    config = text_config_of(model.config)
    previous = getattr(config, "_attn_implementation", None)
    model.set_attn_implementation(OSCAR_ATTENTION)
    if getattr(config, "_attn_implementation", None) != OSCAR_ATTENTION:
        if previous is not None:
            model.set_attn_implementation(previous)
        raise UnsupportedModelError(
            f"{type(model).__name__} did not accept the 'oscar' attention implementation: it does not use "
            "transformers' AttentionInterface"
        )
    return previous


@contextlib.contextmanager
def oscar_attention(model) -> Iterator[None]:
    """Within the block `model` runs the "oscar" attention (so `oscar_hook` reaches it); restored afterwards."""
    previous = switch_to_oscar_attention(model)
    try:
        yield
    finally:
        if previous is not None and previous != OSCAR_ATTENTION:
            model.set_attn_implementation(previous)
