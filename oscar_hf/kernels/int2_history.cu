// Stage-1 partials over a 2-bit history, hand-written for NVIDIA tensor cores (sm_80+): the decode hot path of
// `attention._quant_split_token_major` (same contract, same rounding points), with register layouts that Triton
// cannot express. Compiled at run time by NVRTC (`cuda_history.py`, which documents the contract); no headers.
//
// One warp per program = (history split, batch row x KV head); 64-token tiles; up to 8 query rows (a GQA group x
// query positions) are the MMA's N. Per lane (g = lane / 4, t = lane % 4), per tile:
//   keys    A = codes [16 tokens x 16 features] per m16n8k16: lane holds tokens 16j+g and 16j+g+8 (j = 0..3), bytes
//           [KB*t, KB*t+KB) of each row; a 32-bit word's even bytes (w) and odd bytes (w >> 8) are masked plane by
//           plane into the mantissa of 2^(10-2c) (one LOP3 per 2 codes; the scores subtract the magic numbers once
//           per row, `q_off`). The features are permuted (free: q is permuted the same way once per program).
//   scores  C = [16 tokens x 8 rows], softmax in registers (row max over the warp by 3 shuffles per row pair).
//   values  A = codesᵀ [16 features x 16 tokens]: lane holds tokens 16j+2t+{0,1,8,9}, bytes [VB*g, VB*g+VB) of
//           each; PRMT pairs two tokens' bytes, LOP3 (+ HSUB2 unless MAGIC_PLANES) give exact codes per 2 codes.
//           B = pᵀ: the score fragment (rounded p * scale) transposed in registers by `movmatrix`.
// Tiles are staged in shared memory by cp.async, STAGES per warp (STAGES - 1 in flight); no block barriers.
// On sm_90 the kernel is a programmatic dependent of the query rotation: it stages its first tiles, then waits
// (griddepcontrol) before it reads the rotated query.

typedef unsigned int u32;
#define NEG_INF __int_as_float(0xff800000)
#ifndef STAGES
#define STAGES 4  // tiles per warp in shared memory (STAGES - 1 in flight): -DSTAGES=...
#endif
#ifndef MAGIC_PLANES
// value planes c (bit c) that keep their magic number (no HSUB2): the output subtracts it times the sum of p*scale;
// plane 0 then reads the byte's copy in the high half of each 16-bit lane, as 1 + code/4: -DMAGIC_PLANES=...
#define MAGIC_PLANES 0
#endif
#ifndef MIN_WARPS_PER_SM
#define MIN_WARPS_PER_SM 1  // programs (one warp each) per SM the registers must allow: -DMIN_WARPS_PER_SM=...
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

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// plane c of 2-bit codes in bits 2c, 2c+1 of a 16-bit lane; 2^(10-2c) as float16, and that + 2 (the centre)
__device__ __forceinline__ u32 plane_mask(int c) { return 0x00030003u << (2 * c); }
__device__ __forceinline__ u32 plane_magic(int c) {
    return c == 0 ? 0x64006400u : c == 1 ? 0x5C005C00u : c == 2 ? 0x54005400u : 0x4C004C00u;
}
__device__ __forceinline__ u32 plane_centre(int c) {
    return c == 0 ? 0x64026402u : c == 1 ? 0x5C085C08u : c == 2 ? 0x54205420u : 0x4C804C80u;
}
__device__ __forceinline__ float magic_value(int c) {
    return c == 0 ? 1024.0f : c == 1 ? 256.0f : c == 2 ? 64.0f : 16.0f;
}

template <int D>
struct Tile {
    static constexpr int KW = D / 64;  // key words per lane per token row (KB = 4 * KW bytes)
    u32 key[4][2][KW];                 // [j][half]: token 16j + 8*half + g, bytes [KB*t, KB*t + KB)
    u32 value[4][4];                   // [j][u]: token 16j + 2t + {0, 1, 8, 9}[u], bytes [VB*g, VB*g + VB)
    u32 key_sz[4][2];                  // (scale, zero) words of the key rows' tokens
    u32 value_sz[4][2];                // ... and their value (scale, zero) words
};

// One tile's stage in shared memory: [key codes 64 x D/4 | value codes 64 x D/4 | key (scale, zero) x 64 | value
// (scale, zero) x 64]. Token row r is stored at row `slot(r)`: the value reads (rows 2t+u of lanes t = 0..3) then
// fall in distinct banks.
template <int D>
struct Stage {
    static constexpr int QW = D / 4;
    static constexpr int VALUES = 64 * QW;
    static constexpr int KEY_SZ = 2 * 64 * QW;
    static constexpr int VALUE_SZ = KEY_SZ + 256;
    static constexpr int BYTES = VALUE_SZ + 256;
};

__device__ __forceinline__ int slot(int row) { return row ^ ((row >> 2) & 1); }

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

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Queue the asynchronous copies of tokens [t0, t0 + 64) into the stage at shared address `dst`: 16-byte chunks of
// code rows, 4-byte (scale, zero) words; tokens from `hi` on are zero-filled (and masked by the scores).
template <int D>
__device__ __forceinline__ void copy_tile(u32 dst, const unsigned char* key_codes, const unsigned char* value_codes,
                                          const u32* key_sz, const u32* value_sz, int t0, int hi, int lane) {
    constexpr int QW = D / 4;
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
        copy16(dst + Stage<D>::VALUES + offset, value_codes + src, bytes);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int row = lane + 32 * k;
        const int token = t0 + row;
        const int bytes = token < hi ? 4 : 0;
        const int src = min(token, hi - 1);
        copy4(dst + Stage<D>::KEY_SZ + 4 * row, key_sz + src, bytes);
        copy4(dst + Stage<D>::VALUE_SZ + 4 * row, value_sz + src, bytes);
    }
}

// This lane's words of a staged tile (the register layout of `Tile`).
template <int D>
__device__ __forceinline__ void read_tile(Tile<D>& tile, const unsigned char* stage, int g, int t) {
    constexpr int QW = D / 4;
    constexpr int KW = D / 64;
    constexpr int KB = 4 * KW;
    constexpr int VB = D / 32;
    const u32* key_sz = reinterpret_cast<const u32*>(stage + Stage<D>::KEY_SZ);
    const u32* value_sz = reinterpret_cast<const u32*>(stage + Stage<D>::VALUE_SZ);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = 16 * j + 8 * half + g;
            const unsigned char* p = stage + slot(row) * QW + KB * t;
            if (KW == 2) {
                uint2 w = *reinterpret_cast<const uint2*>(p);
                tile.key[j][half][0] = w.x;
                tile.key[j][half][KW - 1] = w.y;
            } else {
                tile.key[j][half][0] = *reinterpret_cast<const u32*>(p);
            }
            tile.key_sz[j][half] = key_sz[row];
            tile.value_sz[j][half] = value_sz[row];
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int row = 16 * j + 2 * t + (u & 1) + 8 * (u >> 1);
            const unsigned char* p = stage + Stage<D>::VALUES + slot(row) * QW + VB * g;
            if (VB == 4) {
                tile.value[j][u] = *reinterpret_cast<const u32*>(p);
            } else {
                tile.value[j][u] = *reinterpret_cast<const unsigned short*>(p);
            }
        }
    }
}

__device__ __forceinline__ void scale_zero(u32 word, float& scale, float& zero) {
    scale = half_lo(word);
    zero = half_hi(word);  // not centred: the caller folds the centre 2 into its per-row terms
}

// Plane c of a value pair register: centred codes (code - 2), or with the magic number kept (`MAGIC_PLANES`)
__device__ __forceinline__ u32 value_plane(u32 pair, int c, u32 mask, u32 magic, u32 centre) {
    if ((MAGIC_PLANES >> c) & 1) {
        return c == 0 ? mask_or(pair, 0x03000300u, 0x3C003C00u) : mask_or(pair, mask, magic);
    }
    return hsub2(mask_or(pair, mask, magic), centre);
}

// What the output of value plane c subtracts, given the zero-point term z and the sum P of p*scale:
// out = factor * acc - offset * P - z
__device__ __forceinline__ float value_factor(int c) { return ((MAGIC_PLANES >> c) & 1) && c == 0 ? 4.0f : 1.0f; }
__device__ __forceinline__ float value_offset(int c) {
    if (!((MAGIC_PLANES >> c) & 1)) return 0.0f;
    return c == 0 ? 6.0f : magic_value(c) + 2.0f;
}

template <int D>
struct State {
    float acc[4][D / 64][4];  // [plane][m-tile][C fragment]: features x rows, rotated basis, centred codes
    float z[2], pv[2];        // lane parts of sum_t pv_t zero_t and of sum_t pv_t (pv = p * scale, rounded)
    float m[2], l[2];         // rows 2t, 2t+1: running max (log2), lane part of the sum
};

// One 64-token tile: scores, online softmax, values; `qb` the query's B fragments, `row_sum` / `row_off` the
// rows' sums of the rounded query and the magic-number offset of the folded key planes.
template <int D>
__device__ __forceinline__ void attend_tile(State<D>& st, const Tile<D>& cur, const u32 (&qb)[4][D / 64][2],
                                            const float (&row_sum)[2], const float (&row_off)[2], int t0, int hi,
                                            int g) {
    constexpr int KW = D / 64;
    constexpr int H = D / 64;
    // scores: [16 tokens x 8 rows] per m-tile j, magic numbers folded into the key planes
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float qc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int e = 0; e < KW; ++e) {
                const u32 top = cur.key[j][0][e], bottom = cur.key[j][1][e];
                const u32 mask = plane_mask(c), magic = plane_magic(c);
                mma16816(qc, mask_or(top, mask, magic), mask_or(bottom, mask, magic), mask_or(top >> 8, mask, magic),
                         mask_or(bottom >> 8, mask, magic), qb[c][e][0], qb[c][e][1]);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float scale, zero;
            scale_zero(cur.key_sz[j][i >> 1], scale, zero);
            const int r = i & 1;
            float x = (qc[i] - row_off[r] - zero * row_sum[r]) * scale;
            s[j][i] = (t0 + 16 * j + g + 8 * (i >> 1) < hi) ? x : NEG_INF;
        }
    }
    // online softmax per row (rows 2t, 2t+1: columns i & 1)
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = s[0][r];
#pragma unroll
        for (int j = 0; j < 4; ++j) mx = fmaxf(mx, fmaxf(s[j][r], s[j][r + 2]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(st.m[r], mx);
        alpha[r] = exp2_approx(st.m[r] - m_new);
        st.m[r] = m_new;
    }
    u32 pb[4][2];
    float p_sum[2] = {0.0f, 0.0f}, z_sum[2] = {0.0f, 0.0f}, pv_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float pv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = i & 1;
            const float p = exp2_approx(s[j][i] - st.m[r]);
            float scale, zero;
            scale_zero(cur.value_sz[j][i >> 1], scale, zero);
            pv[i] = round_half(p * scale);
            p_sum[r] += p;
            z_sum[r] += pv[i] * zero;
            pv_sum[r] += pv[i];
        }
        pb[j][0] = transpose8x8(pack_half2(pv[0], pv[1]));
        pb[j][1] = transpose8x8(pack_half2(pv[2], pv[3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.l[r] = st.l[r] * alpha[r] + p_sum[r];
        st.z[r] = st.z[r] * alpha[r] + z_sum[r];
        st.pv[r] = st.pv[r] * alpha[r] + pv_sum[r];
    }
    // values: out[features x rows] += codesᵀ @ pᵀ, each tile summed from zero (the tensor cores truncate)
#pragma unroll
    for (int h = 0; h < H; ++h) {
        u32 pairs[4][2][2];  // [j][tokens +0/+8][row g / g+8]
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int k = 0; k < 2; ++k) {
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const u32 byte = 2 * h + rr;
                    // the byte of each token in both halves of its 16-bit lane (the high copy serves plane 0's magic)
                    pairs[j][k][rr] = byte_perm(cur.value[j][2 * k], cur.value[j][2 * k + 1],
                                                byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12));
                }
            }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 mask = plane_mask(c), magic = plane_magic(c), centre = plane_centre(c);
            float tile_acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                mma16816(tile_acc, value_plane(pairs[j][0][0], c, mask, magic, centre),
                         value_plane(pairs[j][0][1], c, mask, magic, centre),
                         value_plane(pairs[j][1][0], c, mask, magic, centre),
                         value_plane(pairs[j][1][1], c, mask, magic, centre), pb[j][0], pb[j][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) st.acc[c][h][i] = fmaf(st.acc[c][h][i], alpha[i & 1], tile_acc[i]);
        }
    }
}

template <int D>
__device__ void history_partials(
    const float* __restrict__ rotated_query, int sqb, int sqh, int sql,
    const unsigned char* __restrict__ key_codes, int skb, int skh,
    const u32* __restrict__ key_sz, int szb, int szh,
    const unsigned char* __restrict__ value_codes, int svb, int svh,
    const u32* __restrict__ value_sz, int swb, int swh,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ length_ptr,
    int length, int groups, int kv_heads, int q_len, int dense_splits, int split_len,
    int total_splits, int length_from_ptr, int split_multiple, float q_scale) {
    constexpr int QW = D / 4;   // features per plane (bytes per token row)
    constexpr int KW = D / 64;  // key words per lane and token; also k-steps per plane
    constexpr int KB = 4 * KW;
    constexpr int VB = D / 32;  // value bytes per lane and token
    constexpr int H = D / 64;   // value m-tiles per plane

#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");  // the merge, a programmatic dependent, may start
#endif
    const int lane = threadIdx.x;
    const int g = lane >> 2, t = lane & 3;
    const int split = blockIdx.x;
    const int b = blockIdx.y / kv_heads, kvh = blockIdx.y % kv_heads;
    const int rows = groups * q_len;
    const int history_splits = total_splits - dense_splits;
    if (length_from_ptr) {
        length = *length_ptr;
        const int per_split = (length + history_splits - 1) / history_splits;
        split_len = (per_split + split_multiple - 1) / split_multiple * split_multiple;
    }
    const int lo = split * split_len;
    const int hi = min(lo + split_len, length);

    const unsigned char* kc = key_codes + (long long)b * skb + (long long)kvh * skh;
    const unsigned char* vc = value_codes + (long long)b * svb + (long long)kvh * svh;
    const u32* kz = key_sz + (long long)b * szb + (long long)kvh * szh;
    const u32* vz = value_sz + (long long)b * swb + (long long)kvh * swh;

    State<D> st;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int h = 0; h < H; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) st.acc[c][h][i] = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.m[r] = NEG_INF;
        st.l[r] = st.z[r] = st.pv[r] = 0.0f;
    }

    // STAGES - 1 tiles in flight: the copies of tile i + STAGES - 1 are queued before tile i is attended to
    extern __shared__ __align__(16) unsigned char stages[];
    const u32 stages_at = shared_address(stages);
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) {
        if (lo + 64 * k < hi) copy_tile<D>(stages_at + k * Stage<D>::BYTES, kc, vc, kz, vz, lo + 64 * k, hi, lane);
        commit_copies();
    }
#if __CUDA_ARCH__ >= 900
    // launched as a programmatic dependent of the query rotation: its output is read from here on (the codes
    // above were written by kernels that finished before the rotation started)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // rotated query of row g (the MMA's B: k = permuted features, n = row), scaled and rounded to float16
    u32 qb[4][KW][2];
    float q_sum = 0.0f, q_off = 0.0f;
    {
        const bool row_ok = g < rows;
        const int qi = row_ok ? g / groups : 0;
        const int head = kvh * groups + (row_ok ? g % groups : 0);
        const float* q = rotated_query + (long long)b * sqb + (long long)head * sqh + (long long)qi * sql;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float plane_sum = 0.0f;
#pragma unroll
            for (int e = 0; e < KW; ++e) {
                float4 v = row_ok ? *reinterpret_cast<const float4*>(q + c * QW + KB * t + 4 * e)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
                float x0 = round_half(v.x * q_scale), x1 = round_half(v.y * q_scale);
                float x2 = round_half(v.z * q_scale), x3 = round_half(v.w * q_scale);
                // k = 2t, 2t+1 <- even bytes (features +0, +2); k = 2t+8, 2t+9 <- odd bytes (+1, +3)
                qb[c][e][0] = pack_half2(x0, x2);
                qb[c][e][1] = pack_half2(x1, x3);
                plane_sum += (x0 + x1) + (x2 + x3);
            }
            q_sum += plane_sum;
            q_off += plane_sum * magic_value(c);
        }
        q_sum += __shfl_xor_sync(0xffffffffu, q_sum, 1);
        q_sum += __shfl_xor_sync(0xffffffffu, q_sum, 2);
        q_off += __shfl_xor_sync(0xffffffffu, q_off, 1);
        q_off += __shfl_xor_sync(0xffffffffu, q_off, 2);
        // q_off: what the folded key planes (2^(10-2c) + code) add to q . code; raw zero points need no centre
    }
    // this lane's score columns are rows 2t and 2t+1
    float row_sum[2], row_off[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] = __shfl_sync(0xffffffffu, q_sum, (2 * t + r) * 4);
        row_off[r] = __shfl_sync(0xffffffffu, q_off, (2 * t + r) * 4);
    }

    int stage = 0;
    for (int t0 = lo; t0 < hi; t0 += 64) {
        wait_copies<STAGES - 2>();
        __syncwarp();  // every lane's copies of this tile have landed, and the previous tile has been read
        const int ahead = t0 + 64 * (STAGES - 1);
        const int refill = stage == 0 ? STAGES - 1 : stage - 1;
        if (ahead < hi) copy_tile<D>(stages_at + refill * Stage<D>::BYTES, kc, vc, kz, vz, ahead, hi, lane);
        commit_copies();
        Tile<D> tile;
        read_tile<D>(tile, stages + stage * Stage<D>::BYTES, g, t);
        attend_tile<D>(st, tile, qb, row_sum, row_off, t0, hi, g);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    float (&acc)[4][H][4] = st.acc;
    float (&m_i)[2] = st.m;
    float (&l_i)[2] = st.l;

    // the lane parts of l, of the zero-point term and of sum pv, summed over the 8 token groups
    float z_i[2], pv_i[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) {
            l_i[r] += __shfl_xor_sync(0xffffffffu, l_i[r], x);
            st.z[r] += __shfl_xor_sync(0xffffffffu, st.z[r], x);
            st.pv[r] += __shfl_xor_sync(0xffffffffu, st.pv[r], x);
        }
        pv_i[r] = st.pv[r];
        z_i[r] = st.z[r] - 2.0f * pv_i[r];  // centred zero points
    }
    const int hq = kvh * groups;
    const int heads = kv_heads * groups;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 2 * t + r;
        if (row < rows) {
            const int head = hq + row % groups, qi = row / groups;
            const long long part = (((long long)b * heads + head) * q_len + qi) * total_splits + dense_splits + split;
            const float inv = 1.0f / (l_i[r] == 0.0f ? 1.0f : l_i[r]);
            float* o = out + part * D;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
#pragma unroll
                for (int h = 0; h < H; ++h) {
                    const float f = value_factor(c), shift = value_offset(c) * pv_i[r] + z_i[r];
                    float2 v = make_float2((f * acc[c][h][r] - shift) * inv, (f * acc[c][h][2 + r] - shift) * inv);
                    *reinterpret_cast<float2*>(o + c * QW + VB * g + 2 * h) = v;
                }
            }
            if (g == 0) {
                lse[part] = l_i[r] == 0.0f ? NEG_INF : (m_i[r] + __log2f(fmaxf(l_i[r], 1e-30f))) * 0.6931471805599453f;
            }
        }
    }
}

#define HISTORY_KERNEL(NAME, D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32, MIN_WARPS_PER_SM) NAME(                                     \
        const float* rotated_query, int sqb, int sqh, int sql, const unsigned char* key_codes, int skb, int skh, \
        const u32* key_sz, int szb, int szh, const unsigned char* value_codes, int svb, int svh,                \
        const u32* value_sz, int swb, int swh, float* out, float* lse, const int* length_ptr, int length,        \
        int groups, int kv_heads, int q_len, int dense_splits, int split_len, int total_splits,                 \
        int length_from_ptr, int split_multiple, float q_scale) {                                                \
        history_partials<D>(rotated_query, sqb, sqh, sql, key_codes, skb, skh, key_sz, szb, szh, value_codes,    \
                            svb, svh, value_sz, swb, swh, out, lse, length_ptr, length, groups, kv_heads, q_len, \
                            dense_splits, split_len, total_splits, length_from_ptr, split_multiple, q_scale);    \
    }

HISTORY_KERNEL(int2_history_partials_d64, 64)
HISTORY_KERNEL(int2_history_partials_d128, 128)
