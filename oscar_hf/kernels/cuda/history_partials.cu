// Stage-1 partials over a 2- or 4-bit history, hand-written for NVIDIA tensor cores (sm_80+): the decode hot path
// of `kernels/triton/stage1.py`'s `_quant_split_token_major` (same contract, same rounding points), with register
// layouts that Triton cannot express. Compiled at run time by NVRTC (`kernels/cuda/history.py`, which documents the
// contract); no headers.
//
// Codes are split-planar (`reference/quantize.py`): a token row is RB = D * BITS / 8 bytes, and byte j holds
// features j + c * RB of planes c = 0 .. 8 / BITS - 1 at bit offset BITS * c. Below, written for 2 bits (4 planes
// of D / 4 features); 4-bit rows have 2 planes of D / 2 features, twice the bytes per lane, the same MMAs.
//
// One warp per program = (history split, batch row x KV head); 64-token tiles; up to 8 query rows (a GQA group x
// query positions) are the MMA's N. Per lane (g = lane / 4, t = lane % 4), per tile:
//   keys    A = codes [16 tokens x 16 features] per m16n8k16: lane holds tokens 16j+g and 16j+g+8 (j = 0..3), bytes
//           [KB*t, KB*t+KB) of each row; a 32-bit word's even bytes (w) and odd bytes (w >> 8) are masked plane by
//           plane into the mantissa of 2^(10-2c) (one LOP3 per 2 codes; the scores subtract the magic numbers once
//           per row, `q_off`). The features are permuted (free: q is permuted the same way once per program).
//   scores  C = [16 tokens x 8 rows], softmax in registers (row max over the warp by 3 shuffles per row pair).
//           With at most 4 rows (kernels `_r4`, `Layout`) each MMA scores two token groups instead, half as many
//           elements per lane.
//   values  A = codesᵀ [16 features x 16 tokens]: lane holds tokens 16j+2t+{0,1,8,9}, bytes [VB*g, VB*g+VB) of
//           each; PRMT pairs two tokens' bytes, LOP3 (+ HSUB2 unless MAGIC_PLANES) give exact codes per 2 codes.
//           B = pᵀ: the score fragment (rounded p * scale) transposed in registers by `movmatrix`.
// Whole tiles are staged in shared memory by cp.async, STAGES per warp (STAGES - 1 in flight), a split's partial
// last tile in one more buffer; no block barriers.
// On sm_90 the kernel is a programmatic dependent of the query rotation: it stages its first tiles, then waits
// (griddepcontrol) before it reads the rotated query.

typedef unsigned int u32;
#define NEG_INF __int_as_float(0xff800000)
// Compile-time shape, set by the launcher (`kernels/cuda/history.py`, `CudaHistoryConfig`), which states the
// defaults: STAGES tiles per warp in shared memory (STAGES - 1 in flight); MAGIC_PLANES the value planes c (bit c)
// that keep their magic number (no HSUB2; the output subtracts it times the sum of p*scale; plane 0 then reads the
// byte's copy in the high half of each 16-bit lane, as 1 + code/4); KEY_CHAINS independent score accumulators per
// tile, over its m-tiles (`key_dots`); MIN_WARPS_PER_SM programs (one warp each) per SM the registers must allow;
// CODE_BITS the code width (2 or 4) of the kernels this module holds, or 0: the kernels of runs of both widths.
#if !defined(STAGES) || !defined(MAGIC_PLANES) || !defined(KEY_CHAINS) || !defined(MIN_WARPS_PER_SM) || \
    !defined(CODE_BITS)
#error "history_partials.cu needs -DSTAGES, -DMAGIC_PLANES, -DKEY_CHAINS, -DMIN_WARPS_PER_SM and -DCODE_BITS (see kernels/cuda/history.py)"
#endif

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ float half_lo(u32 x) {
    float f;
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(x));
    return f;
}

__device__ __forceinline__ float half_hi(u32 x) {
    float f;
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(x));
    return f;
}

__device__ __forceinline__ float round_half(float x) { return half_lo(pack_half2(x, 0.0f)); }

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 selector) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// (x & mask) | magic in one LOP3 (ptxas splits it in two when both constants are immediates)
__device__ __forceinline__ u32 mask_or(u32 x, u32 mask, u32 magic) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "r"(mask), "r"(magic));
    return d;
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 d;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
    return d;
}

__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d = a b + c with c in registers of its own (a loop-invariant start value, not copied per tile)
__device__ __forceinline__ void mma16816_from(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1,
                                              const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// Tell the compiler `x` may change here: loop-invariant registers stay allocated instead of being recomputed
template <typename T>
__device__ __forceinline__ void keep(T& x) {
    static_assert(sizeof(T) == 4, "32-bit registers only");
    asm volatile("" : "+r"(*reinterpret_cast<u32*>(&x)));
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The code format: BITS-bit codes of D features, split-planar. Plane c sits in bits [BITS c, BITS (c + 1)) of a
// byte, so masked in place within a 16-bit lane it is the mantissa of 2^(10 - BITS c) + code (the magic number,
// whose last mantissa bit is worth 2^-(BITS c)); the centre is that + 2^(BITS-1), the middle of the code range.
template <int D, int BITS>
struct Codes {
    static_assert(BITS == 2 || BITS == 4, "2- or 4-bit codes");
    static constexpr int PLANES = 8 / BITS;
    static constexpr int RB = D * BITS / 8;  // bytes per token row; also features per plane
    static constexpr int KW = RB / 16;       // key words per lane and token row (KB = 4 KW bytes); k-steps per plane
    static constexpr int KB = RB / 4;        // key bytes per lane and token row
    static constexpr int VB = RB / 8;        // value bytes per lane and token
    static constexpr int VW = VB < 4 ? 1 : VB / 4;  // ... in 32-bit words (2 bytes in the low half of one)
    static constexpr int H = RB / 16;        // value m-tiles per plane
    static constexpr int CENTRE = 1 << (BITS - 1);
    static constexpr int LEVELS = (1 << BITS) - 1;
    __device__ static u32 mask(int c) { return ((1u << BITS) - 1) * 0x00010001u << (BITS * c); }
    __device__ static u32 magic(int c) { return (u32)(25 - BITS * c) * 0x04000400u; }
    __device__ static u32 centre(int c) { return magic(c) + ((u32)CENTRE * 0x00010001u << (BITS * c)); }
};

// The magic number of plane c (`Codes`) as a float: 2^(10 - BITS c)
template <int BITS>
__device__ __forceinline__ float magic_value(int c) { return (float)(1 << (10 - BITS * c)); }

// Which tokens and query rows a lane's score elements hold. ROWS = 8: score m-tile i (of 4) is tokens 16i..16i+15,
// the MMA's 8 columns are the query rows; lane (g, t) holds tokens 16i + g (+8) of rows 2t, 2t+1. ROWS = 4 (at most
// 4 query rows): m-tile i (of 2) is 32 tokens, A row m carries token 32i + m in k 0-7 and token 32i + 16 + m in
// k 8-15, and the query fills B block-diagonally (its rows in columns 0-3 for k 0-7 and in columns 4-7 for k 8-15);
// lane (g, t) holds tokens 32i + 16(t / 2) + g (+8) of rows 2(t % 2), 2(t % 2) + 1: half the score elements per
// lane, and the P.V products split the same way (columns 4-7 sum the second 16 tokens, added at the end).
template <int ROWS>
struct Layout {
    static constexpr int MT = ROWS == 4 ? 2 : 4;  // score m-tiles per 64 tokens
    // token of C-fragment elements 2h, 2h + 1 of m-tile i, relative to the lane's first (`first_token`)
    static constexpr int token_step(int i, int h) { return (ROWS == 4 ? 32 : 16) * i + 8 * h; }
    __device__ static int first_token(int g, int t) { return ROWS == 4 ? 16 * (t >> 1) + g : g; }
    __device__ static int row(int r, int t) { return ROWS == 4 ? 2 * (t & 1) + r : 2 * t + r; }
};

template <int D, int ROWS, int BITS>
struct Tile {
    using C = Codes<D, BITS>;
    static constexpr int MT = Layout<ROWS>::MT;
    u32 key[4][2][C::KW];   // [j][half]: token 16j + 8*half + g, bytes [KB*t, KB*t + KB)
    u32 value[4][4][C::VW]; // [j][u]: token 16j + 2t + {0, 1, 8, 9}[u], bytes [VB*g, VB*g + VB)
    u32 key_sz[MT][2];   // (scale, zero) words of this lane's score tokens (`Layout`)
    u32 value_sz[MT][2]; // ... and their value (scale, zero) words
};

// One tile's stage in shared memory: [key codes 64 x RB | value codes 64 x RB | key (scale, zero) x 64 | value
// (scale, zero) x 64]. Token row r is stored at row `slot(r)`: the value reads (rows 2t+u of lanes t = 0..3) then
// fall in distinct banks. slot flips bit 0 by bit 2 only, so slot(r + 8k) = slot(r) + 8k: a lane's rows are its
// first row's offset plus immediates.
template <int D, int BITS>
struct Stage {
    static constexpr int RB = Codes<D, BITS>::RB;
    static constexpr int VALUES = 64 * RB;
    static constexpr int KEY_SZ = 2 * 64 * RB;
    static constexpr int VALUE_SZ = KEY_SZ + 256;
    static constexpr int BYTES = VALUE_SZ + 256;
};

__device__ __forceinline__ int slot(int row) { return row ^ ((row >> 2) & 1); }

// This lane's byte offsets in a stage (tile rows add immediates); PAIR = bytes of one token's (scale, zero) pair
template <int D, int ROWS, int PAIR, int BITS>
struct LaneOffsets {
    int key, value0, value1, sz, copy;
    __device__ LaneOffsets(int lane, int g, int t) {
        using C = Codes<D, BITS>;
        constexpr int RB = C::RB;
        key = slot(g) * RB + C::KB * t;
        value0 = Stage<D, BITS>::VALUES + slot(2 * t) * RB + C::VB * g;
        value1 = Stage<D, BITS>::VALUES + slot(2 * t + 1) * RB + C::VB * g;
        sz = PAIR * Layout<ROWS>::first_token(g, t);
        copy = slot(16 * lane / RB) * RB + 16 * lane % RB;  // where 16-byte chunk `lane` of a tile's codes goes
    }
};

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 r;
    asm("{.reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a;}" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void copy16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void copy4(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

template <int DST, int SRC>
__device__ __forceinline__ void copy16_at(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0+%1], [%2+%3], 16;" ::"r"(dst), "n"(DST), "l"(src), "n"(SRC)
                 : "memory");
}

template <int DST, int SRC>
__device__ __forceinline__ void copy4_at(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0+%1], [%2+%3], 4;" ::"r"(dst), "n"(DST), "l"(src), "n"(SRC)
                 : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// This lane's sources of the next tile to stage: code chunk lane (of 16 bytes) and the 4 bytes of (scale, zero)
// pairs at byte 4 * lane (float16 pairs: token lane; compact pairs: tokens 2 lane, 2 lane + 1); the tile's other
// chunks and words are immediates away. `Pair` is one token's pair (u32 or, compact, unsigned short).
template <typename Pair>
struct Sources {
    const unsigned char* key;
    const unsigned char* value;
    const Pair* key_sz;
    const Pair* value_sz;
};

// Queue the copies of a whole tile (64 tokens, all present) into the stage at shared address `dst` + this lane's
// chunk offset (`LaneOffsets::copy`) and `dst_sz` + 4 * lane: chunk lane + 32k lands 512k bytes further in both.
// Compact pairs (2 bytes a token) fill their 128 bytes with one word per lane.
template <int D, int BITS, typename Pair, int K = 0>
__device__ __forceinline__ void copy_full_tile(u32 dst, u32 dst_sz, const Sources<Pair>& src) {
    if constexpr (K < Codes<D, BITS>::RB / 8) {
        copy16_at<512 * K, 512 * K>(dst, src.key);
        copy16_at<Stage<D, BITS>::VALUES + 512 * K, 512 * K>(dst, src.value);
        copy_full_tile<D, BITS, Pair, K + 1>(dst, dst_sz, src);
    } else if constexpr (sizeof(Pair) == 2) {
        copy4_at<0, 0>(dst_sz, src.key_sz);
        copy4_at<256, 0>(dst_sz, src.value_sz);
    } else {
        copy4_at<0, 0>(dst_sz, src.key_sz);
        copy4_at<128, 128>(dst_sz, src.key_sz);
        copy4_at<256, 0>(dst_sz, src.value_sz);
        copy4_at<384, 128>(dst_sz, src.value_sz);
    }
}

// Queue the copies of a partial tile: tokens [t0, t0 + 64) into the stage at shared address `dst`, tokens from
// `hi` on zero-filled (and masked by the scores).
template <int D, int BITS, typename Pair>
__device__ __forceinline__ void copy_partial_tile(u32 dst, const unsigned char* key_codes,
                                                  const unsigned char* value_codes, const Pair* key_sz,
                                                  const Pair* value_sz, int t0, int hi, int lane) {
    constexpr int QW = Codes<D, BITS>::RB;
    constexpr int PER_ROW = QW / 16;
#pragma unroll
    for (int k = 0; k < 2 * PER_ROW; ++k) {  // 64 rows x PER_ROW chunks over 32 lanes
        const int chunk = lane + 32 * k;
        const int row = chunk / PER_ROW, part = chunk % PER_ROW;
        const int token = t0 + row;
        const int bytes = token < hi ? 16 : 0;
        const long long src = (long long)min(token, hi - 1) * QW + 16 * part;
        const u32 offset = slot(row) * QW + 16 * part;
        copy16(dst + offset, key_codes + src, bytes);
        copy16(dst + Stage<D, BITS>::VALUES + offset, value_codes + src, bytes);
    }
    if constexpr (sizeof(Pair) == 2) {  // tokens 2 lane, 2 lane + 1 per word; t0 is even, so is the clamped source
        const int row = 2 * lane;
        const int token = t0 + row;
        const int bytes = token + 1 < hi ? 4 : token < hi ? 2 : 0;
        const int src = min(token, (hi - 1) & ~1);
        copy4(dst + Stage<D, BITS>::KEY_SZ + 2 * row, key_sz + src, bytes);
        copy4(dst + Stage<D, BITS>::VALUE_SZ + 2 * row, value_sz + src, bytes);
    } else {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int row = lane + 32 * k;
            const int token = t0 + row;
            const int bytes = token < hi ? 4 : 0;
            const int src = min(token, hi - 1);
            copy4(dst + Stage<D, BITS>::KEY_SZ + 4 * row, key_sz + src, bytes);
            copy4(dst + Stage<D, BITS>::VALUE_SZ + 4 * row, value_sz + src, bytes);
        }
    }
}

// This lane's words of a staged tile (the register layout of `Tile`; a compact pair in the low 16 bits).
// `n` 32-bit words (1, 2 or 4) of a 4n-byte aligned address; `short_word`: one 16-bit word in the low half
template <int N>
__device__ __forceinline__ void read_words(u32 (&w)[N], const unsigned char* p, bool short_word = false) {
    if constexpr (N == 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
    } else if constexpr (N == 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        w[0] = x.x; w[1] = x.y;
    } else {
        w[0] = short_word ? *reinterpret_cast<const unsigned short*>(p) : *reinterpret_cast<const u32*>(p);
    }
}

template <int D, int ROWS, int PAIR, int BITS>
__device__ __forceinline__ void read_tile(Tile<D, ROWS, BITS>& tile, const unsigned char* stage,
                                          const LaneOffsets<D, ROWS, PAIR, BITS>& at) {
    using C = Codes<D, BITS>;
    constexpr int QW = C::RB;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) read_words(tile.key[j][half], stage + at.key + (16 * j + 8 * half) * QW);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const unsigned char* p = stage + (u & 1 ? at.value1 : at.value0) + (16 * j + 8 * (u >> 1)) * QW;
            read_words(tile.value[j][u], p, C::VB == 2);
        }
    }
#pragma unroll
    for (int i = 0; i < Layout<ROWS>::MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int offset = at.sz + PAIR * Layout<ROWS>::token_step(i, h);
            if constexpr (PAIR == 2) {
                tile.key_sz[i][h] = *reinterpret_cast<const unsigned short*>(stage + Stage<D, BITS>::KEY_SZ + offset);
                tile.value_sz[i][h] = *reinterpret_cast<const unsigned short*>(stage + Stage<D, BITS>::VALUE_SZ + offset);
            } else {
                tile.key_sz[i][h] = *reinterpret_cast<const u32*>(stage + Stage<D, BITS>::KEY_SZ + offset);
                tile.value_sz[i][h] = *reinterpret_cast<const u32*>(stage + Stage<D, BITS>::VALUE_SZ + offset);
            }
        }
    }
}

// A token's (scale, zero) in float32; the zero point is not centred: the caller folds the centre into its per-row
// terms. PAIR = 4: two float16s. PAIR = 2: compact codes (`reference/quantize.py`, 7), the scale code in the low
// byte: scale = 2^((s - 128) / 16), zero = z * (L + 2) / 255 - 1 ([0, 255] onto [-1, L + 1]), as
// `triton/codes.py`'s `scale_zero` computes them.
template <int PAIR, int BITS>
__device__ __forceinline__ void scale_zero(u32 word, float& scale, float& zero) {
    if constexpr (PAIR == 2) {
        scale = exp2_approx((float)(int)(word & 0xffu) * 0.0625f - 8.0f);
        zero = (float)(int)((word >> 8) & 0xffu) * ((float)((1 << BITS) + 1) / 255.0f) - 1.0f;
    } else {
        scale = half_lo(word);
        zero = half_hi(word);
    }
}

// Whether value plane c keeps its magic number (`MAGIC_PLANES`; 2-bit codes only: a 4-bit plane 0 has no room in
// the high copy's mantissa, see below)
template <int BITS>
__device__ __forceinline__ bool magic_plane(int c) { return BITS == 2 && ((MAGIC_PLANES >> c) & 1); }

// Plane c of a value pair register: centred codes (code - centre), or with the magic number kept (`magic_plane`;
// plane 0 then reads the byte's high copy in the mantissa of 1.0, as 1 + code / 4)
template <int BITS>
__device__ __forceinline__ u32 value_plane(u32 pair, int c, u32 mask, u32 magic, u32 centre) {
    if (magic_plane<BITS>(c)) {
        return c == 0 ? mask_or(pair, 0x03000300u, 0x3C003C00u) : mask_or(pair, mask, magic);
    }
    return hsub2(mask_or(pair, mask, magic), centre);
}

// What the output of value plane c subtracts, given the zero-point term z and the sum P of p*scale:
// out = factor * acc - offset * P - z
template <int BITS>
__device__ __forceinline__ float value_factor(int c) { return magic_plane<BITS>(c) && c == 0 ? 4.0f : 1.0f; }
template <int BITS>
__device__ __forceinline__ float value_offset(int c) {
    if (!magic_plane<BITS>(c)) return 0.0f;
    return c == 0 ? 6.0f : magic_value<BITS>(c) + 2.0f;
}

template <int D, int BITS>
struct State {
    using C = Codes<D, BITS>;
    float acc[C::PLANES][C::H][4];  // [plane][m-tile][C fragment]: features x columns, rotated basis, centred codes
    float z[2], pv[2];        // lane parts of sum_t pv_t zero_t and of sum_t pv_t (pv = p * scale, rounded)
    float m[2], l[2];         // the lane's rows (`Layout::row`): running max (log2), lane part of the sum
};

// The query's B fragments: [c][e][k half] for ROWS = 8 (row g); for ROWS = 4 [c][e][byte parity][b register], row
// g % 4 in b0 (k 0-7) on lanes g < 4 and in b1 (k 8-15) on lanes g >= 4, zero in the other.
template <int D, int ROWS, int BITS>
using QueryFragments = u32[Codes<D, BITS>::PLANES][Codes<D, BITS>::KW][2][ROWS == 4 ? 2 : 1];

// Scores of one tile before scaling: C fragments of q . (magic + code) over the key planes, started from `init`
// (minus the magic numbers' part, per column) so that they come out as q . code. The products of an m-tile go to
// KEY_CHAINS / (m-tiles) accumulators in turn, summed at the end: dependent MMAs wait for each other's results.
template <int D, int ROWS, int BITS>
__device__ __forceinline__ void key_dots(float (&s)[Layout<ROWS>::MT][4], const Tile<D, ROWS, BITS>& cur,
                                         const QueryFragments<D, ROWS, BITS>& qb, const float (&init)[4]) {
    using C = Codes<D, BITS>;
    constexpr int KW = C::KW;
    constexpr int P = ROWS == 4 ? 2 : 1;  // MMAs per key word and plane (byte parities)
    constexpr int WANTED = KEY_CHAINS / Layout<ROWS>::MT > 1 ? KEY_CHAINS / Layout<ROWS>::MT : 1;
    constexpr int CHAINS = WANTED < C::PLANES * KW * P ? WANTED : C::PLANES * KW * P;
#pragma unroll
    for (int i = 0; i < Layout<ROWS>::MT; ++i) {
        float part[CHAINS][4];
#pragma unroll
        for (int c = 0; c < C::PLANES; ++c) {
            const u32 mask = C::mask(c), magic = C::magic(c);
#pragma unroll
            for (int e = 0; e < KW; ++e) {
#pragma unroll
                for (int p = 0; p < P; ++p) {
                    u32 a[4], b0, b1;
                    if constexpr (ROWS == 4) {  // tokens 32i + {g, g+8} in k 0-7, 32i + 16 + {g, g+8} in k 8-15
                        const u32 w[4] = {cur.key[2 * i][0][e], cur.key[2 * i][1][e], cur.key[2 * i + 1][0][e],
                                          cur.key[2 * i + 1][1][e]};
#pragma unroll
                        for (int x = 0; x < 4; ++x) a[x] = mask_or(w[x] >> (8 * p), mask, magic);
                        b0 = qb[c][e][p][0];
                        b1 = qb[c][e][p][1];
                    } else {  // tokens 16i + {g, g+8}: even bytes in k 0-7, odd bytes in k 8-15
                        const u32 top = cur.key[i][0][e], bottom = cur.key[i][1][e];
                        a[0] = mask_or(top, mask, magic);
                        a[1] = mask_or(bottom, mask, magic);
                        a[2] = mask_or(top >> 8, mask, magic);
                        a[3] = mask_or(bottom >> 8, mask, magic);
                        b0 = qb[c][e][0][0];
                        b1 = qb[c][e][1][0];
                    }
                    const int n = (c * KW + e) * P + p, chain = n % CHAINS;
                    if (n == 0) {
                        mma16816_from(part[0], a[0], a[1], a[2], a[3], b0, b1, init);
                    } else {
                        if (n < CHAINS) part[chain][0] = part[chain][1] = part[chain][2] = part[chain][3] = 0.0f;
                        mma16816(part[chain], a[0], a[1], a[2], a[3], b0, b1);
                    }
                }
            }
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            float sum = part[0][x];
#pragma unroll
            for (int chain = 1; chain < CHAINS; ++chain) sum += part[chain][x];
            s[i][x] = sum;
        }
    }
}

// One 64-token tile: scores, online softmax, values. `row_sum`: the lane's rows' sums of the rounded query; `init`:
// minus the magic-number offset of the folded key planes, per C-fragment element; `remaining` = hi - t0 - the
// lane's first token; `low` = all ones on lanes g < 4 (ROWS = 4: which P.V product a lane's p belongs to).
template <int D, int ROWS, int PAIR, int BITS>
__device__ __forceinline__ void attend_tile(State<D, BITS>& st, const Tile<D, ROWS, BITS>& cur,
                                            const QueryFragments<D, ROWS, BITS>& qb, const float (&row_sum)[2],
                                            const float (&init)[4], int remaining, u32 low) {
    using C = Codes<D, BITS>;
    constexpr int H = C::H;
    constexpr int MT = Layout<ROWS>::MT;
    float s[MT][4];
    key_dots<D, ROWS, BITS>(s, cur, qb, init);
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float scale, zero;
            scale_zero<PAIR, BITS>(cur.key_sz[i][e >> 1], scale, zero);
            const float x = fmaf(-zero, row_sum[e & 1], s[i][e]) * scale;
            s[i][e] = Layout<ROWS>::token_step(i, e >> 1) < remaining ? x : NEG_INF;
        }
    }
    // online softmax per row (the lane's rows: columns e & 1)
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(s[0][r], s[0][r + 2]);
#pragma unroll
        for (int i = 1; i < MT; ++i) mx = fmaxf(mx, fmaxf(s[i][r], s[i][r + 2]));
        if (ROWS == 4) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(st.m[r], mx);
        alpha[r] = exp2_approx(st.m[r] - m_new);
        st.m[r] = m_new;
    }
    // p, rounded p * scale as the P.V product's B (the score fragment transposed by movmatrix), and the sums
    u32 pb[4][2];
    float p_sum[2] = {0.0f, 0.0f}, z_sum[2] = {0.0f, 0.0f}, pv_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float scale, zero;
            scale_zero<PAIR, BITS>(cur.value_sz[i][h], scale, zero);
            const float p0 = exp2_approx(s[i][2 * h] - st.m[0]), p1 = exp2_approx(s[i][2 * h + 1] - st.m[1]);
            const u32 packed = pack_half2(p0 * scale, p1 * scale);
            const float pv0 = half_lo(packed), pv1 = half_hi(packed);
            p_sum[0] += p0;
            p_sum[1] += p1;
            z_sum[0] = fmaf(pv0, zero, z_sum[0]);
            z_sum[1] = fmaf(pv1, zero, z_sum[1]);
            pv_sum[0] += pv0;
            pv_sum[1] += pv1;
            const u32 transposed = transpose8x8(packed);
            if constexpr (ROWS == 4) {
                pb[2 * i][h] = transposed & low;
                pb[2 * i + 1][h] = transposed & ~low;
            } else {
                pb[i][h] = transposed;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.l[r] = st.l[r] * alpha[r] + p_sum[r];
        st.z[r] = st.z[r] * alpha[r] + z_sum[r];
        st.pv[r] = st.pv[r] * alpha[r] + pv_sum[r];
    }
    // values: out[features x columns] += codesᵀ @ pᵀ, each tile summed from zero (the tensor cores truncate)
#pragma unroll
    for (int h = 0; h < H; ++h) {
        u32 pairs[4][2][2];  // [j][tokens +0/+8][row g / g+8]
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int k = 0; k < 2; ++k) {
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const int word = (2 * h + rr) / 4;
                    const u32 byte = (2 * h + rr) % 4;
                    // the byte of each token in both halves of its 16-bit lane (the high copy serves plane 0's magic)
                    pairs[j][k][rr] = byte_perm(cur.value[j][2 * k][word], cur.value[j][2 * k + 1][word],
                                                byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12));
                }
            }
        }
#pragma unroll
        for (int c = 0; c < C::PLANES; ++c) {
            const u32 mask = C::mask(c), magic = C::magic(c), centre = C::centre(c);
            float tile_acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                mma16816(tile_acc, value_plane<BITS>(pairs[j][0][0], c, mask, magic, centre),
                         value_plane<BITS>(pairs[j][0][1], c, mask, magic, centre),
                         value_plane<BITS>(pairs[j][1][0], c, mask, magic, centre),
                         value_plane<BITS>(pairs[j][1][1], c, mask, magic, centre), pb[j][0], pb[j][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) st.acc[c][h][i] = fmaf(st.acc[c][h][i], alpha[i & 1], tile_acc[i]);
        }
    }
}

// One program's split of one KV head row: batch row `b`, KV head `kvh` of the history tensors (whose head stride
// the strides give), whose first query head is `q_head` in `rotated_query` and `p_head` in the partial buffers.
// `Pair`: one token's (scale, zero) pair, u32 (two float16s) or unsigned short (compact codes); the pair strides
// count pairs.
template <int D, int ROWS, typename Pair, int BITS>
__device__ __forceinline__ void history_partials(
    const float* __restrict__ rotated_query, int sqb, int sqh, int sql,
    const unsigned char* __restrict__ key_codes, int skb, int skh,
    const Pair* __restrict__ key_sz, int szb, int szh,
    const unsigned char* __restrict__ value_codes, int svb, int svh,
    const Pair* __restrict__ value_sz, int swb, int swh,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ length_ptr,
    int length, int groups, int b, int kvh, int q_head, int p_head, int q_len, int dense_splits, int split_len,
    int history_splits, int total_splits, int length_from_ptr, int split_multiple, float q_scale, int partial_heads,
    int wait_at_end) {
    using C = Codes<D, BITS>;
    constexpr int QW = C::RB;  // features per plane (bytes per token row)
    constexpr int KW = C::KW;  // key words per lane and token; also k-steps per plane
    constexpr int KB = C::KB;
    constexpr int VB = C::VB;  // value bytes per lane and token
    constexpr int H = C::H;    // value m-tiles per plane
    constexpr int PLANES = C::PLANES;
    constexpr int PAIR = sizeof(Pair);
    constexpr int PAIRS_PER_WORD = 4 / PAIR;  // a lane stages one 4-byte word of each side's pairs per copy

#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");  // the merge, a programmatic dependent, may start
#endif
    const int lane = threadIdx.x;
    const int g = lane >> 2, t = lane & 3;
    const int split = blockIdx.x;
    const int rows = groups * q_len;
    // history_splits: the splits this launch cuts a length read from the device into; its grid may hold more
    // (the partial rows' splits of a layer whose runs of heads take different counts), which stay empty
    if (length_from_ptr) {
        length = *length_ptr;
        const int per_split = (length + history_splits - 1) / history_splits;
        split_len = (per_split + split_multiple - 1) / split_multiple * split_multiple;
    }
    const int lo = split * split_len;
    const int hi = min(lo + split_len, length);

    const unsigned char* kc = key_codes + (long long)b * skb + (long long)kvh * skh;
    const unsigned char* vc = value_codes + (long long)b * svb + (long long)kvh * svh;
    const Pair* kz = key_sz + (long long)b * szb + (long long)kvh * szh;
    const Pair* vz = value_sz + (long long)b * swb + (long long)kvh * swh;
    const LaneOffsets<D, ROWS, PAIR, BITS> at(lane, g, t);

    State<D, BITS> st;
#pragma unroll
    for (int c = 0; c < PLANES; ++c)
#pragma unroll
        for (int h = 0; h < H; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) st.acc[c][h][i] = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.m[r] = NEG_INF;
        st.l[r] = st.z[r] = st.pv[r] = 0.0f;
    }

    // STAGES - 1 whole tiles in flight: the copies of tile i + STAGES - 1 are queued before tile i is attended to.
    // A partial last tile is staged first, into a buffer of its own, so that the loop only copies whole tiles.
    extern __shared__ __align__(16) unsigned char stages[];
    const u32 stages_at = shared_address(stages);
    const int whole_end = lo + max(hi - lo, 0) / 64 * 64;
    if (whole_end < hi) {
        copy_partial_tile<D, BITS, Pair>(stages_at + STAGES * Stage<D, BITS>::BYTES, kc, vc, kz, vz, whole_end, hi,
                                         lane);
        commit_copies();
    }
    Sources<Pair> next = {kc + (long long)lo * QW + 16 * lane, vc + (long long)lo * QW + 16 * lane,
                          kz + lo + PAIRS_PER_WORD * lane, vz + lo + PAIRS_PER_WORD * lane};
    int ahead = lo;
    auto stage_tile = [&](int index) {  // queue the copies of the tile at `ahead` into stage `index`, step on
        const u32 dst = stages_at + index * Stage<D, BITS>::BYTES;
        if (ahead < whole_end) {
            copy_full_tile<D, BITS, Pair>(dst + at.copy, dst + Stage<D, BITS>::KEY_SZ + 4 * lane, next);
        }
        commit_copies();
        ahead += 64;
        next.key += 64 * QW;
        next.value += 64 * QW;
        next.key_sz += 64;
        next.value_sz += 64;
    };
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) stage_tile(k);
#if __CUDA_ARCH__ >= 900
    // launched as a programmatic dependent of the query rotation: its output is read from here on (the codes
    // above were written by kernels that finished before the rotation started). With `wait_at_end`, the kernel
    // before it wrote nothing it reads (another run's history splits): it runs beside it, and waits for it only
    // before finishing, so that a dependent queued after it sees both kernels' partials.
    if (!wait_at_end) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // rotated query (the MMA's B, `QueryFragments`; k = permuted features), scaled and rounded to float16
    QueryFragments<D, ROWS, BITS> qb;
    const u32 low = g < 4 ? 0xffffffffu : 0u;
    float q_sum = 0.0f, q_off = 0.0f;
    {
        const int qrow = ROWS == 4 ? g & 3 : g;
        const bool row_ok = qrow < rows;
        const int qi = row_ok ? qrow / groups : 0;
        const int head = q_head + (row_ok ? qrow % groups : 0);
        const float* q = rotated_query + (long long)b * sqb + (long long)head * sqh + (long long)qi * sql;
#pragma unroll
        for (int c = 0; c < PLANES; ++c) {
            float plane_sum = 0.0f;
#pragma unroll
            for (int e = 0; e < KW; ++e) {
                float4 v = row_ok ? *reinterpret_cast<const float4*>(q + c * QW + KB * t + 4 * e)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
                float x0 = round_half(v.x * q_scale), x1 = round_half(v.y * q_scale);
                float x2 = round_half(v.z * q_scale), x3 = round_half(v.w * q_scale);
                // even bytes (features +0, +2) and odd bytes (+1, +3) of the lane's key word e
                const u32 even = pack_half2(x0, x2), odd = pack_half2(x1, x3);
                if constexpr (ROWS == 4) {
                    qb[c][e][0][0] = even & low;
                    qb[c][e][0][1] = even & ~low;
                    qb[c][e][1][0] = odd & low;
                    qb[c][e][1][1] = odd & ~low;
                } else {
                    qb[c][e][0][0] = even;  // k = 2t, 2t+1
                    qb[c][e][1][0] = odd;   // k = 2t+8, 2t+9
                }
                plane_sum += (x0 + x1) + (x2 + x3);
            }
            q_sum += plane_sum;
            q_off += plane_sum * magic_value<BITS>(c);
        }
        q_sum += __shfl_xor_sync(0xffffffffu, q_sum, 1);
        q_sum += __shfl_xor_sync(0xffffffffu, q_sum, 2);
        q_off += __shfl_xor_sync(0xffffffffu, q_off, 1);
        q_off += __shfl_xor_sync(0xffffffffu, q_off, 2);
        // q_off: what the folded key planes (magic + code) add to q . code; raw zero points need no centre
    }
    // the lane's score columns are rows Layout::row(0, t), row(1, t), held by lanes g = row, t = 0
    float row_sum[2], init[4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] = __shfl_sync(0xffffffffu, q_sum, Layout<ROWS>::row(r, t) * 4);
        init[r] = init[r + 2] = -__shfl_sync(0xffffffffu, q_off, Layout<ROWS>::row(r, t) * 4);
    }
    const int first = Layout<ROWS>::first_token(g, t);

    int stage = 0;
    for (int t0 = lo; t0 < hi; t0 += 64, stage = stage == STAGES - 1 ? 0 : stage + 1) {
        wait_copies<STAGES - 2>();
        __syncwarp();  // every lane's copies of this tile have landed, and the previous tile has been read
        stage_tile(stage == 0 ? STAGES - 1 : stage - 1);
        Tile<D, ROWS, BITS> tile;
        read_tile<D, ROWS, PAIR, BITS>(tile, stages + (t0 < whole_end ? stage : STAGES) * Stage<D, BITS>::BYTES, at);
        // loop-invariant fragments stay in registers (ptxas would rather rebuild the masked query every tile)
        for (auto& x : init) keep(x);
        for (auto& plane : qb)
            for (auto& word : plane)
                for (auto& parity : word)
                    for (auto& x : parity) keep(x);
        attend_tile<D, ROWS, PAIR, BITS>(st, tile, qb, row_sum, init, hi - t0 - first, low);
    }
    float (&acc)[PLANES][H][4] = st.acc;
    float (&m_i)[2] = st.m;
    float (&l_i)[2] = st.l;

    // the lane parts of l, of the zero-point term and of sum pv, summed over the lanes of the same rows; ROWS = 4
    // also adds the P.V columns 4-7 (the second 16 tokens of each 32) to columns 0-3
    float z_i[2], pv_i[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int x = ROWS == 4 ? 2 : 4; x < 32; x <<= 1) {
            l_i[r] += __shfl_xor_sync(0xffffffffu, l_i[r], x);
            st.z[r] += __shfl_xor_sync(0xffffffffu, st.z[r], x);
            st.pv[r] += __shfl_xor_sync(0xffffffffu, st.pv[r], x);
        }
        pv_i[r] = st.pv[r];
        z_i[r] = st.z[r] - (float)C::CENTRE * pv_i[r];  // centred zero points
    }
    if constexpr (ROWS == 4) {
#pragma unroll
        for (int c = 0; c < PLANES; ++c)
#pragma unroll
            for (int h = 0; h < H; ++h)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[c][h][i] += __shfl_xor_sync(0xffffffffu, acc[c][h][i], 2);
    }
    // partial rows: this KV head's query heads are heads [p_head, p_head + groups) of partial_heads
    const int hq = p_head;
    const int heads = partial_heads;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = Layout<ROWS>::row(r, t);
        if (row < rows && (ROWS == 8 || t < 2)) {
            const int head = hq + row % groups, qi = row / groups;
            const long long part = (((long long)b * heads + head) * q_len + qi) * total_splits + dense_splits + split;
            const float inv = 1.0f / (l_i[r] == 0.0f ? 1.0f : l_i[r]);
            float* o = out + part * D;
#pragma unroll
            for (int c = 0; c < PLANES; ++c) {
#pragma unroll
                for (int h = 0; h < H; ++h) {
                    const float f = value_factor<BITS>(c), shift = value_offset<BITS>(c) * pv_i[r] + z_i[r];
                    float2 v = make_float2((f * acc[c][h][r] - shift) * inv, (f * acc[c][h][2 + r] - shift) * inv);
                    *reinterpret_cast<float2*>(o + c * QW + VB * g + 2 * h) = v;
                }
            }
            if (g == 0) {
                lse[part] = l_i[r] == 0.0f ? NEG_INF : (m_i[r] + __log2f(fmaxf(l_i[r], 1e-30f))) * 0.6931471805599453f;
            }
        }
    }
#if __CUDA_ARCH__ >= 900
    if (wait_at_end) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Kernels per head_dim, query rows and pair format (float16 pairs, u32, or compact one-byte codes, `_compact`), for
// the code width CODE_BITS: each width is a module of its own, compiled the first time a history of it is read.
// Program (split, b * kv_heads + kvh); the call's query heads are heads [head0, head0 + kv_heads * groups) of the
// partial buffers' partial_heads.
#define HISTORY_KERNEL(NAME, D, ROWS, PAIR_T)                                                                    \
    extern "C" __global__ void __launch_bounds__(32, MIN_WARPS_PER_SM) NAME(                                     \
        const float* rotated_query, int sqb, int sqh, int sql, const unsigned char* key_codes, int skb, int skh, \
        const PAIR_T* key_sz, int szb, int szh, const unsigned char* value_codes, int svb, int svh,             \
        const PAIR_T* value_sz, int swb, int swh, float* out, float* lse, const int* length_ptr, int length,     \
        int groups, int kv_heads, int q_len, int dense_splits, int split_len, int history_splits,               \
        int total_splits, int length_from_ptr, int split_multiple, float q_scale, int head0, int partial_heads, \
        int wait_at_end) {                                                                                       \
        const int b = blockIdx.y / kv_heads, kvh = blockIdx.y % kv_heads;                                        \
        history_partials<D, ROWS, PAIR_T, CODE_BITS>(                                                            \
            rotated_query, sqb, sqh, sql, key_codes, skb, skh, key_sz, szb, szh, value_codes, svb, svh, value_sz, \
            swb, swh, out, lse, length_ptr, length, groups, b, kvh, kvh * groups, head0 + kvh * groups, q_len,    \
            dense_splits, split_len, history_splits, total_splits, length_from_ptr, split_multiple, q_scale,      \
            partial_heads, wait_at_end);                                                                         \
    }

// A layer's history kept as runs of adjacent KV heads of different code widths and pair formats, read by one launch
// (`HISTORY_RUNS_KERNEL`): run r holds KV heads [head_start, next run's head_start) of the layer, its tensors'
// strides count its own heads, and its splits are its own (`kernels/cuda/history.py`, `RUN_FIELDS`).
struct HistoryRun {
    const unsigned char* key_codes;
    const void* key_sz;
    const unsigned char* value_codes;
    const void* value_sz;
    int skb, skh, szb, szh, svb, svh, swb, swh;
    int head_start, bits, compact, split_len, history_splits;
};
#define MAX_RUNS 4
struct HistoryRuns {
    HistoryRun run[MAX_RUNS];
    int count;
};

template <int D, int ROWS, typename Pair, int BITS>
__device__ __forceinline__ void run_partials(const HistoryRun& r, int kvh, const float* rotated_query, int sqb,
                                             int sqh, int sql, float* out, float* lse, const int* length_ptr,
                                             int length, int groups, int b, int q_len, int dense_splits,
                                             int total_splits, int length_from_ptr, int split_multiple,
                                             float q_scale, int partial_heads, int wait_at_end) {
    history_partials<D, ROWS, Pair, BITS>(
        rotated_query, sqb, sqh, sql, r.key_codes, r.skb, r.skh, static_cast<const Pair*>(r.key_sz), r.szb, r.szh,
        r.value_codes, r.svb, r.svh, static_cast<const Pair*>(r.value_sz), r.swb, r.swh, out, lse, length_ptr,
        length, groups, b, kvh - r.head_start, kvh * groups, kvh * groups, q_len, dense_splits, r.split_len,
        r.history_splits, total_splits, length_from_ptr, split_multiple, q_scale, partial_heads, wait_at_end);
}

// Program (split, b * kv_heads + kvh) over the layer's kv_heads; the query and the partial buffers hold all of the
// layer's query heads. A program past its run's splits writes an empty partial.
#define HISTORY_RUNS_KERNEL(NAME, D, ROWS)                                                                       \
    extern "C" __global__ void __launch_bounds__(32, MIN_WARPS_PER_SM) NAME(                                     \
        const float* rotated_query, int sqb, int sqh, int sql, HistoryRuns runs, float* out, float* lse,         \
        const int* length_ptr, int length, int groups, int kv_heads, int q_len, int dense_splits,                \
        int total_splits, int length_from_ptr, int split_multiple, float q_scale, int partial_heads,            \
        int wait_at_end) {                                                                                       \
        const int b = blockIdx.y / kv_heads, kvh = blockIdx.y % kv_heads;                                        \
        int index = 0;                                                                                           \
        for (int i = 1; i < runs.count; ++i) index = kvh >= runs.run[i].head_start ? i : index;                 \
        const HistoryRun& r = runs.run[index];                                                                   \
        if (r.bits == 4) {                                                                                       \
            if (r.compact) {                                                                                     \
                run_partials<D, ROWS, unsigned short, 4>(r, kvh, rotated_query, sqb, sqh, sql, out, lse,          \
                    length_ptr, length, groups, b, q_len, dense_splits, total_splits, length_from_ptr,          \
                    split_multiple, q_scale, partial_heads, wait_at_end);                                        \
            } else {                                                                                             \
                run_partials<D, ROWS, u32, 4>(r, kvh, rotated_query, sqb, sqh, sql, out, lse, length_ptr,         \
                    length, groups, b, q_len, dense_splits, total_splits, length_from_ptr, split_multiple,       \
                    q_scale, partial_heads, wait_at_end);                                                        \
            }                                                                                                    \
        } else if (r.compact) {                                                                                  \
            run_partials<D, ROWS, unsigned short, 2>(r, kvh, rotated_query, sqb, sqh, sql, out, lse, length_ptr,  \
                length, groups, b, q_len, dense_splits, total_splits, length_from_ptr, split_multiple, q_scale,  \
                partial_heads, wait_at_end);                                                                     \
        } else {                                                                                                 \
            run_partials<D, ROWS, u32, 2>(r, kvh, rotated_query, sqb, sqh, sql, out, lse, length_ptr, length,     \
                groups, b, q_len, dense_splits, total_splits, length_from_ptr, split_multiple, q_scale,          \
                partial_heads, wait_at_end);                                                                     \
        }                                                                                                        \
    }

// the kernels of one code width, named PREFIX_history_partials_d{D}_r{ROWS}[_compact]
#define WIDTH_KERNELS(PREFIX)                                                                  \
    HISTORY_KERNEL(PREFIX##_history_partials_d64_r4, 64, 4, u32)                               \
    HISTORY_KERNEL(PREFIX##_history_partials_d64_r8, 64, 8, u32)                               \
    HISTORY_KERNEL(PREFIX##_history_partials_d128_r4, 128, 4, u32)                             \
    HISTORY_KERNEL(PREFIX##_history_partials_d128_r8, 128, 8, u32)                             \
    HISTORY_KERNEL(PREFIX##_history_partials_d64_r4_compact, 64, 4, unsigned short)            \
    HISTORY_KERNEL(PREFIX##_history_partials_d64_r8_compact, 64, 8, unsigned short)            \
    HISTORY_KERNEL(PREFIX##_history_partials_d128_r4_compact, 128, 4, unsigned short)          \
    HISTORY_KERNEL(PREFIX##_history_partials_d128_r8_compact, 128, 8, unsigned short)

#if CODE_BITS == 2
WIDTH_KERNELS(int2)
#elif CODE_BITS == 4
WIDTH_KERNELS(int4)
#elif CODE_BITS == 0  // runs of both widths
HISTORY_RUNS_KERNEL(runs_history_partials_d64_r4, 64, 4)
HISTORY_RUNS_KERNEL(runs_history_partials_d64_r8, 64, 8)
HISTORY_RUNS_KERNEL(runs_history_partials_d128_r4, 128, 4)
HISTORY_RUNS_KERNEL(runs_history_partials_d128_r8, 128, 8)
#else
#error "CODE_BITS must be 2, 4 or 0 (runs of both)"
#endif
