"""Feeding calibration text through a model while an observer sees every attention call's post-RoPE queries, keys
and values (a hook of the "oscar" attention, `oscar_hf.attention`).

`feed(model, sequences, observer=observer)` calls `observer(module, query, key, value, scaling, softcap)` for every
attention call (`query` `[B, Hq, Lq, d]`, `key`/`value` `[B, Hkv, Lk, d]`, post-RoPE, what the cache would store);
the attention itself runs unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from oscar_hf.attention import AttentionCall, oscar_attention
from oscar_hf.compat import cache_argument_name
from oscar_hf.model_support import UnsupportedModelError

Observer = Callable[..., None]


class NoAttentionError(UnsupportedModelError):
    """The model's attention never reached transformers' AttentionInterface, so nothing could be observed."""


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
    observer: Observer | None = None,
) -> int:
    """Run every `[1, L]` sequence through `model`, showing each attention call to `observer`; returns the number of
    tokens fed. Raises `UnsupportedModelError` when the model does not take transformers' attention implementations,
    `NoAttentionError` when its forward never reaches one.

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
    calls = 0

    def hook(call: AttentionCall) -> None:
        nonlocal calls
        calls += 1
        if observer is not None:
            with torch.no_grad():
                observer(call.module, call.query, call.key, call.value, call.scaling, call.softcap)

    description = progress if isinstance(progress, str) else "calibration"
    bar = tqdm(total=total_tokens, desc=description, unit="tok", disable=not progress)
    fed = 0
    with oscar_attention(model, hook), bar:
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
    if fed and not calls:
        raise NoAttentionError(f"{type(model).__name__} ran without calling any attention implementation (its "
                               "forward does not pass attention kwargs through): no attention to observe")
    return fed
