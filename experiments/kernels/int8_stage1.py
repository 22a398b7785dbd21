"""Offline prototype (not used by the package): stage-1 history loop with int8 tensor-core dots.

2-bit planes are unpacked to int8 by inline PTX (shift + and 0x03030303); scores and P·V run as int8 MMAs with
the query and p*scale split into int8 hi + lo. Compiled for sm_90 without a GPU to count the loop's SASS:

    python experiments/kernels/int8_stage1.py [--interleave]

`--interleave` addresses value codes stored 4 tokens per byte group (byte j of token t at
(t // 4) * 4 * D/4 + 4 j + t % 4). Results (bench/RESULTS.md, runs 19-21 section): 1,311 instructions per
warp-tile, 1,400 interleaved, vs 1,327 for the fp16 default (`python bench/compile_stage1.py --loops`).
"""

import argparse
import os
import sys

import triton
import triton.language as tl
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from compile_stage1 import H200, disassemble, loop_mixes  # noqa: E402

_PLANES = tl.constexpr("""{
 .reg .b32 t;
 and.b32 $0, $4, 0x03030303;
 shr.b32 t, $4, 2;
 and.b32 $1, t, 0x03030303;
 shr.b32 t, $4, 4;
 and.b32 $2, t, 0x03030303;
 shr.b32 t, $4, 6;
 and.b32 $3, t, 0x03030303;
}""")


@triton.jit
def planes_i8(packed):
    return tl.inline_asm_elementwise(asm=_PLANES, constraints="=r,=r,=r,=r,r", args=[packed],
                                     dtype=(tl.int8, tl.int8, tl.int8, tl.int8), is_pure=True, pack=4)


@triton.jit
def kern(kc, vc, kz, vz, q_ptr, o_ptr, N, skt, D: tl.constexpr, BLOCK_N: tl.constexpr, BM: tl.constexpr,
         INTERLEAVE: tl.constexpr):
    QW: tl.constexpr = D // 4
    offs_w = tl.arange(0, QW)
    rows = tl.arange(0, BM)
    pid = tl.program_id(0)
    kc = kc + pid.to(tl.int64) * N * skt
    vc = vc + pid.to(tl.int64) * N * skt
    qf = tl.load(q_ptr + rows[:, None] * D + tl.arange(0, D)[None, :])
    qs = tl.max(tl.abs(qf), axis=1) / 127.0
    qs = tl.where(qs == 0, 1.0, qs)
    x = qf / qs[:, None]
    qh = tl.extra.cuda.libdevice.rint(x)
    ql = tl.extra.cuda.libdevice.rint((x - qh) * 256.0)
    qh = qh.to(tl.int8)
    ql = tl.minimum(ql, 127.0).to(tl.int8)
    qsum = tl.sum(qf, axis=1)
    # the four quarters (elements [c*D/4, (c+1)*D/4)) of hi and lo
    qh0, qh1 = tl.split(tl.permute(tl.reshape(qh, (BM, 2, D // 2)), (0, 2, 1)))
    qh0a, qh0b = tl.split(tl.permute(tl.reshape(qh0, (BM, 2, QW)), (0, 2, 1)))
    qh1a, qh1b = tl.split(tl.permute(tl.reshape(qh1, (BM, 2, QW)), (0, 2, 1)))
    ql0, ql1 = tl.split(tl.permute(tl.reshape(ql, (BM, 2, D // 2)), (0, 2, 1)))
    ql0a, ql0b = tl.split(tl.permute(tl.reshape(ql0, (BM, 2, QW)), (0, 2, 1)))
    ql1a, ql1b = tl.split(tl.permute(tl.reshape(ql1, (BM, 2, QW)), (0, 2, 1)))
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    zacc = tl.zeros((BM,), tl.float32)
    a0 = tl.zeros((QW, BM), tl.float32)
    a1 = tl.zeros((QW, BM), tl.float32)
    a2 = tl.zeros((QW, BM), tl.float32)
    a3 = tl.zeros((QW, BM), tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ok = offs_n < N
        kb = tl.load(kc + offs_n[:, None].to(tl.int64) * skt + offs_w[None, :], mask=ok[:, None], other=0)
        if INTERLEAVE:
            vb = tl.load(vc + (offs_n[None, :] // 4).to(tl.int64) * (4 * skt) + offs_w[:, None] * 4
                         + offs_n[None, :] % 4,
                         mask=ok[None, :], other=0)
        else:
            vb = tl.load(vc + offs_n[None, :].to(tl.int64) * skt + offs_w[:, None], mask=ok[None, :], other=0)
        kzw = tl.load(kz + offs_n, mask=ok, other=0)
        vzw = tl.load(vz + offs_n, mask=ok, other=0)
        ks = (kzw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        kzero = ((kzw >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        vs = (vzw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        vzero = ((vzw >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        k0, k1, k2, k3 = planes_i8(kb)
        acc_h = tl.dot(k0, tl.trans(qh0a), out_dtype=tl.int32)
        acc_h = tl.dot(k1, tl.trans(qh0b), acc_h, out_dtype=tl.int32)
        acc_h = tl.dot(k2, tl.trans(qh1a), acc_h, out_dtype=tl.int32)
        acc_h = tl.dot(k3, tl.trans(qh1b), acc_h, out_dtype=tl.int32)
        acc_l = tl.dot(k0, tl.trans(ql0a), out_dtype=tl.int32)
        acc_l = tl.dot(k1, tl.trans(ql0b), acc_l, out_dtype=tl.int32)
        acc_l = tl.dot(k2, tl.trans(ql1a), acc_l, out_dtype=tl.int32)
        acc_l = tl.dot(k3, tl.trans(ql1b), acc_l, out_dtype=tl.int32)
        qc = (acc_h.to(tl.float32) + acc_l.to(tl.float32) * (1.0 / 256.0)) * qs[None, :]
        s = (qc - kzero[:, None] * qsum[None, :]) * ks[:, None]
        s = tl.where(ok[:, None], s, float("-inf"))
        tmax = tl.max(s, axis=0)
        m_new = tl.maximum(m_i, tmax)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
        smax = tl.max(vs, axis=0)
        u = tl.exp2(tmax - m_new) * smax
        w = p * vs[:, None]
        zacc = zacc * alpha + tl.sum(w * vzero[:, None], axis=0)
        xw = w * (32512.0 / tl.maximum(u, 1e-30))[None, :]
        xi = tl.extra.cuda.libdevice.rint(xw).to(tl.int32)
        wh = (xi + 128) >> 8
        wl = (xi - (wh << 8)).to(tl.int8)
        wh = wh.to(tl.int8)
        v0, v1, v2, v3 = planes_i8(vb)
        f = (u * (1.0 / 32512.0))[None, :]
        t0 = (tl.dot(v0, wh, out_dtype=tl.int32).to(tl.float32) * 256.0
              + tl.dot(v0, wl, out_dtype=tl.int32).to(tl.float32)) * f
        t1 = (tl.dot(v1, wh, out_dtype=tl.int32).to(tl.float32) * 256.0
              + tl.dot(v1, wl, out_dtype=tl.int32).to(tl.float32)) * f
        t2 = (tl.dot(v2, wh, out_dtype=tl.int32).to(tl.float32) * 256.0
              + tl.dot(v2, wl, out_dtype=tl.int32).to(tl.float32)) * f
        t3 = (tl.dot(v3, wh, out_dtype=tl.int32).to(tl.float32) * 256.0
              + tl.dot(v3, wl, out_dtype=tl.int32).to(tl.float32)) * f
        a0 = tl.fma(a0, alpha[None, :], t0)
        a1 = tl.fma(a1, alpha[None, :], t1)
        a2 = tl.fma(a2, alpha[None, :], t2)
        a3 = tl.fma(a3, alpha[None, :], t3)
    o = o_ptr + pid * D * BM
    tl.store(o + offs_w[:, None] * BM + rows[None, :], a0 - zacc[None, :])
    tl.store(o + QW * BM + offs_w[:, None] * BM + rows[None, :], a1)
    tl.store(o + 2 * QW * BM + offs_w[:, None] * BM + rows[None, :], a2)
    tl.store(o + 3 * QW * BM + offs_w[:, None] * BM + rows[None, :], a3 + l_i[None, :])

def compile_prototype(dim: int, interleave: bool, num_warps: int = 2):
    signature = dict(kc="*u8", vc="*u8", kz="*i32", vz="*i32", q_ptr="*fp32", o_ptr="*fp32", N="i32", skt="i32",
                     D="constexpr", BLOCK_N="constexpr", BM="constexpr", INTERLEAVE="constexpr")
    constants = dict(D=dim, BLOCK_N=128, BM=8, INTERLEAVE=interleave)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7)}
    return triton.compile(ASTSource(kern, signature, constants, attrs), target=H200,
                          options=dict(num_warps=num_warps, num_stages=3))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--interleave", action="store_true")
    args = parser.parse_args()
    for count, ops in loop_mixes(disassemble(compile_prototype(args.dim, args.interleave))[1]):
        print(f"loop: {count} instructions per warp-tile, {ops}")
