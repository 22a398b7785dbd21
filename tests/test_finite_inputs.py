"""Finite K/V never turn the cache's outputs NaN or inf: a float16 (scale, zero) pair overflows at 65504, so a row
that spans more than 3 * 65504 (2 bits) used to store an infinite scale and read back NaN for the rest of decoding.
The quantizer saturates instead (`quantize` module docstring); these tests pin that down on the reference and
through a whole cache. The demotion kernel's side is in tests/test_kernels_demote.py."""

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.kernels.reference.backend import ReferenceBackend
from oscar_hf.kernels.reference.quantize import (
    COMPACT,
    VALUE_LIMIT,
    dequantize_rows,
    fake_quantize,
    quantize_rows,
)

from conftest import extreme_rows, forward, stored, tiny_model

EXTREMES = (6.5e4, 7e4, 1e5, 3e38)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, COMPACT)


def _cases():
    for encoder in ("minmax", "sigma", "lloyd"):
        for scale_dtype in SCALE_DTYPES:
            if not (encoder == "lloyd" and scale_dtype == COMPACT):
                name = "compact" if scale_dtype == COMPACT else str(scale_dtype).removeprefix("torch.")
                yield pytest.param(encoder, scale_dtype, id=f"{encoder}-{name}")


@pytest.mark.parametrize("value", [pytest.param(v, marks=pytest.mark.quick) if v == 3e38 else v for v in EXTREMES])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("encoder, scale_dtype", list(_cases()))
def test_extreme_rows_store_finite_pairs_and_read_back_finite(value, bits, encoder, scale_dtype):
    for dtype in (torch.float32, torch.bfloat16):  # 3e38 is finite in both
        x = torch.cat([extreme_rows(value, dtype=dtype), -extreme_rows(value, dtype=dtype)])
        for clip in (None, 0.92):
            codes, pair = quantize_rows(x, bits, clip, scale_dtype, encoder)
            assert torch.isfinite(pair.float()).all(), (dtype, clip, pair)
            assert codes.max() <= 2**bits - 1
            assert torch.isfinite(dequantize_rows(codes, pair, bits)).all(), (dtype, clip)


@pytest.mark.quick
def test_a_row_spanning_more_than_float16_saturates_on_a_centred_grid():
    """+/-1e5 needs a 2-bit scale of 66667: the pair stores float16's largest, 65504, around the row's midrange,
    so both extremes read back as the outer levels, +/-1.5 * 65504."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 1e5, -1e5
    codes, pair = quantize_rows(x, 2, None, torch.float16)
    assert pair.tolist() == [[65504.0, 1.5]]
    read = dequantize_rows(codes, pair)
    assert read[0, :2].tolist() == [1.5 * 65504, -1.5 * 65504]
    assert (read[0, 2:].abs() <= 65504 / 2).all()  # zeros land on the nearest inner level


@pytest.mark.parametrize("encoder", ["minmax", "sigma"])
def test_rows_the_float16_pair_can_hold_keep_their_accuracy(encoder):
    """7e4 and 6.5e4 are beyond float16 but their 2-bit scales (<= 2 * 7e4 / 3) are not: nothing saturates, min-max
    still reads every element back within half a step, and the error is that of a float32 pair. (Lloyd's float16
    refinement is coarser than its float32 one on such rows whatever the saturation: its zero point rounds.)"""
    x = torch.cat([extreme_rows(6.5e4), extreme_rows(7e4)])[[0, 1, 5, 7, 8, 12]]
    codes, pair = quantize_rows(x, 2, None, torch.float16, encoder)
    assert (pair[..., 0].float() < 65504).all()
    if encoder == "minmax":
        err = (dequantize_rows(codes, pair) - x).abs()
        assert (err <= pair[..., :1].float() * 0.5 * (1 + 1e-3)).all()
    wide = (fake_quantize(x, 2, None, torch.float32, encoder) - x).square().mean()
    narrow = (fake_quantize(x, 2, None, torch.float16, encoder) - x).square().mean()
    assert narrow <= 1.01 * wide


@pytest.mark.quick
def test_saturation_is_bounded_by_the_value_limit():
    """Beyond 2^56 rows saturate before any arithmetic: 3e38 reads back no larger than the limit, in any pair."""
    x = extreme_rows(3e38)
    for scale_dtype in (torch.bfloat16, torch.float32):
        read = fake_quantize(x, 2, None, scale_dtype, "minmax")
        assert read.abs().max() <= VALUE_LIMIT * (1 + 1e-2)


def _inject(module, value: float, positions, head_dim: int):
    """Forward hook on `module` (a k_proj, v_proj or Qwen3's k_norm) that writes `value` into half the channels of
    the first KV head at `positions` of a prefill (the rows a Hadamard rotation concentrates onto one axis), and
    its negation into the last channel. Decode steps (one token) pass through."""

    def hook(module, args, out):
        if out.shape[1] <= max(positions):
            return out
        out = out.clone()
        for p in positions:
            row = out[:, p, 0] if out.dim() == 4 else out[:, p, :head_dim]  # a view of the first KV head
            row[..., : head_dim // 2] = value
            row[..., head_dim - 1] = -value
        return out

    return module.register_forward_hook(hook)


def _decode_logits(model, cache, module, value, prompt=28, steps=8):
    """Last-position logits of a prefill of `prompt` tokens with `value` injected into `module` at three history
    tokens, then of `steps` decode steps."""
    head_dim = model.model.layers[0].self_attn.head_dim
    ids = torch.randint(1, 96, (1, prompt + steps), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    hook = _inject(module, value, (6, 9, 12), head_dim)
    try:
        with torch.no_grad():
            logits = [forward(model, ids[:, :prompt], cache).logits[:, -1]]
            for t in range(prompt, prompt + steps):
                logits.append(forward(model, ids[:, t : t + 1], cache).logits[:, -1])
    finally:
        hook.remove()
    return torch.cat(logits)


def _assert_history_finite(cache):
    layer = cache.layers[0]
    assert layer.sink_length == 4 and layer.history_length >= 9  # the injected tokens are history rows
    for pair in ("key_scale_zero", "value_scale_zero"):
        assert torch.isfinite(stored(layer, pair).float()).all(), pair


TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=2)


@pytest.mark.parametrize("projection", ["k_proj", "v_proj"])
@pytest.mark.parametrize("value", [6.5e4, 7e4, pytest.param(1e5, marks=pytest.mark.quick)])
def test_a_huge_finite_key_or_value_keeps_decoding_finite(projection, value):
    """A Llama whose prefill K or V holds `value` at a few history tokens: the reference backend's history must
    store finite pairs and every decode step give finite logits, as a DynamicCache does."""
    model = tiny_model("llama")
    module = getattr(model.model.layers[0].self_attn, projection)
    assert torch.isfinite(_decode_logits(model, DynamicCache(), module, value)).all()
    for method in ("quarot", "hadamard"):
        cache = OscarCache(model, method=method, backend=ReferenceBackend(), **TIERS)
        assert torch.isfinite(_decode_logits(model, cache, module, value)).all(), method
        _assert_history_finite(cache)


def test_a_huge_finite_key_keeps_the_triton_kernels_finite():
    """The same through the Triton demotion and attention kernels (Qwen3 at a head_dim they take; its keys are
    injected after k_norm, which would otherwise normalise them)."""
    pytest.importorskip("triton", reason="the kernels need triton")
    from oscar_hf.kernels.triton.backend import TritonBackend
    from oscar_hf.kernels.triton.interpreter import kernel_device

    from conftest import kernel_qwen3

    device = kernel_device()
    model = kernel_qwen3(head_dim=64, device=device)
    cache = OscarCache(model, method="hadamard", backend=TritonBackend(), **TIERS)
    logits = _decode_logits(model, cache, model.model.layers[0].self_attn.k_norm, 7e4, prompt=24, steps=3)
    assert torch.isfinite(logits).all()
    _assert_history_finite(cache)
    assert stored(cache.layers[0], "key_scale_zero")[..., 0].float().max() == 65504  # the saturated rows
