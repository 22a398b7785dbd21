"""Packed quantization codes inside the kernels: 2-, 3- and 4-bit planes as exact small-integer values, and the
per-row (scale, zero) words (float pairs, or compact one-byte codes: `quantize`, 7).

Layout (`reference.quantize.pack_codes`): a row of D codes is packed as quarters, quarter c (elements
[c*D/4, (c+1)*D/4)) at bit 2c of bytes [0, D/4) for 2 bits, and at bit 4*(c//2) of bytes [0, D/4) (c even) or
[D/4, D/2) (c odd) for 4 bits. 3 bits are the 2-bit layout plus a top-bit block: the top bit of element e is bit
e // (D/8) of byte D/4 + e % (D/8), so quarter c's first half (eighth 2c) is at bit 2c and its second half (eighth
2c + 1) at bit 2c + 1 of bytes [D/4, 3D/8). Planes are centred (code - 2^(bits-1), and the zero point likewise) so
that value sums stay small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_hf.kernels.reference.quantize import COMPACT_SCALE_BIAS, COMPACT_SCALE_STEPS

_COMPACT_SCALE_BIAS = tl.constexpr(COMPACT_SCALE_BIAS)
_COMPACT_SCALE_STEPS = tl.constexpr(COMPACT_SCALE_STEPS)

# the kernels' element type of each (scale, zero) pair dtype (uint8: compact codes)
SCALE_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                torch.uint8: tl.uint8}
# a token's (scale, zero) pair read as one integer (`scale_zero`)
PAIR_WORDS = {torch.float16: torch.int32, torch.bfloat16: torch.int32, torch.float32: torch.int64,
              torch.uint8: torch.int16}


@triton.jit
def load_code_bytes(rows, cols, ok, QW: tl.constexpr, BITS: tl.constexpr):
    """The packed bytes `code_plane` takes, (lo_bytes, hi_bytes), for quarter positions `cols` (w in [0, D/4))
    of the rows starting at `rows` (uint8 pointers; `cols`, `rows` and the mask `ok` broadcast to the tile).

    2 bits: bytes [0, D/4) twice. 4 bits: bytes [0, D/4) and [D/4, D/2). 3 bits: bytes [0, D/4) and, for each w,
    its top-bit byte D/4 + w % (D/8) shifted right by one in the quarter's second half, so that every quarter c
    finds its top bit at bit 2c (module docstring)."""
    lo_bytes = tl.load(rows + cols, mask=ok, other=0)
    if BITS == 4:
        return lo_bytes, tl.load(rows + cols + QW, mask=ok, other=0)
    elif BITS == 3:
        HALF: tl.constexpr = QW // 2
        top_bytes = tl.load(rows + QW + cols % HALF, mask=ok, other=0)
        return lo_bytes, top_bytes >> (cols >= HALF).to(tl.uint8)
    else:
        return lo_bytes, lo_bytes


@triton.jit
def code_plane(lo_bytes, hi_bytes, c: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """Codes of quarter `c` (elements [c*D/4, (c+1)*D/4)) from the packed bytes minus the centre 2^(BITS-1), as
    exact `DT` values (centred codes keep the value accumulators small: see `attention._quant_split`).

    2 bits: every quarter lives in bytes [0, D/4) at shift 2c. 4 bits: quarters 0, 2 in bytes [0, D/4), quarters
    1, 3 in bytes [D/4, D/2), at shift 0 (quarters 0, 1) or 4 (quarters 2, 3). 3 bits: the 2-bit plane plus 4
    times bit 2c of the aligned top-bit bytes (`load_code_bytes`).
    """
    CENTER: tl.constexpr = 1 << (BITS - 1)
    if BITS == 2:
        return (((lo_bytes >> (2 * c)) & 3).to(tl.int32) - CENTER).to(DT)
    elif BITS == 3:
        code = ((lo_bytes >> (2 * c)) & 3) | (((hi_bytes >> (2 * c)) & 1) << 2)
        return (code.to(tl.int32) - CENTER).to(DT)
    else:
        if c % 2 == 0:
            return (((lo_bytes >> (4 * (c // 2))) & 15).to(tl.int32) - CENTER).to(DT)
        else:
            return (((hi_bytes >> (4 * (c // 2))) & 15).to(tl.int32) - CENTER).to(DT)


# PTX of `unpack2_asm`: bytes spread to 16-bit lanes, plane k masked into the mantissa of the magic 2^(10-2k)
# (k0..k3), then optionally the magic + 2 (c0..c3) subtracted
_UNPACK2_MASK = """
        .reg .b32 lo, hi, m0, m1, m2, m3, k0, k1, k2, k3, c0, c1, c2, c3;
        mov.b32 m0, 0x00030003;
        mov.b32 m1, 0x000C000C;
        mov.b32 m2, 0x00300030;
        mov.b32 m3, 0x00C000C0;
        mov.b32 k0, 0x64006400;
        mov.b32 k1, 0x5C005C00;
        mov.b32 k2, 0x54005400;
        mov.b32 k3, 0x4C004C00;
        mov.b32 c0, 0x64026402;
        mov.b32 c1, 0x5C085C08;
        mov.b32 c2, 0x54205420;
        mov.b32 c3, 0x4C804C80;
        prmt.b32 lo, $8, 0, 0x4140;
        prmt.b32 hi, $8, 0, 0x4342;
        lop3.b32 $0, lo, m0, k0, 0xEA;
        lop3.b32 $1, hi, m0, k0, 0xEA;
        lop3.b32 $2, lo, m1, k1, 0xEA;
        lop3.b32 $3, hi, m1, k1, 0xEA;
        lop3.b32 $4, lo, m2, k2, 0xEA;
        lop3.b32 $5, hi, m2, k2, 0xEA;
        lop3.b32 $6, lo, m3, k3, 0xEA;
        lop3.b32 $7, hi, m3, k3, 0xEA;
"""
_UNPACK2_SUBTRACT = """
        sub.f16x2 $0, $0, c0;
        sub.f16x2 $1, $1, c0;
        sub.f16x2 $2, $2, c1;
        sub.f16x2 $3, $3, c1;
        sub.f16x2 $4, $4, c2;
        sub.f16x2 $5, $5, c2;
        sub.f16x2 $6, $6, c3;
        sub.f16x2 $7, $7, c3;
"""
_UNPACK2_CENTRED = tl.constexpr("{" + _UNPACK2_MASK + _UNPACK2_SUBTRACT + "}")
_UNPACK2_WITH_MAGIC = tl.constexpr("{" + _UNPACK2_MASK + "}")


@triton.jit
def unpack2_asm(packed, WITH_MAGIC: tl.constexpr = False):
    """The four 2-bit planes of uint8 codes minus 2 (see `code_plane`) as exact float16 values, 4 bytes per call:
    bytes are spread to 16-bit lanes (prmt); plane k (bits 2k, 2k+1) is masked in place into the mantissa of
    2^(10-2k), whose mantissa step is 4^-k, so the lane reads 2^(10-2k) + code (lop3: (x & mask_k) | magic_k),
    and magic + 2 is subtracted (sub.f16x2): no shifts, 18 instructions per 16 codes.

    `WITH_MAGIC`: skip the subtraction and return 2^(10-2k) + code (`key_planes` corrects the scores instead).
    Values always take the subtraction: their long sums would carry the 1024s through the tensor cores'
    truncating accumulation and lose precision."""
    if WITH_MAGIC:
        asm: tl.constexpr = _UNPACK2_WITH_MAGIC
    else:
        asm: tl.constexpr = _UNPACK2_CENTRED
    return tl.inline_asm_elementwise(
        asm=asm,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


# PTX of `unpack4_asm`: bytes spread to 16-bit lanes, the low nibble masked into the mantissa of 1024 (step 1), the
# high nibble into that of 64 (step 1/16), then 1024 + 8 and 64 + 8 subtracted (codes centred on 8)
_UNPACK4_CENTRED = tl.constexpr("""{
        .reg .b32 lo, hi, m0, m1, k0, k1, c0, c1;
        mov.b32 m0, 0x000F000F;
        mov.b32 m1, 0x00F000F0;
        mov.b32 k0, 0x64006400;
        mov.b32 k1, 0x54005400;
        mov.b32 c0, 0x64086408;
        mov.b32 c1, 0x54805480;
        prmt.b32 lo, $4, 0, 0x4140;
        prmt.b32 hi, $4, 0, 0x4342;
        lop3.b32 $0, lo, m0, k0, 0xEA;
        lop3.b32 $1, hi, m0, k0, 0xEA;
        lop3.b32 $2, lo, m1, k1, 0xEA;
        lop3.b32 $3, hi, m1, k1, 0xEA;
        sub.f16x2 $0, $0, c0;
        sub.f16x2 $1, $1, c0;
        sub.f16x2 $2, $2, c1;
        sub.f16x2 $3, $3, c1;
}""")


@triton.jit
def unpack4_asm(packed):
    """The two 4-bit planes of uint8 codes (bits 0-3, bits 4-7) minus 8 as exact float16 values, 4 bytes per call,
    by the mantissa trick of `unpack2_asm`: no shifts and no integer-to-float conversions."""
    return tl.inline_asm_elementwise(
        asm=_UNPACK4_CENTRED,
        constraints="=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def magic(c: tl.constexpr):
    """2^(10-2c): the float16 whose mantissa step puts 2-bit plane c in place (`unpack2_asm`)."""
    if c == 0:
        return 1024.0
    elif c == 1:
        return 256.0
    elif c == 2:
        return 64.0
    else:
        return 16.0


@triton.jit
def _with_magic(lo_bytes, c: tl.constexpr, DT: tl.constexpr):
    """2-bit plane c as 2^(10-2c) + code in `DT` (exact), what `unpack2_asm(..., WITH_MAGIC=True)` returns."""
    return (((lo_bytes >> (2 * c)) & 3).to(tl.float32) + magic(c)).to(DT)


@triton.jit
def key_planes(lo_bytes, hi_bytes, BITS: tl.constexpr, DT: tl.constexpr, ASM_UNPACK: tl.constexpr,
                FOLD: tl.constexpr):
    """`code_planes` for the key codes; with `FOLD` (2-bit codes, float16) each plane c is 2^(10-2c) + code
    instead, and the caller subtracts `folded_key_offset` from the scores."""
    if FOLD:
        if ASM_UNPACK:
            return unpack2_asm(lo_bytes, True)
        else:
            return (_with_magic(lo_bytes, 0, DT), _with_magic(lo_bytes, 1, DT), _with_magic(lo_bytes, 2, DT),
                    _with_magic(lo_bytes, 3, DT))
    else:
        return code_planes(lo_bytes, hi_bytes, BITS, DT, ASM_UNPACK)


@triton.jit
def folded_key_offset(q0, q1, q2, q3, q_sum, AXIS: tl.constexpr = 1):
    """What folded key planes add to each score: sum_c 2^(10-2c) rowsum(q_c), plus 2 sum(q) because the
    centred zero point (`scale_zero`) assumes codes minus 2. `AXIS`: the quarters' feature axis."""
    return (tl.sum(q0.to(tl.float32), axis=AXIS) * magic(0) + tl.sum(q1.to(tl.float32), axis=AXIS) * magic(1)
            + tl.sum(q2.to(tl.float32), axis=AXIS) * magic(2) + tl.sum(q3.to(tl.float32), axis=AXIS) * magic(3)
            + 2.0 * q_sum)


@triton.jit
def code_planes(lo_bytes, hi_bytes, BITS: tl.constexpr, DT: tl.constexpr, ASM_UNPACK: tl.constexpr):
    """The four quarters' centred codes (`code_plane`) from `load_code_bytes`'s bytes; `ASM_UNPACK` takes the
    inline-PTX unpacking for 2 and 4 bits (3 bits have none: the shifts and masks of `code_plane`)."""
    if ASM_UNPACK and BITS == 4:
        q0, q2 = unpack4_asm(lo_bytes)
        q1, q3 = unpack4_asm(hi_bytes)
        return q0, q1, q2, q3
    elif ASM_UNPACK and BITS == 2:
        return unpack2_asm(lo_bytes)
    else:
        return (code_plane(lo_bytes, hi_bytes, 0, BITS, DT), code_plane(lo_bytes, hi_bytes, 1, BITS, DT),
                code_plane(lo_bytes, hi_bytes, 2, BITS, DT), code_plane(lo_bytes, hi_bytes, 3, BITS, DT))


@triton.jit
def compact_scale(code):
    """The scale of compact scale codes (float32, 0..255): 2^((code - 128) / 16) (`quantize.compact_scale`)."""
    return tl.exp2((code - _COMPACT_SCALE_BIAS) / _COMPACT_SCALE_STEPS)


@triton.jit
def compact_zero(code, BITS: tl.constexpr):
    """The zero point of compact zero codes (float32, 0..255) for `BITS`-bit codes: [0, 255] onto [-1, L + 1]
    (`quantize.compact_zero`)."""
    SPAN: tl.constexpr = 2**BITS + 1
    return code * (SPAN / 255.0) - 1.0


@triton.jit
def scale_zero(word, SZ_DT: tl.constexpr, BITS: tl.constexpr):
    """(scale, zero - 2^(BITS-1)) in float32 from one (scale, zero) pair read as a single integer (int16 for
    compact pairs, `SZ_DT` uint8; int32 for 16-bit pairs; int64 for float32 pairs): one load per token instead of
    two strided ones. The zero point is centred like the codes (`code_plane`)."""
    if SZ_DT == tl.uint8:
        # little-endian: the scale code is the low byte
        codes = word.to(tl.int32) & 0xFFFF
        scale = compact_scale((codes & 0xFF).to(tl.float32))
        zero = compact_zero((codes >> 8).to(tl.float32), BITS) - (1 << (BITS - 1))
    elif SZ_DT == tl.float32:
        scale = (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        zero = ((word >> 32) & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True) - (1 << (BITS - 1))
    else:
        scale = (word & 0xFFFF).to(tl.int16).to(SZ_DT, bitcast=True).to(tl.float32)
        zero = ((word >> 16) & 0xFFFF).to(tl.int16).to(SZ_DT, bitcast=True).to(tl.float32) - (1 << (BITS - 1))
    return scale, zero
