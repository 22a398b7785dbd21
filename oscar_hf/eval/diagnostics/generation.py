"""Greedy generation through a cache after a shared full-precision prefill.

Every cache compared here attends to its prefill in full precision and only quantizes (or demotes) for later
queries, so a prefill's logits and K/V are the same for all of them. `greedy_through_cache` therefore runs the
prefill once (`full_precision_prefill`), fills each method's fresh cache with those K/V through the cache's own
`update` (`prefill_by_replay`), takes the first token from the shared logits and lets `model.generate` decode the
rest through the cache. This equals `model.generate(prompt, cache)` for these caches (tested in
tests/test_generation.py) and saves one long prefill per method on CPU. `shared_prefill=False` runs plain
`generate` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from oscar_hf.cache import OscarCache
from oscar_hf.compat import cache_argument_name, compile_config_anywhere, output_cache
from oscar_hf.eval.diagnostics.layers import prefill_by_replay


@dataclass
class Prefill:
    prompt: torch.Tensor  # [1, P]
    keys: list[torch.Tensor]  # per layer [1, Hkv, P, D]
    values: list[torch.Tensor]
    first_token: int  # greedy token after the prompt


@torch.no_grad()
def full_precision_prefill(model, prompt: torch.Tensor) -> Prefill:
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, use_cache=True, **{cache_argument_name(model): cache})
    cache = output_cache(out) or cache
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return Prefill(prompt, keys, values, int(out.logits[0, -1].argmax()))


@torch.no_grad()
def greedy_through_cache(model, cache, max_new_tokens: int, prefill: Prefill | None = None,
                         prompt: torch.Tensor | None = None, compiled: bool = False) -> list[int]:
    """Greedy continuation (token ids) of a prompt through a fresh `cache`.

    With `prefill` (shared): replay its K/V into the cache, then decode; otherwise `prompt` goes through plain
    `model.generate`. `compiled`: `generate` compiles the decode step on any device (it does on CUDA by itself),
    where the cache is compileable.
    """
    name = cache_argument_name(model)
    options = dict(do_sample=False, use_cache=True, pad_token_id=model.config.eos_token_id or 0)
    if compiled:
        options["compile_config"] = compile_config_anywhere(fullgraph=True)
        if isinstance(cache, OscarCache):
            cache.compile_decode = True  # from the first call, not once eager steps would have paid for it
    if prefill is None:
        out = model.generate(input_ids=prompt, max_new_tokens=max_new_tokens, **options, **{name: cache})
        return out[0, prompt.shape[1]:].tolist()
    prefill_by_replay(cache, prefill.keys, prefill.values)
    first = torch.tensor([[prefill.first_token]], device=prefill.prompt.device)
    if max_new_tokens == 1:
        return [prefill.first_token]
    ids = torch.cat([prefill.prompt, first], dim=1)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens - 1,
                         **options, **{name: cache})
    return [prefill.first_token] + out[0, ids.shape[1]:].tolist()
