"""Seeing post-RoPE queries, keys and values: a registered calibration attention implementation, and the loop
that feeds text through a model.

`capturing(model, observer)` switches the model to the "oscar_calibration" attention implementation for the
duration of a `with` block. That implementation calls `observer(module, query, key, value, scaling, softcap)`
for every attention call (`query` `[B, Hq, Lq, d]`, `key`/`value` `[B, Hkv, Lk, d]`, post-RoPE, what the cache
would store), then computes the attention with transformers' SDPA path, so the forward is unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from oscar_hf.compat import cache_argument_name
from oscar_hf.models import text_config_of

CALIBRATION_ATTENTION = "oscar_calibration"

Observer = Callable[..., None]
_observers: list[Observer] = []


class NoAttentionError(ValueError):
    """The model never called an attention implementation through transformers' AttentionInterface."""


@torch.compiler.disable
def calibration_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry: observe, then SDPA. Returns (`[B, Lq, Hq, D]`, None)."""
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if _observers:
        with torch.no_grad():
            _observers[-1](module, query, key, value, scaling, kwargs.get("softcap"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> None:
    """Register "oscar_calibration" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(CALIBRATION_ATTENTION, calibration_attention_forward)
    AttentionMaskInterface.register(CALIBRATION_ATTENTION, sdpa_mask)


@contextmanager
def capturing(model, observer: Observer):
    """Within the block, every attention call of `model` is reported to `observer` before it runs."""
    register()
    config = text_config_of(model.config)
    previous = getattr(config, "_attn_implementation", None)
    model.set_attn_implementation(CALIBRATION_ATTENTION)
    if getattr(config, "_attn_implementation", None) != CALIBRATION_ATTENTION:
        model.set_attn_implementation(previous)
        raise NoAttentionError(
            f"{type(model).__name__} did not accept a registered attention implementation: it does not use "
            "transformers' AttentionInterface, so its queries and keys cannot be captured"
        )
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.pop()
        if previous is not None:
            model.set_attn_implementation(previous)


def input_device(model) -> torch.device:
    """Where `input_ids` go: the device of the input embeddings (the first shard under `device_map`)."""
    return model.get_input_embeddings().weight.device


@torch.no_grad()
def feed(
    model,
    sequences: Iterable[torch.Tensor],
    chunk_tokens: int = 2048,
    progress: bool | str = False,
    total_tokens: int | None = None,
) -> int:
    """Run every `[1, L]` sequence through `model`; returns the number of tokens fed.

    Sequences longer than `chunk_tokens` are fed in chunks through a `DynamicCache`, so the attention of a chunk
    sees `[1, Hq, chunk, d]` queries against all earlier keys: activation memory grows with the chunk, not with the
    square of the context. Observers therefore receive the newest `Lq` positions as queries and all positions as keys.
    Only the last position's logits are computed (`logits_to_keep=1`) where the model accepts it.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: expected >= 1")
    device = input_device(model)
    argument = cache_argument_name(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}
    description = progress if isinstance(progress, str) else "calibration"
    bar = tqdm(total=total_tokens, desc=description, unit="tok", disable=not progress)
    fed = 0
    try:
        for ids in sequences:
            if ids.dim() != 2 or ids.shape[0] != 1:
                raise ValueError(f"calibration sequences are [1, L] token ids, got shape {tuple(ids.shape)}")
            ids = ids.to(device)
            length = ids.shape[1]
            if length <= chunk_tokens:
                model(input_ids=ids, use_cache=False, **extra)
            else:
                cache = DynamicCache(config=model.config)
                for start in range(0, length, chunk_tokens):
                    model(input_ids=ids[:, start : start + chunk_tokens], use_cache=True, **{argument: cache}, **extra)
                del cache
            fed += length
            bar.update(length)
    finally:
        bar.close()
    return fed
