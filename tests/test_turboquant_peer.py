"""The `turboquant3` peer (`eval.diagnostics.turboquant`): Gaussian Lloyd-Max codes, the quantizer's distortion,
a full-precision recent window over a quantized history, storage that does not depend on when tokens were demoted,
forwards that attend to their own tokens in full precision (as the diagnostics' prefill replay assumes), and the
method row building a cache that `generate` runs with."""

from __future__ import annotations

import pytest
import torch

from oscar_hf.eval.diagnostics.layers import capture_attention_inputs
from oscar_hf.eval.diagnostics.methods import (
    PEER_METHODS,
    bits_per_element,
    builtin_methods,
    default_methods,
    select_methods,
)
from oscar_hf.eval.diagnostics.run import chunked_logits
from oscar_hf.eval.diagnostics.turboquant import (
    TurboQuantMSECache,
    TurboQuantMSELayer,
    fake_quantize,
    gaussian_lloyd_max,
    random_rotation,
)
from oscar_hf.eval.diagnostics.turboquant import bits_per_element as code_bits_per_element

from conftest import generate

HEAD_DIM = 32  # conftest.tiny_llama's


def _relative_mse(x: torch.Tensor, bits: int) -> float:
    rotation, centroids = random_rotation(x.shape[-1], 0, 0), gaussian_lloyd_max(bits)
    return ((x - fake_quantize(x, rotation, centroids)).square().sum() / x.square().sum()).item()


def _kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, tokens, HEAD_DIM, generator=generator) for _ in range(2))


# ------------------------------------------------------------------------------------------------ the quantizer
@pytest.mark.quick
def test_lloyd_max_centroids_of_a_standard_normal():
    expected = torch.tensor([0.2451, 0.7560, 1.3440, 2.1520])
    assert torch.allclose(gaussian_lloyd_max(3), torch.cat([-expected.flip(0), expected]), atol=1e-3)
    assert torch.allclose(gaussian_lloyd_max(2), torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=1e-3)
    gaussian_lloyd_max(3).zero_()  # the caller's copy: the cached centroids stay
    assert gaussian_lloyd_max(3)[-1].item() == pytest.approx(2.1520, abs=1e-3)
    with pytest.raises(ValueError, match="bits=9"):
        gaussian_lloyd_max(9)


@pytest.mark.quick
def test_quantization_error_is_the_lloyd_max_distortion_and_3_bits_beat_2():
    x = torch.randn(20_000, 64, generator=torch.Generator().manual_seed(0))
    three, two = _relative_mse(x, 3), _relative_mse(x, 2)
    # Lloyd-Max distortion of N(0, 1): 0.0345 at 3 bits, 0.1175 at 2 (a rotated unit vector's coordinates have
    # slightly lighter tails than a Gaussian, so the error comes out a little lower)
    assert 0.030 < three < 0.037
    assert 0.105 < two < 0.125
    assert three < two / 3


@pytest.mark.quick
def test_the_quantizer_keeps_dtype_and_sends_zero_vectors_to_zero():
    rotation, centroids = random_rotation(64, 0, 0), gaussian_lloyd_max(3)
    x = torch.randn(3, 64).to(torch.bfloat16)
    x[1] = 0
    out = fake_quantize(x, rotation, centroids)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.isfinite(out).all() and (out[1] == 0).all()


@pytest.mark.quick
def test_rotations_are_orthogonal_reproducible_and_differ_per_layer():
    first = random_rotation(64, 0, 0)
    assert torch.allclose(first @ first.T, torch.eye(64), atol=1e-5)
    assert torch.equal(first, random_rotation(64, 0, 0))
    assert not torch.allclose(first, random_rotation(64, 0, 1)) and not torch.allclose(first, random_rotation(64, 1, 0))


@pytest.mark.quick
def test_bits_per_element_counts_the_bf16_norm():
    assert code_bits_per_element(3, 64) == 3.25 and code_bits_per_element(2, 128) == 2.125


# ------------------------------------------------------------------------------------------------ the cache
@pytest.mark.quick
def test_recent_tokens_stay_full_precision_and_older_ones_are_quantized(tiny_llama_model):
    cache = TurboQuantMSECache(tiny_llama_model, residual_length=8)
    keys, values = _kv(20, seed=1)
    seen_keys, seen_values = cache.update(keys, values, 0)
    # the prefill attends to its own tokens in full precision ...
    assert torch.equal(seen_keys, keys) and torch.equal(seen_values, values)
    # ... and leaves the last 8 as given, the 12 before them quantize-dequantized
    layer = cache.layers[0]
    assert isinstance(layer, TurboQuantMSELayer) and layer.quantized_tokens == 12
    assert torch.equal(layer.keys[:, :, 12:], keys[:, :, 12:]) and torch.equal(layer.values[:, :, 12:], values[:, :, 12:])
    assert torch.equal(layer.keys[:, :, :12], fake_quantize(keys[:, :, :12], layer.key_rotation, layer.centroids))
    assert torch.equal(layer.values[:, :, :12],
                       fake_quantize(values[:, :, :12], layer.value_rotation, layer.centroids))
    assert not torch.allclose(layer.keys[:, :, :12], keys[:, :, :12], atol=1e-3)
    # the next forward reads that history, and its own token as given
    new_key, new_value = _kv(1, seed=2)
    seen_keys, _ = cache.update(new_key, new_value, 0)
    assert torch.equal(seen_keys, torch.cat([layer.keys[:, :, :20], new_key], dim=2))
    assert cache.get_seq_length(0) == 21


@pytest.mark.quick
def test_what_is_stored_does_not_depend_on_when_tokens_were_demoted(tiny_llama_model):
    keys, values = _kv(28, seed=3)
    stepwise = TurboQuantMSECache(tiny_llama_model, residual_length=8, demote_block=4)
    stepwise.update(keys[:, :, :20], values[:, :, :20], 0)
    for t in range(20, 28):
        stepwise.update(keys[:, :, t:t + 1], values[:, :, t:t + 1], 0)
        # single tokens leave the window 4 at a time
        assert stepwise.layers[0].quantized_tokens == (12 if t < 23 else 16 if t < 27 else 20)
    at_once = TurboQuantMSECache(tiny_llama_model, residual_length=8, demote_block=4)
    at_once.update(keys, values, 0)
    assert at_once.layers[0].quantized_tokens == 20
    assert torch.equal(stepwise.layers[0].keys, at_once.layers[0].keys)
    assert torch.equal(stepwise.layers[0].values, at_once.layers[0].values)


def test_scoring_from_a_replayed_prefill_equals_a_prefill_forward_and_chunks_equal_decoding(tiny_llama_model):
    # what `run.chunked_logits(prefill_kv=...)` relies on: a forward attends to its own tokens in full precision,
    # so replaying the reference K/V of a prefill longer than the window stores what the prefill forward would
    model = tiny_llama_model
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(4))
    captured, _ = capture_attention_inputs(model, ids)
    kv = ([c.key for c in captured], [c.value for c in captured])

    def build():
        return TurboQuantMSECache(model, residual_length=8, demote_block=4)

    forward = chunked_logits(model, ids, build(), 16, 4)
    replayed = chunked_logits(model, ids, build(), 16, 4, prefill_kv=kv)
    decoded = chunked_logits(model, ids, build(), 16, 1)
    assert (forward - replayed).abs().max().item() < 1e-5
    # forwards of demote_block tokens see the history that decoding them one by one would
    assert (forward - decoded).abs().max().item() < 1e-5
    unquantized = chunked_logits(model, ids, TurboQuantMSECache(model, residual_length=48), 16, 4)
    assert (forward - unquantized).abs().max().item() > 1e-3  # the history is quantized


@pytest.mark.quick
def test_stored_bits_count_codes_norms_and_the_recent_window(tiny_llama_model):
    cache = TurboQuantMSECache(tiny_llama_model, residual_length=8)
    for layer_idx in range(2):
        cache.update(*_kv(40, seed=layer_idx), layer_idx)
    # 32 quantized tokens at 3 + 16/32 bits, 8 float32 tokens (16 bits under a BF16 model)
    assert bits_per_element(cache, 40, 1, 2, HEAD_DIM) == pytest.approx((32 * 3.5 + 8 * 32) / 40)
    assert bits_per_element(cache, 40, 1, 2, HEAD_DIM, bf16_model=True) == pytest.approx((32 * 3.5 + 8 * 16) / 40)


@pytest.mark.quick
def test_the_cache_checks_its_arguments(tiny_llama_model):
    with pytest.raises(ValueError, match="bits=9"):
        TurboQuantMSECache(tiny_llama_model, bits=9)
    with pytest.raises(ValueError, match="residual_length=-1"):
        TurboQuantMSECache(tiny_llama_model, residual_length=-1)


# ------------------------------------------------------------------------------------------------ the method row
@pytest.mark.quick
def test_turboquant3_is_a_peer_row_that_generates(tiny_llama_model):
    assert "turboquant3" in PEER_METHODS and "turboquant3" in default_methods()
    methods = select_methods("bf16,turboquant3")
    assert [m.name for m in methods] == ["bf16", "turboquant3"]
    assert "3.25 bits/element at head_dim 64" in methods[1].label and not methods[1].oscar
    assert builtin_methods()["turboquant3"].label == methods[1].label
    cache = methods[1].build(tiny_llama_model)
    assert isinstance(cache, TurboQuantMSECache)
    assert all(isinstance(layer, TurboQuantMSELayer) and layer.bits == 3 and layer.residual_length == 128
               for layer in cache.layers)
    ids = torch.randint(0, tiny_llama_model.config.vocab_size, (1, 140), generator=torch.Generator().manual_seed(5))
    out = generate(tiny_llama_model, ids, cache, max_new_tokens=4)
    assert out.shape == (1, 144) and torch.equal(out[:, :140], ids)
    # every layer quantized the 12 prompt tokens beyond its 128-token window; decoding stayed within R + 7
    assert [layer.quantized_tokens for layer in cache.layers] == [12, 12]
    assert cache.get_seq_length() == 143
