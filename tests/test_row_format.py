"""The row format as one value (`kernels.format.RowFormat`): what it stores and costs, and 3-bit rows through the
real cache, as the reference packs them (a 2-bit block and a 1-bit block) and as the simulation decodes them."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.config import OscarConfig
from oscar_hf.eval.decode_equivalent import simulate_logits
from oscar_hf.kernels.format import RowFormat
from oscar_hf.kernels.reference.quantize import COMPACT

from conftest import forward, tiny_model

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=3)


@pytest.mark.quick
@pytest.mark.parametrize("bits, pairs, expected", [
    (2, torch.float16, 2.5), (3, torch.float16, 3.5), (3, COMPACT, 3.25), (4, torch.float16, 4.5),
])
def test_a_format_states_its_bytes(bits, pairs, expected):
    """Bits per element at head_dim 64: the codes plus the (scale, zero) pair; 3-bit codes with compact pairs are
    TurboQuant's 3.25 bits."""
    row_format = RowFormat(bits, "minmax", pairs)
    assert row_format.code_bytes(64) == 64 * bits // 8
    assert row_format.bits_per_element(64) == expected


@pytest.mark.quick
def test_a_format_refuses_what_it_cannot_store_and_names_why():
    with pytest.raises(ValueError, match="bits=5"):
        RowFormat(5)
    with pytest.raises(ValueError, match="lloyd"):
        RowFormat(2, "lloyd", COMPACT)
    assert RowFormat(3).unpackable(60) == "head_dim=60 is not a multiple of 8, the codes packed per byte at 3 bits"
    assert RowFormat(2).unpackable(60) is None and RowFormat(3).unpackable(64) is None


@pytest.mark.quick
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("encoder", ["minmax", "sigma"])
def test_encode_decode_is_the_fake_quantizer_and_each_bit_halves_the_error_or_better(bits, encoder):
    rows = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    row_format = RowFormat(bits, encoder, COMPACT if encoder == "sigma" else torch.float16)
    packed, pairs = row_format.encode(rows)
    assert packed.shape == (512, row_format.code_bytes(64)) and packed.dtype == torch.uint8
    stored = row_format.decode(packed, pairs)
    torch.testing.assert_close(stored, row_format.fake_quantize(rows), rtol=0, atol=0)
    wider = RowFormat(bits + 1, encoder, row_format.pair_dtype) if bits < 4 else None
    if wider is not None:
        error = (stored - rows).square().mean()
        assert (wider.fake_quantize(rows) - rows).square().mean() < error / 2


def test_the_config_asks_its_formats():
    config = OscarConfig.from_method("oscar-next", high_precision_bits=3)
    assert config.row_format == RowFormat(2, "sigma", COMPACT)
    assert config.high_precision_format == RowFormat(3, "minmax", torch.float16)
    assert config.high_precision().row_format == config.high_precision_format
    assert OscarConfig.from_method("hadamard", bits=3).row_format == RowFormat(3, "minmax", torch.float16)


@pytest.mark.quick
def test_3_bit_rows_through_the_cache_decode_as_the_simulation_and_sit_between_2_and_4_bits():
    model = tiny_model("llama", seed=3)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    exact = DynamicCache(config=model.config)
    forward(model, ids[:, :30], exact)
    errors = {}
    for bits in (2, 3, 4):
        cache = OscarCache(model, method="hadamard", bits=bits, **LAYOUT)
        forward(model, ids[:, :30], cache)
        history = cache.layers[1].history
        assert history.key_codes.shape[-1] == 16 * bits // 8  # head_dim 16
        errors[bits] = (cache.layers[1].dense_kv()[0] - exact.layers[1].keys).square().mean().item()
    assert errors[4] < errors[3] < errors[2]

    simulated = simulate_logits(model, ids, OscarCache(model.config, method="hadamard", bits=3, **LAYOUT), prefill=20)
    cache = OscarCache(model, method="hadamard", bits=3, **LAYOUT)
    pieces = [forward(model, ids[:, :20], cache).logits]
    pieces += [forward(model, ids[:, t:t + 1], cache).logits for t in range(20, ids.shape[1])]
    assert (simulated - torch.cat(pieces, 1)).abs().max().item() < 1e-5
    assert (simulated - model(ids).logits).abs().max().item() > 1e-3  # the history matters here


def test_3_bit_high_precision_heads_store_their_own_width():
    model = tiny_model("llama", seed=3)
    cache = OscarCache(model, method="hadamard", high_precision_heads=((1, 0),), high_precision_bits=3, **LAYOUT)
    forward(model, torch.randint(1, 96, (1, 30)), cache)
    widths = [part.format.bits for _, _, part in cache.layers[1].history.parts]
    assert sorted(widths) == [2, 3]
