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
def test_a_sliding_only_model_builds_without_a_profile_and_is_kept_as_dynamic_cache_keeps_it(caplog):
    """Mistral-7B-v0.1's layout: every layer a window shorter than the positions. The default builds without a
    forward (there is nothing to rank or smooth), says once that nothing is stored at 2 bits, and generates as
    DynamicCache does."""
    model = tiny_model("mistral", sliding_window=16)
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with caplog.at_level(logging.WARNING):
        cache = OscarCache(model)
    hook.remove()
    assert not forwards
    assert any("nothing is stored at 2 bits" in r.getMessage() for r in caplog.records) or \
        not caplog.records  # `warning_once`: an earlier test of this process may have logged it
    assert torch.equal(generate(model, ids, cache, max_new_tokens=10), ref)
    assert not any(isinstance(layer, OscarLayer) for layer in cache.layers)


def test_a_window_as_long_as_the_positions_is_full_attention_and_is_quantized():
    """Phi-3.5-mini's and Phi-4-mini's layout: a window longer than the model's context."""
    model = tiny_model("mistral", sliding_window=4096, max_position_embeddings=1024)
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=12, output_scores=True, return_dict_in_generate=True)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = OscarCache(model, method="none", **TIERS)
    out = generate(model, ids, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-5, rtol=0)
    assert all(isinstance(layer, OscarLayer) for layer in cache.layers)
    assert cache.layers[0].history_length > 0
    assert OscarCache(model, method="hadamard").bits_per_element() == 0.0  # empty, but quantized layers


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


@pytest.mark.parametrize("reason, config", list(unsupported_configs()), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.quick
def test_unsupported_layouts_are_refused(reason, config):
    with pytest.raises(UnsupportedModelError, match=reason):
        OscarCache(config, method="identity")


@pytest.mark.quick
@pytest.mark.parametrize("config", [
    transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              alibi=True, new_decoder_architecture=False, multi_query=False),
], ids=["bloom", "falcon-alibi"])
def test_alibi_models_keep_their_attention_over_dequantized_kv(config, caplog):
    """ALiBi's bias is the model's own attention's to add: the cache stores 2-bit K/V and hands that attention all
    of them dequantized. Unquantized, that is DynamicCache through demotions (and a left-padded row); the default
    gives finite logits. Falcon-RW's decode step crashed in the tiered attention before."""
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    implementation = model.config._attn_implementation
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=10, output_scores=True, return_dict_in_generate=True,
              pad_token_id=0)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    with caplog.at_level(logging.WARNING):
        cache = OscarCache(model, method="none", **TIERS)
    out = generate(model, ids, cache, **kw)
    assert model.config._attn_implementation == implementation
    assert cache.layers[0].history_length > 0
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-5, rtol=0)
    default = OscarCache(model, **TIERS)
    assert default.oscar_config.method == "hadamard"  # no profile can observe an attention the model computes
    assert torch.isfinite(torch.stack(generate(model, ids, default, **kw).scores)).all()
    with pytest.raises(UnsupportedModelError, match="computes itself"):
        OscarCache(model, method="oscar-next")


@pytest.mark.quick
def test_head_dim_rules():
    odd = tiny_config("llama", head_dim=24)
    with pytest.raises(ValueError, match="power of two; this model has head_dim=24"):
        OscarCache(odd, method="hadamard")
    OscarCache(odd, method="identity")  # naive INT2 needs no Hadamard: 24 codes pack into 6 bytes
    with pytest.raises(UnsupportedModelError, match="head_dim=6 is not a multiple of 4"):
        OscarCache(tiny_config("llama", head_dim=6), method="identity")
