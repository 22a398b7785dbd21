"""Compact (one-byte) scale and zero codes: the stored format and its error (the `oscar-next`
preset that stores them: tests/test_head_precision.py)."""

from __future__ import annotations

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.config import OscarConfig
from oscar_hf.kernels.reference.quantize import (
    COMPACT,
    compact_scale,
    compact_zero,
    fake_quantize,
    quantize_rows,
    row_bytes,
)

from conftest import forward, tiny_model


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("encoder", ["minmax", "sigma"])
def test_compact_pairs_cost_a_few_percent_of_error_and_two_bytes(bits, encoder):
    torch.manual_seed(0)
    x = torch.randn(64, 8, 64) * torch.rand(64, 8, 1) * 10
    codes, pair = quantize_rows(x, bits, None, COMPACT, encoder)
    assert pair.dtype == torch.uint8 and pair.shape == (64, 8, 2) and codes.max() <= 2**bits - 1
    wide = (fake_quantize(x, bits, None, torch.float16, encoder) - x).square().mean()
    compact = (fake_quantize(x, bits, None, COMPACT, encoder) - x).square().mean()
    assert compact <= 1.10 * wide  # the grid is at most 4.4% coarser
    # the stored grid spans at least what the encoder chose: min-max rows read back within half a step
    if encoder == "minmax":
        step = compact_scale(pair[..., 0])
        assert ((fake_quantize(x, bits, None, COMPACT) - x).abs() <= step[..., None] * 0.5 + 1e-5).all()
    assert row_bytes(64, 2, COMPACT) == 16 + 2 and row_bytes(64, 2, torch.float16) == 16 + 4


@pytest.mark.quick
def test_compact_codes_saturate_instead_of_overflowing():
    x = torch.tensor([[7e4, -7e4] + [0.0] * 62, [1e-12] * 64])
    out = fake_quantize(x, 2, None, COMPACT, "minmax")
    assert torch.isfinite(out).all()
    assert compact_scale(torch.tensor(255)) > 200 and compact_zero(torch.tensor(0), 2) == -1.0


@pytest.mark.quick
def test_compact_pairs_through_the_cache_store_fewer_bytes_and_stay_close():
    model = tiny_model("llama", seed=3)
    ids = torch.randint(1, 96, (1, 60))
    options = dict(method="hadamard", sink_tokens=4, recent_tokens=8, encoder="sigma")
    wide, compact = OscarCache(model, **options), OscarCache(model, scale_dtype="compact", **options)
    dense = forward(model, ids, None).logits
    a, b = forward(model, ids, wide).logits, forward(model, ids, compact).logits
    layer = compact.layers[0]
    assert layer.history.key_scale_zero.dtype == torch.uint8
    assert wide.nbytes() - compact.nbytes() == 2 * 2 * 2 * 2 * 48  # layers x K/V x KV heads x 2 bytes x tokens
    assert (b - dense).abs().max() < 2 * (a - dense).abs().max() + 1e-3
    assert compact.can_compile and wide.can_compile


@pytest.mark.quick
def test_compact_pairs_refuse_the_lloyd_encoder():
    with pytest.raises(ValueError, match="compact pairs take"):
        OscarConfig(scale_dtype="compact", encoder="lloyd")


def test_the_kernel_backend_takes_compact_pairs_and_matches_the_reference():
    pytest.importorskip("triton")
    from oscar_hf.kernels.reference.backend import ReferenceBackend
    from oscar_hf.kernels.triton.backend import TritonBackend

    model = tiny_model("llama", seed=3, head_dim=64, hidden_size=256)
    ids = torch.randint(1, 96, (2, 50))
    outs = []
    for backend in (TritonBackend(), ReferenceBackend()):
        cache = OscarCache(model, method="hadamard", scale_dtype="compact", sink_tokens=4, recent_tokens=8,
                           backend=backend)
        outs.append(forward(model, ids, cache).logits)
    assert torch.equal(outs[0], outs[1])
    assert TritonBackend().graph_capture_problem(64, 64, "minmax", torch.uint8) is None
