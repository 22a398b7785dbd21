"""Per-layer replay diagnostics: exact caches give zero error; OSCAR's replay agrees with the simulation."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.eval.decode_equivalent import SimulationPlan, simulate_logits
from oscar_hf.eval.diagnostics.layers import capture_attention_inputs, replay_layer_errors
from oscar_hf.eval.diagnostics.methods import bits_per_element
from oscar_hf.eval.diagnostics.metrics import attention_kl

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=3)


@pytest.fixture
def captured(tiny_llama_model):
    torch.manual_seed(5)
    ids = torch.randint(0, tiny_llama_model.config.vocab_size, (1, 40))
    layers, logits = capture_attention_inputs(tiny_llama_model, ids)
    return ids, layers, logits


@pytest.mark.quick
def test_capture_leaves_the_model_output_unchanged(tiny_llama_model, captured):
    ids, layers, logits = captured
    assert len(layers) == 2 and layers[0].query.shape == (1, 4, 40, 32) and layers[0].key.shape == (1, 2, 40, 32)
    assert torch.allclose(logits, tiny_llama_model(ids).logits, atol=1e-5)


@pytest.mark.parametrize("exact", ["dynamic", pytest.param("none", marks=pytest.mark.quick)])
def test_exact_caches_have_zero_layer_error(tiny_llama_model, captured, exact):
    _, layers, _ = captured
    cache = DynamicCache(config=tiny_llama_model.config) if exact == "dynamic" else OscarCache(
        tiny_llama_model.config, method="none", **LAYOUT)
    for e in replay_layer_errors(layers, cache, prefill=10, progress=False):
        assert e.attention_kl < 1e-10 and e.output_relative_mse < 1e-10 and e.key_mse < 1e-10 and e.queries == 30


def test_oscar_replay_matches_the_simulated_attention(tiny_llama_model, captured):
    ids, layers, _ = captured
    errors = replay_layer_errors(layers, OscarCache(tiny_llama_model.config, method="identity", **LAYOUT), prefill=10,
                                 progress=False)
    assert all(e.attention_kl > 1e-5 and e.key_relative_mse > 1e-2 for e in errors)
    # the simulation's per-layer probe (BF16 trajectory) must see the same score distributions
    probes = {}
    plan = SimulationPlan.from_cache(OscarCache(tiny_llama_model.config, method="identity", **LAYOUT), prefill=10,
                                     recorder=lambda p: probes.__setitem__(p.layer_idx, p), propagate=False)
    simulate_logits(tiny_llama_model, ids, plan)
    for e in errors:
        p = probes[e.layer_idx]
        groups = p.query.shape[1] // p.keys.shape[1]
        k = p.keys.repeat_interleave(groups, dim=1)
        k_hat = p.keys_hat.repeat_interleave(groups, dim=1)
        band = (torch.arange(40) >= p.sink) & (torch.arange(40) < p.sink + p.history[0, :, None])
        exact = p.query @ k.transpose(-1, -2) * p.scaling
        mixed = torch.where(band, p.query @ k_hat.transpose(-1, -2) * p.scaling, exact)
        kl = attention_kl(exact[:, :, 10:], mixed[:, :, 10:], p.mask[:, :, 10:]).item()
        assert kl == pytest.approx(e.attention_kl, rel=1e-3)


@pytest.mark.quick
def test_bits_per_element_counts_what_is_stored(tiny_llama_model, captured):
    _, layers, _ = captured
    dynamic = DynamicCache(config=tiny_llama_model.config)
    replay_layer_errors(layers, dynamic, prefill=10, progress=False)
    assert bits_per_element(dynamic, 40, 1, 2, 32) == pytest.approx(32.0)  # float32 model
    assert bits_per_element(dynamic, 40, 1, 2, 32, bf16_model=True) == pytest.approx(16.0)
    oscar = OscarCache(tiny_llama_model.config, method="hadamard", sink_tokens=4, recent_tokens=8, demote_block=3)
    replay_layer_errors(layers, oscar, prefill=10, progress=False)
    # 40 tokens: 4 sink + 28 history... the window ends with 8 <= recent <= 10 tokens in BF16
    layer = oscar.layers[0]
    _, bf16_tokens, history = layer.counts()
    expected = (bf16_tokens * 16 + history * (2 + 2 * 16 / 32)) / 40  # INT2 codes + fp16 (scale, zero) per row
    assert bits_per_element(oscar, 40, 1, 2, 32, bf16_model=True) == pytest.approx(expected)


def test_chunks_of_the_demotion_block_are_decode_exact(tiny_llama_model):
    # With forwards of b tokens after a prefill that is a multiple of b, demotion happens on the same boundaries
    # as in decoding, so both the replay and the chunked scoring equal their token-by-token versions.
    from oscar_hf.eval.diagnostics.run import chunked_logits

    layout = dict(sink_tokens=4, recent_tokens=8, demote_block=4)
    torch.manual_seed(6)
    ids = torch.randint(0, tiny_llama_model.config.vocab_size, (1, 48))
    layers, _ = capture_attention_inputs(tiny_llama_model, ids)
    by_token = replay_layer_errors(layers, OscarCache(tiny_llama_model.config, method="hadamard", **layout), 16, 1,
                                   progress=False)
    by_block = replay_layer_errors(layers, OscarCache(tiny_llama_model.config, method="hadamard", **layout), 16, 4,
                                   progress=False)
    for a, b in zip(by_token, by_block):
        assert b.attention_kl == pytest.approx(a.attention_kl, rel=1e-4)
        assert b.output_relative_mse == pytest.approx(a.output_relative_mse, rel=1e-4)
    template = OscarCache(tiny_llama_model.config, method="hadamard", **layout)
    decoded = simulate_logits(tiny_llama_model, ids, template, prefill=16)[0, 16:]
    chunked = chunked_logits(tiny_llama_model, ids, OscarCache(tiny_llama_model, method="hadamard", **layout), 16, 4)
    assert (decoded - chunked).abs().max().item() < 1e-5
    off_block = chunked_logits(tiny_llama_model, ids, OscarCache(tiny_llama_model, method="hadamard", **layout), 16, 6)
    assert (decoded - off_block).abs().max().item() > 1e-4
