"""Reference quantizer: the ground truth every kernel is tested against.

Per row (one token of one KV head, the whole head_dim; rows are already rotated):
1. clip: `thr = sort(|x|)[int(ratio * d)]`, `x = clamp(x, -thr, thr)` (skipped when ratio is None);
2. asymmetric min-max: `scale = max(max - min, floor) / L`, `zero = -min / scale` (a float, in code units),
   with `L = 2**bits - 1`;
3. codes: `q = clamp(floor(x / scale + zero + 0.5), 0, L)` (round half up);
4. the (scale, zero) pair is stored in `scale_dtype`; `dequantize` computes `(q - zero) * scale` in float32.
5. opt-in (`encoder="lloyd"`, `OscarConfig.encoder`): Lloyd-Max iterations on the uniform grid refine the min-max
   (codes, scale, zero) to the row's least-squares uniform quantizer; same format, same dequantizer.
6. opt-in (`encoder="sigma"`): the grid is the mean-squared-error-optimal uniform quantizer of a Gaussian with the
   row's mean m and standard deviation s (rotated rows are close to Gaussian): `scale = STEP[bits] * s`,
   `zero = L / 2 - m / scale`, codes as in 3 (values beyond the outer levels saturate, so no clip is applied).

7. compact pairs (`scale_dtype=torch.uint8`, `OscarConfig(scale_dtype="compact")`): the pair is two bytes, 2
   bits per element less at head_dim 64. The encoder's float scale is rounded *up* to a power of 2^(1/16),
   `scale = 2^((s - 128) / 16)` with the byte s in 0..255 (scales from 2^-8 to 2^7.94; larger ones saturate), so
   the grid still spans what the encoder chose, at most 4.4% coarser; the grid's centre stays where the encoder
   put it and the zero point becomes the byte z, `zero = z (L + 2) / 255 - 1` (within [-1, L + 1]); codes are
   then taken on that stored grid as in 3 (from the clipped row for min-max). Same dequantizer: `(q - zero) * scale`.

`floor` is 1e-8, raised for float16 storage so that |zero| stays below `ZERO_LIMIT_FP16` (only degenerate,
near-constant rows are affected: without it their zero point would overflow float16).

8. saturation: finite rows always give finite pairs and finite reads (`saturate`, `storable`), so that one huge K/V
value cannot turn a row's attention NaN for the rest of decoding. Rows within these limits (every real K/V row)
quantize exactly as if they were not there:
- rows are first saturated to `[-VALUE_LIMIT, VALUE_LIMIT]` (2^56), far beyond any real K/V row but small enough
  that every intermediate (the range, the sum of squares of `sigma`, Lloyd's squared errors, `x / scale`) stays
  finite in float32;
- a scale above the largest finite value of `scale_dtype` (65504 for float16: a 2-bit row spanning more than
  3 * 65504) is saturated to it; min-max then centres the grid on the row's midrange, `zero = L / 2 -
  (min + max) / 2 / scale` (both extremes saturate alike), sigma keeps its grid centred on the mean;
- zero is clamped to the finite range of `scale_dtype`; codes are then taken on that grid as in 3, so the values
  beyond it saturate to the outer codes;
- Lloyd never keeps a refined pair that its dtype stores as inf; compact pairs saturate by construction (7), and
  the float32 pair they start from is finite after the first point.

Packing is "split-planar": with `c = 8 // bits` codes per byte and `n = d // c`, byte j holds elements
j, j+n, ..., j+(c-1)n at bit offsets 0, bits, ..., (c-1)*bits. At 2 bits that is the OSCAR reference's
"quartered" layout: byte j = q[j] | q[j+d/4] << 2 | q[j+d/2] << 4 | q[j+3d/4] << 6. A width that does not divide 8
is bit-sliced (`CODE_SLICES`): 3-bit codes are their low 2 bits packed as 2-bit codes (bytes [0, d/4)) followed by
their top bit packed as 1-bit codes (bytes [d/4, 3d/8): byte j bit m holds element j + m*d/8).
"""

from __future__ import annotations

import torch

SCALE_FLOOR = 1e-8
ZERO_LIMIT_FP16 = 32768.0
VALUE_LIMIT = 2.0**56  # see the module docstring (saturation); 256 squares of 2^57 stay below float32's 2^128
ENCODERS = ("minmax", "lloyd", "sigma")
LLOYD_ITERATIONS = 6
# step of the MSE-optimal uniform quantizer of a unit Gaussian with 2**bits levels (Max 1960)
GAUSSIAN_UNIFORM_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352}


def clip_index(ratio: float | None, head_dim: int) -> int | None:
    """Index into the ascending sorted |x| row that gives the clip threshold; None means no clipping."""
    if ratio is None or ratio <= 0:
        return None
    return min(max(int(ratio * head_dim), 0), head_dim - 1)


def clip_rows(x: torch.Tensor, ratio: float | None) -> torch.Tensor:
    """Symmetric per-row clamp at the |x| order statistic. `x`: float32 `[..., d]`."""
    idx = clip_index(ratio, x.shape[-1])
    if idx is None:
        return x
    thr = x.abs().sort(dim=-1).values[..., idx : idx + 1]
    return torch.maximum(torch.minimum(x, thr), -thr)


COMPACT = torch.uint8  # the scale dtype that means compact (one-byte) scale and zero codes
COMPACT_SCALE_STEPS = 16  # scale codes per octave
COMPACT_SCALE_BIAS = 128


def compact_scale(code: torch.Tensor) -> torch.Tensor:
    return torch.exp2((code.float() - COMPACT_SCALE_BIAS) / COMPACT_SCALE_STEPS)


def compact_zero(code: torch.Tensor, bits: int) -> torch.Tensor:
    span = float(2**bits + 1)  # [-1, L + 1]
    return code.float() * (span / 255.0) - 1.0


def pair_bytes(scale_dtype: torch.dtype) -> int:
    """Bytes of one row's (scale, zero) pair."""
    return 2 * scale_dtype.itemsize


def compact_rows(x: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor) -> tuple:
    """The compact pair for float32 `scale`/`zero` `[...]` chosen by an encoder for rows `x` (already clipped):
    (codes, pair bytes), see the module docstring (7)."""
    levels = float(2**bits - 1)
    steps = torch.ceil(torch.log2(scale) * COMPACT_SCALE_STEPS - 1e-4) + COMPACT_SCALE_BIAS
    scale_code = steps.clamp_(0, 255)
    stored_scale = compact_scale(scale_code)
    centre = (levels / 2 - zero) * scale
    wanted_zero = levels / 2 - centre / stored_scale
    zero_code = torch.round((wanted_zero + 1.0) * (255.0 / (levels + 2))).clamp_(0, 255)
    stored_zero = compact_zero(zero_code, bits)
    codes = torch.floor(x / stored_scale[..., None] + stored_zero[..., None] + 0.5).clamp_(0, levels)
    return codes.to(torch.uint8), torch.stack([scale_code, zero_code], dim=-1).to(torch.uint8)


def zero_limit(scale_dtype: torch.dtype) -> float:
    """Largest |zero| the scale dtype stores safely (inf where the dtype's range is fp32-like)."""
    return ZERO_LIMIT_FP16 if scale_dtype == torch.float16 else float("inf")


def pair_limit(scale_dtype: torch.dtype) -> float:
    """Largest finite value of a float pair dtype: where the scale and |zero| saturate (`storable`)."""
    return torch.finfo(scale_dtype).max


def saturate(x: torch.Tensor) -> torch.Tensor:
    """Rows clamped to `[-VALUE_LIMIT, VALUE_LIMIT]` (a no-op on any real K/V row), see the module docstring."""
    return x.clamp(-VALUE_LIMIT, VALUE_LIMIT)


def storable(scale: torch.Tensor, zero: torch.Tensor, scale_dtype: torch.dtype) -> tuple:
    """float32 (scale, zero) clamped to what `scale_dtype` stores as finite numbers: values at or below the dtype's
    largest finite value never round to inf. A no-op except on saturated rows."""
    limit = pair_limit(scale_dtype)
    return scale.clamp(max=limit), zero.clamp(-limit, limit)


def quantize_rows(
    x: torch.Tensor, bits: int, clip_ratio: float | None, scale_dtype: torch.dtype, encoder: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows of `x` `[..., d]`.

    Returns `codes` uint8 `[..., d]` (unpacked, values 0..2**bits-1) and `scale_zero` `[..., 2]` in
    `scale_dtype` (scale, zero interleaved). `encoder="lloyd"` refines the min-max result (`lloyd_refine`); the
    stored format and `dequantize_rows` are the same for both encoders.
    """
    if encoder not in ENCODERS:
        raise ValueError(f"encoder={encoder!r}: expected one of {ENCODERS}")
    x = saturate(x.float())
    if scale_dtype == COMPACT:
        if encoder == "lloyd":
            raise ValueError("the lloyd encoder refines float pairs; compact pairs take minmax or sigma")
        _, pair = quantize_rows(x, bits, clip_ratio, torch.float32, encoder)
        rows = clip_rows(x.float(), clip_ratio) if encoder == "minmax" else x.float()
        return compact_rows(rows, bits, pair[..., 0], pair[..., 1])
    if encoder == "sigma":
        return _sigma_rows(x, bits, scale_dtype)
    codes, scale_zero = _minmax_rows(x, bits, clip_ratio, scale_dtype)
    if encoder == "lloyd":
        return lloyd_refine(x, codes, scale_zero, bits, scale_dtype)
    return codes, scale_zero


def _minmax_rows(x, bits, clip_ratio, scale_dtype):
    x = clip_rows(x.float(), clip_ratio)
    levels = float(2**bits - 1)
    lo = x.amin(dim=-1)
    hi = x.amax(dim=-1)
    floor = torch.clamp(lo.abs() * (levels / zero_limit(scale_dtype)), min=SCALE_FLOOR)
    # divide by a tensor: torch's CUDA division by a Python scalar multiplies by its reciprocal (not IEEE), which
    # would make this reference differ between devices by an ulp
    scale = torch.maximum(hi - lo, floor) / torch.full_like(hi, levels)
    zero = -lo / scale
    limit = torch.full_like(hi, pair_limit(scale_dtype))
    wide = scale > limit
    # a grid wider than the dtype stores: the widest one it does, centred so that both extremes saturate alike
    centred = torch.full_like(hi, levels / 2) - (lo * 0.5 + hi * 0.5) / limit
    scale, zero = storable(torch.where(wide, limit, scale), torch.where(wide, centred, zero), scale_dtype)
    codes = torch.floor(x / scale[..., None] + zero[..., None] + 0.5).clamp_(0, levels).to(torch.uint8)
    scale_zero = torch.stack([scale, zero], dim=-1).to(scale_dtype)
    return codes, scale_zero


def _sigma_rows(x, bits, scale_dtype):
    x = x.float()
    levels = float(2**bits - 1)
    mean = x.mean(dim=-1)
    std = (x - mean[..., None]).square().mean(dim=-1).sqrt()
    floor = torch.clamp(mean.abs() * (levels / zero_limit(scale_dtype)), min=SCALE_FLOOR)
    scale = torch.maximum(std * GAUSSIAN_UNIFORM_STEP[bits], floor).clamp(max=pair_limit(scale_dtype))
    scale, zero = storable(scale, torch.full_like(mean, levels / 2) - mean / scale, scale_dtype)
    codes = torch.floor(x / scale[..., None] + zero[..., None] + 0.5).clamp_(0, levels).to(torch.uint8)
    return codes, torch.stack([scale, zero], dim=-1).to(scale_dtype)


def lloyd_refine(
    x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor, bits: int, scale_dtype: torch.dtype,
    iterations: int = LLOYD_ITERATIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd-Max iterations on a uniform grid, per row, from a min-max start (opt-in `encoder="lloyd"`).

    Alternates (a) the least-squares grid `x ≈ scale · q + offset` for the current codes and (b) nearest-level codes
    for the stored (scale, zero). The row's squared error against the *unclipped* `x` never increases: the best
    (codes, scale_zero) seen is kept per row. Same format as min-max: dequantize with `(q - zero) * scale`.
    """
    x = saturate(x.float())  # squared errors of larger rows would overflow float32
    levels = float(2**bits - 1)
    scale, zero = scale_zero[..., 0].float(), scale_zero[..., 1].float()
    offset = -zero * scale
    best_codes, best_scale_zero = codes, scale_zero
    best_error = (dequantize_rows(codes, scale_zero) - x).square().sum(-1)

    def keep_if_better(candidate_codes, candidate_scale_zero):
        nonlocal best_codes, best_scale_zero, best_error
        error = (dequantize_rows(candidate_codes, candidate_scale_zero) - x).square().sum(-1)
        # a least-squares pair beyond the dtype's range rounds to inf and reads back inf or NaN: never kept (the
        # comparison is false for NaN too; spelled out so that the finite guarantee does not rest on it)
        better = (error < best_error) & torch.isfinite(candidate_scale_zero.float()).all(-1)
        best_error = torch.where(better, error, best_error)
        best_codes = torch.where(better[..., None], candidate_codes, best_codes)
        best_scale_zero = torch.where(better[..., None], candidate_scale_zero, best_scale_zero)

    x_mean = x.mean(-1)
    for _ in range(iterations):
        q = codes.float()
        q_mean = q.mean(-1)
        q_centered = q - q_mean[..., None]
        q_var = q_centered.square().sum(-1)
        fitted = q_var > 0
        scale = torch.where(fitted, (q_centered * (x - x_mean[..., None])).sum(-1) / q_var.clamp_min(1e-30), scale)
        scale = scale.clamp_min(SCALE_FLOOR)
        offset = torch.where(fitted, x_mean - scale * q_mean, offset)
        scale_zero = torch.stack([scale, -offset / scale], -1).to(scale_dtype)
        keep_if_better(codes, scale_zero)
        stored = scale_zero.float()
        codes = torch.floor(x / stored[..., :1] + stored[..., 1:] + 0.5).clamp_(0, levels).to(torch.uint8)
        keep_if_better(codes, scale_zero)
    return best_codes, best_scale_zero


# the code widths a history stores, each as the slices its bits are packed in, low bits first: a width that divides
# 8 is one split-planar slice; 3 bits are the low 2 bits as a 2-bit block then the top bit as a 1-bit block
# (bit-sliced), so a kernel reads a 3-bit row as a 2-bit row plus one bit plane
CODE_SLICES = {2: (2,), 3: (2, 1), 4: (4,)}


def code_slices(bits: int) -> tuple[int, ...]:
    if bits not in CODE_SLICES:
        raise ValueError(f"bits={bits!r}: the history stores codes of {sorted(CODE_SLICES)} bits")
    return CODE_SLICES[bits]


def codes_per_group(bits: int) -> int:
    """The head_dim multiple `bits`-bit codes pack at: the most codes any of its slices puts in a byte."""
    return max(8 // width for width in code_slices(bits))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes `[..., d]` into bytes `[..., d * bits // 8]` (split-planar slices, see module doc)."""
    d = codes.shape[-1]
    if d % codes_per_group(bits):
        raise ValueError(f"head_dim={d} is not a multiple of {codes_per_group(bits)}, the codes packed per byte at "
                         f"{bits} bits")
    blocks, shift = [], 0
    for width in code_slices(bits):
        per_byte = 8 // width
        part = (codes.to(torch.int32) >> shift) & (2**width - 1)
        planes = part.reshape(*codes.shape[:-1], per_byte, d // per_byte)
        shifts = torch.arange(per_byte, dtype=torch.int32, device=codes.device) * width
        blocks.append((planes << shifts[:, None]).sum(dim=-2).to(torch.uint8))
        shift += width
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: bytes `[..., n]` to uint8 codes `[..., n * 8 // bits]`."""
    d = packed.shape[-1] * 8 // bits
    codes, start, shift = None, 0, 0
    for width in code_slices(bits):
        per_byte = 8 // width
        block = packed[..., start : start + d // per_byte].to(torch.int32)
        shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * width
        part = ((block[..., None, :] >> shifts[:, None]) & (2**width - 1)).reshape(*packed.shape[:-1], d)
        codes = part << shift if codes is None else codes | (part << shift)
        start += d // per_byte
        shift += width
    return codes.to(torch.uint8)


def dequantize_rows(codes: torch.Tensor, scale_zero: torch.Tensor, bits: int | None = None) -> torch.Tensor:
    """`(q - zero) * scale` in float32. `codes` `[..., d]` (unpacked), `scale_zero` `[..., 2]` (compact pairs need
    the code width `bits`)."""
    if scale_zero.dtype == COMPACT:
        if bits is None:
            raise ValueError("compact (scale, zero) pairs decode with the code width: pass bits")
        scale, zero = compact_scale(scale_zero[..., 0:1]), compact_zero(scale_zero[..., 1:2], bits)
        return (codes.float() - zero) * scale
    sz = scale_zero.float()
    return (codes.float() - sz[..., 1:2]) * sz[..., 0:1]


def quantize_pack(
    x: torch.Tensor, bits: int, clip_ratio: float | None, scale_dtype: torch.dtype, encoder: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` followed by `pack_codes`: (packed `[..., d*bits/8]` uint8, scale_zero `[..., 2]`)."""
    codes, scale_zero = quantize_rows(x, bits, clip_ratio, scale_dtype, encoder)
    return pack_codes(codes, bits), scale_zero


def unpack_dequantize(packed: torch.Tensor, scale_zero: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 rows `[..., d]` from packed codes and their (scale, zero) pairs."""
    return dequantize_rows(unpack_codes(packed, bits), scale_zero, bits)


def fake_quantize(
    x: torch.Tensor, bits: int, clip_ratio: float | None, scale_dtype: torch.dtype, encoder: str = "minmax"
) -> torch.Tensor:
    """Rows `x` `[..., d]` as the history stores them, read back: `quantize_rows` then `dequantize_rows` (float32)."""
    return dequantize_rows(*quantize_rows(x, bits, clip_ratio, scale_dtype, encoder), bits)


def code_bytes(dim: int, bits: int) -> int:
    """Bytes of `dim` packed codes of `bits` bits (a multiple of `codes_per_group(bits)`)."""
    return dim * bits // 8


def row_bytes(dim: int, bits: int, scale_dtype: torch.dtype) -> int:
    """Bytes one history row (one token of one KV head, keys or values) stores: `dim` codes of `bits` bits and its
    (scale, zero) pair."""
    return code_bytes(dim, bits) + pair_bytes(scale_dtype)
