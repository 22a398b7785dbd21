"""Model families: supported ones match DynamicCache with quantization off; unsupported ones fail clearly."""

import logging

import pytest
import torch
import transformers
from transformers import DynamicCache

from oscar_hf import OscarCache, UnsupportedModelError
from oscar_hf.layer import OscarLayer

from conftest import VOCAB, generate, tiny_config, tiny_model

TIERS = dict(sink_tokens=2, recent_tokens=4, demote_block=2)


@pytest.mark.parametrize("family", ["gemma2", pytest.param("gemma3", marks=pytest.mark.quick)])
def test_mixed_sliding_and_global_layers(family):
    """Global layers get OSCAR tiers, sliding layers pass through in BF16; softcap (Gemma2) is honoured."""
    model = tiny_model(family)
    reference_attention = model.config._attn_implementation
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=15, output_scores=True, return_dict_in_generate=True)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = OscarCache(model, method="none", rotations="hadamard", **TIERS)
    out = generate(model, ids, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-5, rtol=0)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "OscarLayer"] * 2
    assert cache.layers[1].history_length > 0
    model.set_attn_implementation(reference_attention)


@pytest.mark.quick
def test_all_sliding_model_is_kept_in_bf16_with_a_warning(caplog):
    model = tiny_model("mistral", sliding_window=16)
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    with caplog.at_level(logging.WARNING):
        cache = OscarCache(model, method="hadamard")
    assert "every layer of this model uses sliding-window attention" in caplog.text
    assert torch.equal(generate(model, ids, cache, max_new_tokens=10), ref)
    assert not any(isinstance(layer, OscarLayer) for layer in cache.layers)


def test_quantized_generation_runs_on_every_family():
    for family in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"):
        model = tiny_model(family)
        ids = torch.randint(1, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
        cache = OscarCache(model, method="hadamard", **TIERS)
        out = generate(model, ids, cache, max_new_tokens=8)
        assert out.shape == (1, 32)
        assert cache.bits_per_element() < 16


def unsupported_configs():
    yield "multi-head latent attention", transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16)
    yield "share another layer's KV", transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_kv_shared_layers=2)
    yield "layer 0 is of type 'linear_attention'", transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    yield "layer 0 is of type 'chunked_attention'", transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, attention_chunk_size=32)


@pytest.mark.parametrize("reason, config", list(unsupported_configs()), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.quick
def test_unsupported_layouts_are_refused(reason, config):
    with pytest.raises(UnsupportedModelError, match=reason):
        OscarCache(config, method="identity")


@pytest.mark.quick
def test_head_dim_rules():
    odd = tiny_config("llama", head_dim=24)
    with pytest.raises(ValueError, match="power of two; this model has head_dim=24"):
        OscarCache(odd, method="hadamard")
    OscarCache(odd, method="identity")  # naive INT2 needs no Hadamard: 24 codes pack into 6 bytes
    with pytest.raises(UnsupportedModelError, match="head_dim=6 is not a multiple of 4"):
        OscarCache(tiny_config("llama", head_dim=6), method="identity")
