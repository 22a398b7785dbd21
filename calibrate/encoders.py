"""Experimental row encoders that keep the stored format: codes + one (scale, zero) pair per row, decoded by the
core `(q - zero) * scale`. Only the choice of (scale, zero, codes) changes, so the history layout, the dequantizer
and the attention kernels stay as they are.

- `minmax` (the core reference, `oscar_hf.quantize.quantize_rows`): clip at an |x| order statistic, then the levels
  span [min, max] of the clipped row.
- `lloyd`: Lloyd-Max iterations restricted to a uniform grid. Starting from `minmax`, alternate (a) nearest-level
  codes for the current grid and (b) the least-squares grid `x ≈ scale · q + offset` for those codes. Each step
  lowers the row's squared error, so the result is never worse than its `minmax` start.
- `gaussian_lm`: the OSCAR reference's `SGLANG_LLOYD_MAX` path: Gaussian Lloyd-Max decision thresholds on the
  standardized row and a uniform reconstruction grid stretched by `LM_RATIO = 1.16` (4 levels only).

Every encoder has the signature of `quantize_rows`: `(x [..., d] float32, bits, clip_ratio, scale_dtype) ->
(codes uint8 [..., d], scale_zero [..., 2])`. Not used by `OscarCache` unless a caller installs one; see
`experiments/calibration/evaluate_smollm2.py --encoder`.
"""

from __future__ import annotations

import torch

from oscar_hf.quantize import dequantize_rows, quantize_rows

LM_THRESHOLD = 0.98106527  # Gaussian 4-level Lloyd-Max decision threshold (in standard deviations)
LM_SPAN = 3.0191171  # distance between the outer Gaussian Lloyd-Max levels (2 * 1.5095586)
LM_RATIO = 1.16


def minmax(x: torch.Tensor, bits: int, clip_ratio, scale_dtype: torch.dtype):
    return quantize_rows(x, bits, clip_ratio, scale_dtype)


def lloyd(x: torch.Tensor, bits: int, clip_ratio, scale_dtype: torch.dtype, iterations: int = 6):
    """Least-squares uniform grid per row (see module docstring), initialised from `minmax`."""
    x = x.float()
    levels = float(2**bits - 1)
    codes, scale_zero = quantize_rows(x, bits, clip_ratio, scale_dtype)
    scale, zero = scale_zero[..., 0].float(), scale_zero[..., 1].float()
    offset = -zero * scale  # x ≈ scale * q + offset
    best_error = (dequantize_rows(codes, scale_zero) - x).square().sum(-1)
    best_codes, best_scale_zero = codes, scale_zero
    for _ in range(iterations):
        q = codes.float()
        q_mean, x_mean = q.mean(-1, keepdim=True), x.mean(-1, keepdim=True)
        q_var = (q - q_mean).square().sum(-1)
        covariance = ((q - q_mean) * (x - x_mean)).sum(-1)
        fitted = q_var > 0
        scale = torch.where(fitted, covariance / q_var.clamp_min(1e-30), scale).clamp_min(1e-8)
        offset = torch.where(fitted, x_mean[..., 0] - scale * q_mean[..., 0], offset)
        zero = -offset / scale
        scale_zero = torch.stack([scale, zero], -1).to(scale_dtype)
        decoded_error = (dequantize_rows(codes, scale_zero) - x).square().sum(-1)
        better = decoded_error < best_error
        best_error = torch.where(better, decoded_error, best_error)
        best_codes = torch.where(better[..., None], codes, best_codes)
        best_scale_zero = torch.where(better[..., None], scale_zero, best_scale_zero)
        stored = scale_zero.float()
        codes = torch.floor(x / stored[..., :1] + stored[..., 1:] + 0.5).clamp_(0, levels).to(torch.uint8)
        decoded_error = (dequantize_rows(codes, scale_zero) - x).square().sum(-1)
        better = decoded_error < best_error
        best_error = torch.where(better, decoded_error, best_error)
        best_codes = torch.where(better[..., None], codes, best_codes)
        best_scale_zero = torch.where(better[..., None], scale_zero, best_scale_zero)
    return best_codes, best_scale_zero


def gaussian_lm(x: torch.Tensor, bits: int, clip_ratio, scale_dtype: torch.dtype, ratio: float = LM_RATIO):
    """The reference's Lloyd-Max variant (2 bits only): LM thresholds, stretched uniform reconstruction."""
    if bits != 2:
        raise ValueError("the Gaussian Lloyd-Max encoder is defined for 2-bit codes")
    from oscar_hf.quantize import clip_rows

    x = clip_rows(x.float(), clip_ratio)
    mean = x.mean(-1, keepdim=True)
    std = (x.var(-1, unbiased=False, keepdim=True) + 1e-8).sqrt()
    z = (x - mean) / std
    codes = ((z >= -LM_THRESHOLD).int() + (z >= 0).int() + (z >= LM_THRESHOLD).int()).to(torch.uint8)
    scale = (LM_SPAN / 3) * ratio * std[..., 0]
    zero = 1.5 - mean[..., 0] / scale
    return codes, torch.stack([scale, zero], -1).to(scale_dtype)


ENCODERS = {"minmax": minmax, "lloyd": lloyd, "gaussian_lm": gaussian_lm}


def fake_quantizer(encoder):
    """`rows -> dequantize(encode(rows))` for `attention_error.Candidate(quantizer=...)`."""

    def quantize(rows, bits, clip_ratio, scale_dtype):
        return dequantize_rows(*encoder(rows, bits, clip_ratio, scale_dtype))

    return quantize
