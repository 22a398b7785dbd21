"""The reference quantizer is the ground truth for the kernels: pin it down on hand-computed cases."""

import pytest
import torch

from oscar_hf.kernels.reference.quantize import (
    clip_index,
    clip_rows,
    dequantize_rows,
    pack_codes,
    quantize_pack,
    quantize_rows,
    unpack_codes,
    unpack_dequantize,
)

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second


def test_two_bit_packing_is_quartered_bit_exact():
    # d = 8: byte j holds elements j, j+2, j+4, j+6 at bits 0, 2, 4, 6.
    codes = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8)
    expected = torch.tensor([[0 | 2 << 2 | 3 << 4 | 1 << 6, 1 | 3 << 2 | 2 << 4 | 0 << 6]], dtype=torch.uint8)
    assert torch.equal(pack_codes(codes, 2), expected)
    assert expected.tolist() == [[0b01111000, 0b00101101]]
    assert torch.equal(unpack_codes(expected, 2), codes)


def test_four_bit_packing_is_halved_bit_exact():
    codes = torch.tensor([[1, 15, 7, 0]], dtype=torch.uint8)  # byte j holds j (low nibble) and j+2 (high nibble)
    expected = torch.tensor([[1 | 7 << 4, 15 | 0 << 4]], dtype=torch.uint8)
    assert torch.equal(pack_codes(codes, 4), expected)
    assert torch.equal(unpack_codes(expected, 4), codes)


def test_three_bit_packing_is_a_two_bit_block_then_a_top_bit_block():
    # d = 8: bytes 0-1 hold the low 2 bits as the 2-bit layout does; byte 2 bit m holds the top bit of element m
    codes = torch.tensor([[0, 5, 2, 7, 4, 3, 6, 1]], dtype=torch.uint8)
    low = [c & 3 for c in codes[0].tolist()]  # 0, 1, 2, 3, 0, 3, 2, 1
    top = [c >> 2 for c in codes[0].tolist()]  # 0, 1, 0, 1, 1, 0, 1, 0
    expected = torch.tensor([[low[0] | low[2] << 2 | low[4] << 4 | low[6] << 6,
                              low[1] | low[3] << 2 | low[5] << 4 | low[7] << 6,
                              sum(t << m for m, t in enumerate(top))]], dtype=torch.uint8)
    assert expected.tolist() == [[0b10001000, 0b01111101, 0b01011010]]
    assert torch.equal(pack_codes(codes, 3), expected)
    assert torch.equal(unpack_codes(expected, 3), codes)


def test_three_bit_top_bits_are_split_planar_over_eighths():
    # d = 16: the top-bit byte j (bytes 4, 5) holds elements j, j + 2, ..., j + 14 at bits 0..7
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, 3] = 4  # eighth 1, element 1 of it: byte 1 of the block, bit 1
    codes[0, 14] = 4  # eighth 7, element 0: byte 0 of the block, bit 7
    packed = pack_codes(codes, 3)
    assert packed.tolist() == [[0, 0, 0, 0, 1 << 7, 1 << 1]]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_unpack_round_trip_on_random_codes(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 128), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 128 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_quantize_row_by_hand():
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    codes, sz = quantize_rows(x, bits=2, clip_ratio=None, scale_dtype=torch.float32)
    # scale = (2 - -1) / 3 = 1, zero = 1; q = floor(x + 1 + 0.5) = [0, 1, 2, 3]
    assert codes.tolist() == [[0, 1, 2, 3]]
    assert sz.tolist() == [[1.0, 1.0]]
    assert dequantize_rows(codes, sz).tolist() == [[-1.0, 0.0, 1.0, 2.0]]


def test_rounding_is_half_up():
    # scale = 1, zero = 0: 0.5 -> 1, 1.5 -> 2, 2.5 -> 3 (half up, not half to even)
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.0]])
    codes, _ = quantize_rows(x, bits=2, clip_ratio=None, scale_dtype=torch.float32)
    assert codes.tolist() == [[0, 1, 2, 3, 3]]


def test_clip_threshold_is_the_order_statistic():
    assert clip_index(0.96, 128) == 122
    assert clip_index(0.92, 128) == 117
    assert clip_index(0.96, 64) == 61
    assert clip_index(None, 64) is None
    assert clip_index(1.0, 64) == 63  # clamped to the last element: the max, i.e. no-op
    x = torch.tensor([[0.1, -5.0, 0.3, 4.0, -0.2, 0.0, 1.0, -2.0]])
    # |x| sorted: 0, .1, .2, .3, 1, 2, 4, 5 ; int(0.75 * 8) = 6 -> threshold 4.0
    assert torch.equal(clip_rows(x, 0.75), torch.tensor([[0.1, -4.0, 0.3, 4.0, -0.2, 0.0, 1.0, -2.0]]))
    # int(0.5 * 8) = 4 -> threshold 1.0
    assert torch.equal(clip_rows(x, 0.5), torch.tensor([[0.1, -1.0, 0.3, 1.0, -0.2, 0.0, 1.0, -1.0]]))


def test_quantization_error_is_at_most_half_a_step():
    x = torch.randn(4, 3, 50, 64)
    codes, sz = quantize_rows(x, bits=2, clip_ratio=None, scale_dtype=torch.float32)
    err = (dequantize_rows(codes, sz) - x).abs()
    assert (err <= sz[..., :1] / 2 + 1e-5).all()


def test_fp16_storage_keeps_degenerate_rows_finite():
    # A near-constant row far from zero: min-max zero point = -min/scale would overflow float16.
    x = torch.full((1, 64), 1000.0)
    x[0, 0] += 1e-3
    packed, sz = quantize_pack(x, bits=2, clip_ratio=None, scale_dtype=torch.float16)
    assert torch.isfinite(sz.float()).all()
    restored = unpack_dequantize(packed, sz, bits=2)
    assert (restored - x).abs().max() < 1.0  # within float16 precision of 1000


def test_constant_row_dequantizes_exactly():
    x = torch.zeros(2, 16)
    packed, sz = quantize_pack(x, 2, 0.96, torch.float16)
    assert torch.equal(unpack_dequantize(packed, sz, 2), x)
