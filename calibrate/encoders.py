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
(codes uint8 [..., d], scale_zero [..., 2])`. `lloyd` is available in the cache as `OscarConfig(encoder="lloyd")`;
the others only through `attention_error.Candidate(quantizer=fake_quantizer(...))`.
"""

from __future__ import annotations

import torch

from oscar_hf.kernels.reference.quantize import dequantize_rows, quantize_rows

LM_THRESHOLD = 0.98106527  # Gaussian 4-level Lloyd-Max decision threshold (in standard deviations)
LM_SPAN = 3.0191171  # distance between the outer Gaussian Lloyd-Max levels (2 * 1.5095586)
LM_RATIO = 1.16


def minmax(x: torch.Tensor, bits: int, clip_ratio, scale_dtype: torch.dtype):
    return quantize_rows(x, bits, clip_ratio, scale_dtype)


def lloyd(x: torch.Tensor, bits: int, clip_ratio, scale_dtype: torch.dtype):
    """Least-squares uniform grid per row (see module docstring), initialised from `minmax`: the core's opt-in
    `quantize_rows(..., encoder="lloyd")` (`OscarConfig(encoder="lloyd")`)."""
    return quantize_rows(x, bits, clip_ratio, scale_dtype, "lloyd")


def gaussian_lm(x: torch.Tensor, bits: int, clip_ratio, scale_dtype: torch.dtype, ratio: float = LM_RATIO):
    """The reference's Lloyd-Max variant (2 bits only): LM thresholds, stretched uniform reconstruction."""
    if bits != 2:
        raise ValueError("the Gaussian Lloyd-Max encoder is defined for 2-bit codes")
    from oscar_hf.kernels.reference.quantize import clip_rows

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
