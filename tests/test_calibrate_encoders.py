"""Experimental encoders keep the stored format and never lose to the core min-max encoder (lloyd)."""

import pytest
import torch

from oscar_hf.calibrate.encoders import LM_RATIO, LM_SPAN, gaussian_lm, lloyd, minmax
from oscar_hf.kernels.reference.quantize import dequantize_rows

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second


@pytest.mark.parametrize("clip", [None, 0.92])
def test_lloyd_is_never_worse_than_minmax_per_row(clip):
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3).sample((4000, 64))
    base_error = (dequantize_rows(*minmax(x, 2, clip, torch.float16)) - x).square().sum(-1)
    codes, scale_zero = lloyd(x, 2, clip, torch.float16)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 3 and scale_zero.dtype == torch.float16
    error = (dequantize_rows(codes, scale_zero) - x).square().sum(-1)
    assert bool((error <= base_error + 1e-6).all())
    assert error.mean() < 0.8 * base_error.mean()  # and clearly better on heavy-tailed rows


def test_lloyd_keeps_constant_rows_exact():
    x = torch.full((2, 8), 3.25)
    torch.testing.assert_close(dequantize_rows(*lloyd(x, 2, None, torch.float32)), x)


def test_gaussian_lm_follows_the_reference_formula():
    x = torch.tensor([[-2.0, -0.5, 0.1, 0.2, 0.4, 1.5, 2.5, -1.0]])
    codes, scale_zero = gaussian_lm(x, 2, None, torch.float32)
    mean, std = x.mean(), (x.var(unbiased=False) + 1e-8).sqrt()
    z = (x - mean) / std
    expected = (z >= -0.98106527).int() + (z >= 0).int() + (z >= 0.98106527).int()
    assert torch.equal(codes.int(), expected)
    scale = LM_SPAN / 3 * LM_RATIO * std
    torch.testing.assert_close(scale_zero[0, 0], scale)
    torch.testing.assert_close(scale_zero[0, 1], 1.5 - mean / scale)


def test_cache_with_lloyd_encoder_stores_the_refined_codes():
    from oscar_hf import OscarCache
    from oscar_hf.kernels.reference.quantize import quantize_pack
    from oscar_hf.rotations.math import rotate

    from conftest import forward, stored, tiny_model

    model = tiny_model("llama", seed=7)
    ids = torch.randint(1, 96, (1, 40))

    lloyd_cache = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8, encoder="lloyd")
    minmax_cache = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8)
    forward(model, ids, lloyd_cache)
    forward(model, ids, minmax_cache)
    layer, reference = lloyd_cache.layers[0], minmax_cache.layers[0]
    assert layer.history_length == 28
    assert not torch.equal(stored(layer, "key_codes"), stored(reference, "key_codes"))
    # Re-encode the demoted keys (sink 4 .. 32) from the min-max cache's exact copy: a DynamicCache-free check that
    # the lloyd cache stored exactly quantize_pack(..., "lloyd") of the rotated rows.
    from transformers import DynamicCache

    dense = DynamicCache(config=model.config)
    forward(model, ids, dense)
    keys = dense.layers[0].keys[:, :, 4:32]
    packed, pairs = quantize_pack(rotate(keys, layer.key_rotation), 2, 0.96, torch.float16, "lloyd")
    assert torch.equal(stored(layer, "key_codes")[:, :, :28], packed)
    assert torch.equal(layer.history.key_scale_zero[:, :, :28], pairs)


def test_sigma_grid_is_the_gaussian_optimal_uniform_quantizer_in_the_stored_format():
    from oscar_hf.kernels.reference.quantize import dequantize_rows, quantize_rows

    torch.manual_seed(0)
    x = torch.randn(4096, 64) * 0.7 + 0.3
    codes, scale_zero = quantize_rows(x, 2, 0.5, torch.float16, "sigma")  # the clip ratio does not apply
    again, _ = quantize_rows(x, 2, None, torch.float16, "sigma")
    assert torch.equal(codes, again) and codes.max() == 3 and codes.min() == 0
    error = (dequantize_rows(codes, scale_zero) - x).square().mean() / x.var()
    plain = (dequantize_rows(*quantize_rows(x, 2, None, torch.float16)) - x).square().mean() / x.var()
    assert 0.11 < error < 0.125 < plain  # Max's Gaussian optimum is 0.1188 of the variance
    steps = scale_zero[:, 0].float() / x.std(-1, unbiased=False)
    assert torch.allclose(steps, torch.full_like(steps, 0.9957), rtol=2e-3)
