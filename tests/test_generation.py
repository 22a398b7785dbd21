"""Shared-prefill greedy generation equals plain `generate` through the same kind of cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.eval.diagnostics.generation import full_precision_prefill, greedy_through_cache

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=3)


@pytest.mark.parametrize("prompt_length", [9, 30])
@pytest.mark.parametrize("kind", ["bf16", pytest.param("hadamard", marks=pytest.mark.quick), "identity"])
def test_shared_prefill_equals_plain_generate(tiny_llama_model, kind, prompt_length):
    torch.manual_seed(4)
    prompt = torch.randint(1, tiny_llama_model.config.vocab_size, (1, prompt_length))

    def fresh():
        if kind == "bf16":
            return DynamicCache(config=tiny_llama_model.config)
        return OscarCache(tiny_llama_model, method=kind, **LAYOUT)

    plain = greedy_through_cache(tiny_llama_model, fresh(), 20, prompt=prompt)
    shared = greedy_through_cache(tiny_llama_model, fresh(), 20, prefill=full_precision_prefill(tiny_llama_model, prompt))
    assert shared == plain and len(plain) == 20


@pytest.mark.quick
def test_quantized_history_changes_the_greedy_continuation(tiny_llama_model):
    # guards the test above against passing trivially: in this setup the INT2 history changes the tokens
    torch.manual_seed(4)
    prompt = torch.randint(1, tiny_llama_model.config.vocab_size, (1, 30))
    prefill = full_precision_prefill(tiny_llama_model, prompt)
    bf16 = greedy_through_cache(tiny_llama_model, DynamicCache(config=tiny_llama_model.config), 20, prefill=prefill)
    naive = greedy_through_cache(tiny_llama_model, OscarCache(tiny_llama_model, method="identity", **LAYOUT), 20, prefill=prefill)
    assert bf16 != naive
