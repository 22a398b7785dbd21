"""Demotion kernel: rotate, clip, quantize and pack rows into the history buffers, K and V in one launch.

Contract (`demote_rows`): for each input pair (keys, values) `[B, H, n, d]` (model dtype, model basis, any strides
with a unit last stride), write
- `codes` `[B, H, n, d * bits / 8]` uint8: split-planar packed codes of `clip(x @ R)` (3 bits: bit-sliced,
  `reference.quantize.CODE_SLICES`),
- `scale_zero` `[B, H, n, 2]` (float16 / bfloat16 / float32, or uint8: compact pairs): the pair of each row,
exactly as `oscar_hf.quantize.quantize_pack(rotate(x, R), ...)` defines them. R is `[d, d]` (one per layer),
`[H, d, d]` (one per KV head) or None (identity); it is applied in float32 (IEEE products, fp32 accumulation).
The clip threshold is the order statistic `sort(|x|)[clip_index]`, found exactly by bisection on the float bit
patterns; every division is IEEE round-to-nearest (`div_rn`), so without a rotation (or with rows already rotated)
the float pairs and the codes are bit-identical to the reference. Compact pairs (`quantize.compact_rows`) also go
through `log2` and `exp2`, whose float32 results may differ from torch's by an ulp (torch's `exp2` is not
correctly rounded), so a scale or zero code at a rounding boundary, or a code at a near-tie of the stored grid,
may come out one apart. With a rotation, `x @ R` sums in a different order than torch's matmul, so a row can
land on the other side of a rounding boundary (a code off by one at a near-tie).

Finite inputs give finite pairs (the reference's saturation: `quantize.saturate`, `quantize.storable`). The kernel
also saturates its input rows before the rotation, so that `x @ R` cannot overflow float32 either; rows with an
element beyond `VALUE_LIMIT` (2^56) and a rotation may therefore differ from `quantize_pack(rotate(x, R))`,
whose rotation sees the unsaturated row.

Grid: (token blocks, H, B * number of tensors): one launch covers a whole demotion of a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_hf.kernels.interface import kernel_head_dim
from oscar_hf.kernels.reference.quantize import (
    COMPACT,
    COMPACT_SCALE_BIAS,
    COMPACT_SCALE_STEPS,
    GAUSSIAN_UNIFORM_STEP,
    SCALE_FLOOR,
    VALUE_LIMIT,
    clip_index,
    pair_limit,
    zero_limit,
)
from oscar_hf.kernels.triton.codes import compact_scale, compact_zero
from oscar_hf.kernels.triton.common import launch, launch_device, round_to

_BISECT_STEPS = tl.constexpr(31)  # the bit patterns of |x| lie in [0, 0x7F800000]: 31 halvings isolate one
_SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)
_VALUE_LIMIT = tl.constexpr(VALUE_LIMIT)
_COMPACT_SCALE_BIAS = tl.constexpr(COMPACT_SCALE_BIAS)
_COMPACT_SCALE_STEPS = tl.constexpr(COMPACT_SCALE_STEPS)
KERNEL_ENCODERS = ("minmax", "sigma")  # `lloyd` demotes through the reference


@triton.jit
def _round_half_even(y):
    """`torch.round` of float32 `y` in [-1, 256]: there `floor(y)` and `y - floor(y)` are exact."""
    whole = tl.floor(y)
    frac = y - whole
    odd = (whole.to(tl.int32) & 1) == 1
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), whole + 1.0, whole)


@triton.jit
def _compact_pair(scale, zero, BITS: tl.constexpr):
    """The compact codes of float32 pairs (`quantize.compact_rows`) and the grid they store: (scale code, zero
    code, stored scale, stored zero), all float32."""
    levels: tl.constexpr = 2**BITS - 1
    scale_code = tl.ceil(tl.log2(scale) * _COMPACT_SCALE_STEPS - 1e-4) + _COMPACT_SCALE_BIAS
    scale_code = tl.minimum(tl.maximum(scale_code, 0.0), 255.0)
    stored_scale = compact_scale(scale_code)
    # the grid's centre stays where the encoder put it; the clamp keeps `_round_half_even` in its exact range
    # without changing the clamped code
    centre = (levels / 2 - zero) * scale
    wanted_zero = levels / 2 - tl.math.div_rn(centre, stored_scale)
    fixed = tl.minimum(tl.maximum((wanted_zero + 1.0) * (255.0 / (levels + 2)), -1.0), 256.0)
    zero_code = tl.minimum(tl.maximum(_round_half_even(fixed), 0.0), 255.0)
    return scale_code, zero_code, stored_scale, compact_zero(zero_code, BITS)


@triton.jit
def _pack(q, WIDTH: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """int32 codes `q` [BLOCK_T, D] of `WIDTH` bits packed split-planar (`reference.quantize.pack_codes`): uint8
    [BLOCK_T, D * WIDTH / 8]."""
    per_byte: tl.constexpr = 8 // WIDTH
    planes = tl.reshape(q, (BLOCK_T, per_byte, D // per_byte))
    shifts = tl.arange(0, per_byte) * WIDTH
    return tl.sum(planes << shifts[None, :, None], axis=1).to(tl.uint8)


@triton.jit
def _demote_tensor(
    x_ptr, sxb, sxh, sxt,
    r_ptr, srh, srk,
    c_ptr, scb, sch, sct,
    z_ptr, szb, szh, szt,
    b, h, t0, n, o0, clip_idx, floor_ratio, pair_max,
    D: tl.constexpr, BITS: tl.constexpr, HAS_ROT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMA: tl.constexpr, STEP: tl.constexpr,
):
    # input rows t0 + i, output rows o0 + t0 + i (o0: where the block goes in whole history buffers, else 0)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    row_ok = offs_t < n
    x_base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    if HAS_ROT:
        x = tl.zeros((BLOCK_T, D), dtype=tl.float32)
        r_base = r_ptr + h.to(tl.int64) * srh
        for k0 in tl.static_range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_base + offs_t[:, None] * sxt + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            # saturated before the product too: for an orthogonal R, |x @ R| <= sqrt(D) max|x| stays finite
            xk = tl.minimum(tl.maximum(xk.to(tl.float32), -_VALUE_LIMIT), _VALUE_LIMIT)
            rk = tl.load(r_base + offs_k[:, None] * srk + offs_d[None, :])
            x = tl.dot(xk, rk.to(tl.float32), acc=x, input_precision="ieee")
    else:
        x = tl.load(x_base + offs_t[:, None] * sxt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        x = x.to(tl.float32)
    x = tl.minimum(tl.maximum(x, -_VALUE_LIMIT), _VALUE_LIMIT)  # `quantize.saturate`

    levels: tl.constexpr = 2**BITS - 1
    if SIGMA:
        # the Gaussian-optimal uniform grid around the row's mean (`quantize._sigma_rows`)
        mean = tl.sum(x, axis=1) / D
        centered = x - mean[:, None]
        std = tl.sqrt_rn(tl.sum(centered * centered, axis=1) / D)
        scale = tl.maximum(std * STEP, tl.maximum(tl.abs(mean) * floor_ratio, _SCALE_FLOOR))
        scale = tl.minimum(scale, pair_max)
        zero = levels / 2 - tl.math.div_rn(mean, scale)
    else:
        if clip_idx >= 0:
            # thr = sort(|x|)[clip_idx]: the smallest bit pattern v with #{|x| <= v} > clip_idx.
            bits_abs = tl.abs(x).to(tl.int32, bitcast=True)
            lo = tl.zeros((BLOCK_T,), dtype=tl.int32)
            hi = tl.full((BLOCK_T,), 0x7F800000, dtype=tl.int32)
            for _ in range(_BISECT_STEPS):
                mid = lo + (hi - lo) // 2
                count = tl.sum((bits_abs <= mid[:, None]).to(tl.int32), axis=1)
                above = count > clip_idx
                hi = tl.where(above, mid, hi)
                lo = tl.where(above, lo, mid + 1)
            thr = lo.to(tl.float32, bitcast=True)[:, None]
            x = tl.maximum(tl.minimum(x, thr), -thr)
        x_min = tl.min(x, axis=1)
        x_max = tl.max(x, axis=1)
        floor = tl.maximum(tl.abs(x_min) * floor_ratio, _SCALE_FLOOR)
        scale = tl.math.div_rn(tl.maximum(x_max - x_min, floor), tl.full((BLOCK_T,), levels, tl.float32))
        zero = tl.math.div_rn(-x_min, scale)
        # wider than the pair's dtype stores: its widest grid, centred on the midrange (`quantize._minmax_rows`)
        wide = scale > pair_max
        centred = levels / 2 - tl.math.div_rn(x_min * 0.5 + x_max * 0.5, tl.full((BLOCK_T,), pair_max, tl.float32))
        scale = tl.where(wide, pair_max, scale)
        zero = tl.where(wide, centred, zero)
    zero = tl.minimum(tl.maximum(zero, -pair_max), pair_max)  # `quantize.storable`
    COMPACT_PAIRS: tl.constexpr = z_ptr.dtype.element_ty == tl.uint8
    if COMPACT_PAIRS:  # codes on the stored grid, from the clipped row for min-max
        scale_code, zero_code, scale, zero = _compact_pair(scale, zero, BITS)
    q = tl.math.div_rn(x, scale[:, None]) + zero[:, None] + 0.5
    q = tl.minimum(tl.maximum(tl.floor(q), 0.0), levels).to(tl.int32)

    if BITS == 3:  # bit-sliced: the low 2 bits as 2-bit codes, then the top bit as 1-bit codes
        packed = _pack(q & 3, 2, D, BLOCK_T)
        top_packed = _pack(q >> 2, 1, D, BLOCK_T)
    else:
        packed = _pack(q, BITS, D, BLOCK_T)
    offs_c = tl.arange(0, packed.shape[1])
    c_base = c_ptr + b.to(tl.int64) * scb + h.to(tl.int64) * sch
    out_t = (o0 + offs_t).to(tl.int64)
    tl.store(c_base + out_t[:, None] * sct + offs_c[None, :], packed, mask=row_ok[:, None])
    if BITS == 3:
        offs_top = packed.shape[1] + tl.arange(0, top_packed.shape[1])
        tl.store(c_base + out_t[:, None] * sct + offs_top[None, :], top_packed, mask=row_ok[:, None])
    z_base = z_ptr + b.to(tl.int64) * szb + h.to(tl.int64) * szh + out_t * szt
    if COMPACT_PAIRS:
        tl.store(z_base, scale_code.to(tl.uint8), mask=row_ok)
        tl.store(z_base + 1, zero_code.to(tl.uint8), mask=row_ok)
    else:
        tl.store(z_base, round_to(scale, z_ptr.dtype.element_ty), mask=row_ok)
        tl.store(z_base + 1, round_to(zero, z_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["n", "size"])
def _demote_kernel(
    kx_ptr, kxb, kxh, kxt, kr_ptr, krh, krk, kc_ptr, kcb, kch, kct, kz_ptr, kzb, kzh, kzt, k_clip, k_floor, k_max,
    vx_ptr, vxb, vxh, vxt, vr_ptr, vrh, vrk, vc_ptr, vcb, vch, vct, vz_ptr, vzb, vzh, vzt, v_clip, v_floor, v_max,
    n, flag_ptr, at_ptr, size, lost_ptr,
    D: tl.constexpr, BITS: tl.constexpr, K_ROT: tl.constexpr, V_ROT: tl.constexpr, NUM_TENSORS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SIGMA: tl.constexpr, STEP: tl.constexpr, HAS_FLAG: tl.constexpr,
    HAS_AT: tl.constexpr,
):
    o0 = 0
    if HAS_AT:  # whole history buffers: `interface.block_start`
        at = tl.load(at_ptr)
        fits = at + 2 * n <= size
        o0 = tl.where(fits, at, size - n)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            demoted = tl.load(flag_ptr) if HAS_FLAG else n
            tl.store(lost_ptr, tl.where(fits, 0, demoted))
    if HAS_FLAG:  # a counted decode step demotes only when the device says its window is full
        if tl.load(flag_ptr) == 0:
            return
    t0 = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    b = tl.program_id(2) // NUM_TENSORS
    which = tl.program_id(2) % NUM_TENSORS
    if which == 0:
        _demote_tensor(kx_ptr, kxb, kxh, kxt, kr_ptr, krh, krk, kc_ptr, kcb, kch, kct, kz_ptr, kzb, kzh, kzt,
                       b, h, t0, n, o0, k_clip, k_floor, k_max, D, BITS, K_ROT, BLOCK_T, BLOCK_K, SIGMA, STEP)
    else:
        _demote_tensor(vx_ptr, vxb, vxh, vxt, vr_ptr, vrh, vrk, vc_ptr, vcb, vch, vct, vz_ptr, vzb, vzh, vzt,
                       b, h, t0, n, o0, v_clip, v_floor, v_max, D, BITS, V_ROT, BLOCK_T, BLOCK_K, SIGMA, STEP)


def _tensor_args(bits, x, rotation, clip_ratio, codes, scale_zero):
    d = x.shape[-1]
    if x.stride(-1) != 1 or codes.stride(-1) != 1 or scale_zero.stride(-1) != 1:
        raise ValueError("demote_rows needs a unit stride along head_dim for inputs and outputs")
    if rotation is None:
        rot, rot_head_stride, rot_row_stride = x, 0, 0  # unused pointer
    else:
        if rotation.dtype != torch.float32 or rotation.stride(-1) != 1:
            rotation = rotation.float().contiguous()
        rot = rotation
        rot_head_stride = rotation.stride(0) if rotation.dim() == 3 else 0
        rot_row_stride = rotation.stride(-2)
    idx = clip_index(clip_ratio, d)
    levels = 2**bits - 1
    # compact pairs are rounded from the encoder's float32 pair (`quantize.quantize_rows`)
    pair_dtype = torch.float32 if scale_zero.dtype == COMPACT else scale_zero.dtype
    floor_ratio = levels / zero_limit(pair_dtype)
    return (x, *x.stride()[:3], rot, rot_head_stride, rot_row_stride, codes, *codes.stride()[:3],
            scale_zero, *scale_zero.stride()[:3], -1 if idx is None else idx, floor_ratio, pair_limit(pair_dtype))


def demote_rows(pairs, bits: int, block_tokens: int = 16, encoder: str = "minmax",
                only_if: torch.Tensor | None = None, at: torch.Tensor | None = None,
                lost: torch.Tensor | None = None) -> None:
    """Quantize one or two tensors in one launch, with the `minmax` or the `sigma` encoder (`quantize`).

    `pairs`: a list of one or two tuples `(x, rotation, clip_ratio, codes_out, scale_zero_out)` with `x`
    `[B, H, n, d]` (the same shape for both), `codes_out` `[B, H, n, d * bits // 8]` uint8 and `scale_zero_out`
    `[B, H, n, 2]` (float, or uint8: compact pairs); the outputs are written in place (views into the history
    buffers are fine). `only_if` (integer `[1]` on the device, optional): the kernel writes nothing where it holds
    0.

    `at` (int32 `[1]` on the device) with `lost` (int32 `[1]`, written): the outputs are whole history buffers
    `[B, H, capacity, ...]` and the rows go to `[at, at + n)`; their last n rows are never counted, so a block
    that would reach them goes there instead, and `lost` says how many tokens were lost that way (`only_if`'s
    value, or n, for such a block; else 0). This is `ReferenceBackend.demote_kv_at`.
    """
    if not 1 <= len(pairs) <= 2:
        raise ValueError(f"demote_rows takes one or two tensors, got {len(pairs)}")
    x = pairs[0][0]
    batch, heads, n, d = x.shape
    if (at is None) != (lost is None):
        raise ValueError("demote_rows takes `at` and `lost` together")
    rows = pairs[0][3].shape[2] if at is not None else n
    if at is not None and rows < n:
        raise ValueError(f"history buffers of {rows} rows cannot take a block of {n}")
    for px, _, _, codes, sz in pairs:
        if px.shape != x.shape:
            raise ValueError(f"demote_rows needs keys and values of one shape, got {tuple(px.shape)} and {tuple(x.shape)}")
        if codes.shape != (batch, heads, rows, d * bits // 8) or codes.dtype != torch.uint8:
            raise ValueError(f"codes_out must be uint8 {(batch, heads, rows, d * bits // 8)}, got {codes.dtype} {tuple(codes.shape)}")
        if sz.shape != (batch, heads, rows, 2):
            raise ValueError(f"scale_zero_out must be {(batch, heads, rows, 2)}, got {tuple(sz.shape)}")
    if encoder not in KERNEL_ENCODERS:
        raise ValueError(f"encoder={encoder!r}: the demotion kernel encodes {KERNEL_ENCODERS}")
    if n == 0:
        if lost is not None:
            lost.zero_()
        return
    if not kernel_head_dim(d):
        raise ValueError(f"head_dim={d}: the kernels need a power of two from 64 to 256")
    args = [_tensor_args(bits, *p) for p in pairs]
    if len(args) == 1:
        args.append(args[0])
    grid = (triton.cdiv(n, block_tokens), heads, batch * len(pairs))
    with launch_device(x):
        launch(
            _demote_kernel, grid,
            *args[0], *args[1], n, x if only_if is None else only_if, x if at is None else at, rows,
            x if lost is None else lost,
            D=d, BITS=bits, K_ROT=pairs[0][1] is not None, V_ROT=pairs[-1][1] is not None,
            NUM_TENSORS=len(pairs), BLOCK_T=block_tokens, BLOCK_K=min(d, 32), SIGMA=encoder == "sigma",
            STEP=GAUSSIAN_UNIFORM_STEP[bits] if encoder == "sigma" else 1.0, HAS_FLAG=only_if is not None,
            HAS_AT=at is not None, num_warps=4,
        )
