"""The demotion kernel against the reference quantizer (`oscar_hf.quantize`).

Runs on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there) and on a CUDA device
at real shapes. Inputs are fresh random draws each run; outputs are poisoned before every launch.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import QuantizedHistory  # noqa: E402
from oscar_hf.kernels.interface import DemoteCall  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.reference.quantize import (  # noqa: E402
    GAUSSIAN_UNIFORM_STEP,
    quantize_pack,
    quantize_rows,
    unpack_codes,
    unpack_dequantize,
)
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402
from oscar_hf.rotations.math import hadamard_matrix, rotate  # noqa: E402

DEVICE = kernel_device()
ON_GPU = DEVICE.type == "cuda"
TOKENS = 300 if ON_GPU else 21  # not a multiple of the kernel's token block
HEADS = 8 if ON_GPU else 2
BATCH = 3 if ON_GPU else 2

from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402
from oscar_hf.kernels.triton.demote import demote_rows  # noqa: E402

from conftest import extreme_rows  # noqa: E402


def _rows(batch, heads, tokens, dim, dtype):
    """Random rows with the awkward cases mixed in: all-zero, constant and near-constant rows with a large offset
    (the float16 zero-point floor), as a strided view into a larger buffer."""
    buffer = torch.randn(batch, heads, tokens + 7, dim, device=DEVICE) * torch.rand(batch, heads, 1, 1, device=DEVICE) * 4
    x = buffer[:, :, 3 : 3 + tokens]
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 2.5
    x[-1, -1, 2] = 3000.0 + 1e-3 * torch.randn(dim, device=DEVICE)
    return x.to(dtype)


def _poisoned(batch, heads, tokens, dim, bits, scale_dtype):
    codes = torch.full((batch, heads, tokens + 5, dim * bits // 8), 0xA5, dtype=torch.uint8, device=DEVICE)
    scale_zero = torch.full((batch, heads, tokens + 5, 2), float("nan"), dtype=scale_dtype, device=DEVICE)
    return codes[:, :, 2 : 2 + tokens], scale_zero[:, :, 2 : 2 + tokens]


@pytest.mark.parametrize("dim", [pytest.param(64, marks=pytest.mark.quick), 128, 256])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_demote_without_rotation_is_bit_exact(dim, bits, scale_dtype):
    x = _rows(BATCH, HEADS, TOKENS, dim, torch.bfloat16 if dim != 128 else torch.float32)
    for clip in (0.92, None):
        codes, scale_zero = _poisoned(BATCH, HEADS, TOKENS, dim, bits, scale_dtype)
        demote_rows([(x, None, clip, codes, scale_zero)], bits)
        ref_codes, ref_scale_zero = quantize_pack(x.float(), bits, clip, scale_dtype)
        assert torch.equal(codes, ref_codes)
        assert torch.equal(scale_zero, ref_scale_zero)


def _orthogonal(dim, heads=None):
    shape = (heads, dim, dim) if heads else (dim, dim)
    q, _ = torch.linalg.qr(torch.randn(shape, dtype=torch.float64))
    return q.float().to(DEVICE)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_demote_with_rotation_differs_only_at_rounding_ties(per_head, dim):
    """`x @ R` sums in another order than torch's matmul: a code may differ by one, and only where the reference's
    `x / scale + zero + 0.5` sits within float rounding of an integer."""
    bits, clip = 2, 0.96
    x = _rows(BATCH, HEADS, TOKENS * (4 if not ON_GPU else 1), dim, torch.bfloat16)
    rotation = _orthogonal(dim, HEADS if per_head else None)
    codes, scale_zero = _poisoned(*x.shape, bits, torch.float16)
    demote_rows([(x, rotation, clip, codes, scale_zero)], bits)

    rotated = rotate(x, rotation)
    ref_codes, ref_scale_zero = quantize_rows(rotated, bits, clip, torch.float16)
    got = unpack_codes(codes, bits)
    mismatch = got != ref_codes
    assert mismatch.float().mean().item() <= 1e-3
    assert ((got.int() - ref_codes.int()).abs() <= 1).all()
    if mismatch.any():
        # the reference's pre-rounding value, recomputed in float64 from its own scale and zero point
        from oscar_hf.kernels.reference.quantize import clip_rows
        clipped = clip_rows(rotated, clip).double()
        lo, hi = clipped.amin(-1, keepdim=True), clipped.amax(-1, keepdim=True)
        scale = (hi - lo) / 3
        position = (clipped - lo) / scale + 0.5
        distance = (position - position.round()).abs()
        assert (distance[mismatch] < 1e-4).all()
    torch.testing.assert_close(scale_zero.float(), ref_scale_zero.float(), rtol=2e-3, atol=1e-6)


def _assert_histories_equal(cfg, dim):
    """Append the same rows through the Triton and the reference backend into poisoned histories; assert every
    stored tensor equal. Returns the (kernel) history and the keys."""
    keys = _rows(BATCH, HEADS, TOKENS, dim, torch.bfloat16)
    values = _rows(BATCH, HEADS, TOKENS, dim, torch.bfloat16) * 0.5
    histories = []
    for backend in (TritonBackend(), ReferenceBackend()):
        history = QuantizedHistory(BATCH, HEADS, dim, dim, cfg, DEVICE)
        history._reserve(TOKENS + 3)
        for name in history._names:
            getattr(history, name).fill_(0xA5 if name.endswith("codes") else float("nan"))
        history.append(keys, values, None, None, backend)
        histories.append(history)
    kernel, reference = histories
    for name in kernel._names:
        assert torch.equal(getattr(kernel, name)[:, :, :TOKENS], getattr(reference, name)[:, :, :TOKENS]), name
    return kernel, keys


@pytest.mark.quick
@pytest.mark.parametrize("bits", [2, 3])
def test_demote_kv_writes_keys_and_values_in_one_launch(bits):
    _assert_histories_equal(OscarConfig(bits=bits, scale_dtype="float16"), 128 if ON_GPU else 64)


def test_demote_with_hadamard_matches_reference_codes_mostly():
    """The preset rotation (a Hadamard), through the backend op the cache calls. Random rows only: a Hadamard maps
    a constant row onto one axis, and the exact zeros elsewhere become order-dependent rounding noise."""
    dim, bits = 128, 2
    x = torch.randn(BATCH, HEADS, TOKENS, dim, device=DEVICE).to(torch.bfloat16)
    rotation = hadamard_matrix(dim, torch.float32).to(DEVICE)
    codes, scale_zero = _poisoned(BATCH, HEADS, TOKENS, dim, bits, torch.float16)
    TritonBackend().demote(x, rotation, 0.92, bits, codes, scale_zero)
    ref_codes, _ = quantize_rows(rotate(x, rotation), bits, 0.92, torch.float16)
    got = unpack_codes(codes, bits)
    assert (got != ref_codes).float().mean().item() <= 1e-3
    assert ((got.int() - ref_codes.int()).abs() <= 1).all()


@pytest.mark.quick
def test_opt_in_encoder_demotes_through_the_reference():
    """`OscarConfig(encoder="lloyd")` has no kernel: the Triton backend hands it to the reference (Lloyd codes)."""
    dim, bits = 64, 2
    cfg = OscarConfig(encoder="lloyd")
    stored, keys = _assert_histories_equal(cfg, dim)
    lloyd = quantize_pack(keys.float(), bits, cfg.key_clip_ratio, cfg.scale_dtype, "lloyd")[0]
    minmax = quantize_pack(keys.float(), bits, cfg.key_clip_ratio, cfg.scale_dtype)[0]
    assert torch.equal(stored.key_codes[:, :, :TOKENS], lloyd) and not torch.equal(lloyd, minmax)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sigma_encoder_in_the_kernel_differs_from_the_reference_only_at_rounding_ties(dim, bits, scale_dtype):
    """The row's mean and standard deviation sum in another order than torch's: a code may differ by one where the
    reference's `x / scale + zero + 0.5` sits within float rounding of an integer, a (scale, zero) pair by about one
    unit of its dtype's last place."""
    x = _rows(BATCH, HEADS, TOKENS, dim, torch.float32) * 0.8 + 0.2
    x[0, 0, 3] = 0.0  # constant rows: exactly between two levels, either side is right; the floor keeps them finite
    x[0, 1, 5] = 7.0
    codes, scale_zero = _poisoned(BATCH, HEADS, TOKENS, dim, bits, scale_dtype)
    demote_rows([(x, None, 0.5, codes, scale_zero)], bits, encoder="sigma")  # sigma takes no clip
    ref_codes, ref_scale_zero = quantize_rows(x.float(), bits, None, scale_dtype, "sigma")
    got = unpack_codes(codes, bits)
    varied = (x.amax(-1) - x.amin(-1)) > 1e-4 * (1 + x.abs().amax(-1))
    mismatch = (got != ref_codes) & varied[..., None]
    assert mismatch.float().mean().item() <= 1e-3
    assert ((got.int() - ref_codes.int())[varied].abs() <= 1).all()
    if mismatch.any():
        xd = x.double()
        mean = xd.mean(-1, keepdim=True)
        scale = (xd - mean).square().mean(-1, keepdim=True).sqrt() * GAUSSIAN_UNIFORM_STEP[bits]
        position = (xd - mean) / scale + (2**bits - 1) / 2 + 0.5
        assert ((position - position.round()).abs()[mismatch] < 1e-3).all()
    ulp = torch.finfo(scale_dtype).eps
    torch.testing.assert_close(scale_zero.float()[varied], ref_scale_zero.float()[varied], rtol=max(2 * ulp, 1e-4),
                               atol=1e-5)
    read = unpack_dequantize(codes, scale_zero, bits)
    assert torch.isfinite(read).all()
    with pytest.raises(ValueError, match="encodes"):
        demote_rows([(x, None, None, codes, scale_zero)], bits, encoder="lloyd")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_demotion_writes_nothing_where_the_device_flag_is_zero(backend):
    """Counted decode demotes every step with a device flag: 0 leaves the outputs as they were, anything else
    writes the reference codes."""
    x = torch.randn(2, 2, 8, 64, device=DEVICE)
    impl = TritonBackend() if backend == "triton" else ReferenceBackend()
    want_codes, want_sz = quantize_pack(x, 2, 0.96, torch.float16)
    for flag, expect_written in ((0, False), (8, True)):
        codes = torch.full((2, 2, 8, 16), 7, dtype=torch.uint8, device=DEVICE)
        sz = torch.full((2, 2, 8, 2), 3.0, dtype=torch.float16, device=DEVICE)
        codes_v, sz_v = codes.clone(), sz.clone()
        impl.demote_kv(DemoteCall(x, x, None, None, 0.96, 0.96, 2, "minmax", codes, sz, codes_v, sz_v,
                                  only_if=torch.tensor([flag], dtype=torch.int32, device=DEVICE)))
        if expect_written:
            assert torch.equal(codes, want_codes) and torch.equal(sz, want_sz) and torch.equal(codes_v, want_codes)
        else:
            assert (codes == 7).all() and (sz == 3.0).all() and (codes_v == 7).all()


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.uint8])
def test_demotion_into_whole_history_buffers_writes_at_the_device_row(backend, scale_dtype):
    """Counted decode's demotion (`demote_kv_at`): the block's codes land at rows [at, at + n) of the whole
    buffers and nothing else changes; with the flag 0 nothing is written; a block that would reach the buffers'
    last n rows (never counted) is written there and reported lost, leaving every counted row as it was."""
    n, size = 8, 40
    x = torch.randn(2, 2, n, 64, device=DEVICE)
    impl = TritonBackend() if backend == "triton" else ReferenceBackend()
    want_codes, want_sz = quantize_pack(x, 2, 0.96, scale_dtype)
    for at, flag, start, lost in ((5, n, 5, 0), (5, 0, None, 0), (size - 2 * n, n, size - 2 * n, 0),
                                  (size - 2 * n + 1, n, size - n, n), (size - n, 0, None, 0)):
        buffers = [torch.full((2, 2, size, 16), 7, dtype=torch.uint8, device=DEVICE),
                   torch.full((2, 2, size, 2), 3, dtype=scale_dtype, device=DEVICE)]
        buffers += [b.clone() for b in buffers]
        before = [b.clone() for b in buffers]
        call = DemoteCall(x, x, None, None, 0.96, 0.96, 2, "minmax", *buffers,
                          only_if=torch.tensor([flag], dtype=torch.int32, device=DEVICE))
        got = impl.demote_kv_at(call, torch.tensor([at], dtype=torch.int32, device=DEVICE))
        assert got.dtype == torch.int32 and int(got) == lost
        expect = [b.clone() for b in before]
        if start is not None:
            for buffer, value in zip(expect, (want_codes, want_sz, want_codes, want_sz)):
                buffer[:, :, start : start + n] = value
        for buffer, want in zip(buffers, expect):
            assert torch.equal(buffer, want)


EXTREMES = (6.5e4, 7e4, 1e5, 3e38)


def _extreme_rows(dim, dtype):
    """`_rows` with every token of the first batch's rows replaced by finite extremes (`EXTREMES`, both signs):
    one element, a +/- pair, every element +/-, constant and near-constant rows, a block of equal elements."""
    x = _rows(BATCH, HEADS, TOKENS, dim, torch.float32).contiguous()
    patterns = []
    for value in EXTREMES:
        for sign in (1.0, -1.0):
            row = extreme_rows(sign * value, dim)[:6].to(DEVICE)  # the negated copy comes from the sign loop
            patterns.append(row)
    patterns = torch.cat(patterns)
    flat = x[0].reshape(-1, dim)
    flat[: min(len(patterns), len(flat))] = patterns[: len(flat)]
    return x.to(dtype)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demote_saturates_extreme_rows_exactly_like_the_reference(bits, scale_dtype, dtype):
    """Min-max without a rotation stays bit-exact on rows whose float16 pair would overflow (the saturated,
    centred grid) and on rows beyond the value limit."""
    x = _extreme_rows(64, dtype)
    for clip in (0.92, None):
        codes, scale_zero = _poisoned(BATCH, HEADS, TOKENS, 64, bits, scale_dtype)
        demote_rows([(x, None, clip, codes, scale_zero)], bits)
        ref_codes, ref_scale_zero = quantize_pack(x.float(), bits, clip, scale_dtype)
        assert torch.equal(codes, ref_codes)
        assert torch.equal(scale_zero, ref_scale_zero)
        assert torch.isfinite(unpack_dequantize(codes, scale_zero, bits)).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sigma_kernel_saturates_extreme_rows_like_the_reference(bits, scale_dtype):
    """Sigma's mean and deviation sum in another order than torch's: on extreme rows too, codes may differ by one
    at a rounding tie and pairs by about an ulp (near-constant rows aside, as in the test above); the pairs and
    the reads stay finite."""
    x = _extreme_rows(64, torch.float32)
    codes, scale_zero = _poisoned(BATCH, HEADS, TOKENS, 64, bits, scale_dtype)
    demote_rows([(x, None, None, codes, scale_zero)], bits, encoder="sigma")
    ref_codes, ref_scale_zero = quantize_rows(x, bits, None, scale_dtype, "sigma")
    got = unpack_codes(codes, bits)
    varied = (x.amax(-1) - x.amin(-1)) > 1e-4 * (1 + x.abs().amax(-1))
    assert ((got != ref_codes) & varied[..., None]).float().mean().item() <= 1e-2
    assert ((got.int() - ref_codes.int())[varied].abs() <= 1).all()
    ulp = torch.finfo(scale_dtype).eps
    torch.testing.assert_close(scale_zero.float()[varied], ref_scale_zero.float()[varied], rtol=max(2 * ulp, 1e-4),
                               atol=1e-5)
    assert torch.isfinite(scale_zero.float()).all()
    assert torch.isfinite(unpack_dequantize(codes, scale_zero, bits)).all()


@pytest.mark.parametrize("encoder", ["minmax", "sigma"])
def test_demote_with_rotation_keeps_extreme_rows_finite(encoder):
    """A rotation can concentrate a row's mass onto one axis (a Hadamard maps a constant row onto one): the rotated
    rows overflow a float16 pair, and 3e38 would overflow `x @ R` itself, but the kernel saturates before and
    after the product. Rows below the value limit still match the reference up to rounding ties."""
    dim, bits = 64, 2
    x = _extreme_rows(dim, torch.bfloat16)
    rotation = hadamard_matrix(dim, torch.float32).to(DEVICE)
    codes, scale_zero = _poisoned(*x.shape, bits, torch.float16)
    demote_rows([(x, rotation, None, codes, scale_zero)], bits, encoder=encoder)
    assert torch.isfinite(scale_zero.float()).all()
    assert torch.isfinite(unpack_dequantize(codes, scale_zero, bits)).all()
    below = x.float().abs().amax(-1) < 1e6  # rows the reference's own rotation cannot overflow
    ref_codes, ref_scale_zero = quantize_rows(rotate(x, rotation), bits, None, torch.float16, encoder)
    got = unpack_codes(codes, bits)
    assert ((got.int() - ref_codes.int())[below].abs() <= 1).all()
    assert (got != ref_codes)[below].float().mean().item() <= 2e-2
    torch.testing.assert_close(scale_zero.float()[below], ref_scale_zero.float()[below], rtol=2e-3, atol=1e-5)
