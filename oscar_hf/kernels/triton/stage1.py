"""Stage 1 of the tiered attention: split-K partials over the BF16 tiers and the packed 2-, 3- or 4-bit history.

Contract (`attention_partials`): for queries `[B, Hq, Lq, D]` (model basis) and, optionally, their rotated copy
`q @ R_K` (float32), write one partial per (query row, split): the softmax-normalized output (float32, `D`) and the
natural log-sum-exp of its scores (float32, -inf where every key of the split is masked; the output is 0 there).
Splits `[0, dense_splits)` cover the dense keys `[B, Hkv, Ld, D]` (model dtype, model basis); splits
`[dense_splits, dense_splits + history_splits)` cover the history: packed codes `[B, Hkv, N, D * bits / 8]` and
(scale, zero) `[B, Hkv, N, 2]` (float pairs or compact one-byte codes; rotated basis, dequantized on the fly as
`(code - zero) * scale`), or rotated dense rows for an unquantized history. The history partials stay in the
rotated basis: stage 2 (`merge.py`) applies `R_Vᵀ`.

Lengths and split sizes are not specialized on (`do_not_specialize`): a decode step must never meet a new
compilation because a length became a multiple of 16. Nor is the KV head count: a layer split by KV heads
(`oscar-next`) launches runs of one head, and a variant for `Hkv == 1` saves nothing (it only divides program ids)
while compiling it cost a machine's first call about 3 s per variant (`experiments/compile/triton_census.py`).
The history length can also be read from the device (`HistoryTensors.length_ptr`, a pinned history): the split
count stays fixed and each program derives its split from the stored length, so one launch serves every later
length (what a CUDA graph replays).

One program handles `BLOCK_M` query rows of one KV head (rows are (query position, head of the GQA group) pairs,
so all query heads of a group share one read of K/V) and one split. Decode uses `BLOCK_M = 16` rows and many splits
(flash-decoding); a chunk of queries (chunked prefill) uses more row blocks of 16 and fewer splits, dequantizing
tiles on the fly, so memory stays linear in the number of queries (no `[Lq, N]` score matrix is materialized).

Masks: an optional `[B or 1, 1, Lq, Ld + N]` bool (True = attend) or additive float mask over the logical
columns: dense key j maps to column `j + N * (j >= gap_start)`, history key t to `hist_col0 + t`. Without a mask,
`IS_CAUSAL` aligns the queries with the last `Lq` dense keys (history keys are always visible).

Precision: scores and the softmax in float32 (natural-log LSE out, base-2 exponentials inside); the history tier
multiplies float16 copies of the rotated query and of `p * scale` with the exact small-integer codes, centred
(code - 2^(bits-1), zero points likewise) so that the value sums stay small, each tile's products summed from zero
and added to the running sums in float32 (the tensor cores' accumulation truncates); or it works in float32 end to
end when the query is float32. The dense tier takes the model dtype (bf16 P·V like flash-attention, float32 IEEE
dots for float32 models).

History dots come in two orientations (`LaunchConfig.token_major`):
- rows x tokens (`_quant_split`): the rows are the MMA's M, padded to 16;
- tokens x rows (`_quant_split_token_major`): scores `codes @ qᵀ`, output `codesᵀ @ pᵀ`, and the rows are N,
  padded to 8. This is the default for head_dim 64 and 128, where a decode step's few rows per KV head would
  otherwise pad the MMA's M from 4 to 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from oscar_hf.kernels.interface import HistoryTensors
from oscar_hf.kernels.triton.codes import (
    PAIR_WORDS,
    SCALE_DTYPES,
    code_planes,
    folded_key_offset,
    key_planes,
    load_code_bytes,
    scale_zero,
)
from oscar_hf.kernels.triton.common import launch, launch_device
from oscar_hf.kernels.triton.interpreter import interpreting
from oscar_hf.kernels.triton.launch_plan import LaunchConfig, SplitPlan

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _scores_to_log2(s, scaling, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q·k -> scores in log2 units (scaling, optional tanh softcap)."""
    if HAS_SOFTCAP:
        s = s * scaling / softcap
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))  # tanh, overflow-safe at both ends
        return s * _LOG2E
    else:
        return s * (scaling * _LOG2E)


@triton.jit
def _history_query_scale(scaling, HAS_SOFTCAP: tl.constexpr):
    """What the history query is multiplied by before its rounding: the softmax scaling, and without a softcap
    also log2(e), so that the history scores come out in log2 units (`_history_scores_to_log2`)."""
    if HAS_SOFTCAP:
        return scaling
    else:
        return scaling * _LOG2E


@triton.jit
def _history_scores_to_log2(s, softcap, HAS_SOFTCAP: tl.constexpr):
    """History scores (query scaled by `_history_query_scale`) -> log2 units."""
    if HAS_SOFTCAP:
        return _scores_to_log2(s, 1.0, softcap, HAS_SOFTCAP)
    else:
        return s


@triton.jit
def _apply_mask(s, m_ptr, smb, sml, smc, b, qi, col, col_ok, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr):
    """Mask scores `s` [M, N] (log2 units) by key validity and the optional attention mask."""
    return _mask_scores(s, m_ptr, smb, sml, smc, b, qi[:, None], col[None, :], col_ok[None, :], HAS_MASK, MASK_BOOL)


@triton.jit
def _mask_scores(s, m_ptr, smb, sml, smc, b, qi, col, valid, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr):
    """Mask scores `s` (log2 units, either orientation) by `valid` and the optional attention mask; `qi`, `col`
    and `valid` broadcast to `s`."""
    if HAS_MASK:
        ptrs = m_ptr + b.to(tl.int64) * smb + qi.to(tl.int64) * sml + col.to(tl.int64) * smc
        if MASK_BOOL:
            allowed = tl.load(ptrs, mask=valid, other=0)
            valid = valid & (allowed != 0)
        else:
            s = s + tl.load(ptrs, mask=valid, other=0.0).to(tl.float32) * _LOG2E
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _online_update(s, m_i, l_i, AXIS: tl.constexpr = 1):
    """One online-softmax step on log2 scores `s` ([M, N], or [N, M] with `AXIS=0`): (probabilities, rescale
    factor, new max, new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - tl.expand_dims(m_safe, AXIS))
    l_new = l_i * alpha + tl.sum(p, axis=AXIS)
    return p, alpha, m_new, l_new


@triton.jit
def _dense_split(
    q_ptr, sqb, sqh, sql, k_ptr, skb, skh, skt, v_ptr, svb, svh, svt, m_ptr, smb, sml, smc,
    b, kvh, h, qi, row_ok, lo, hi, first_key, Lq, Ld, col_gap_start, col_gap_len, scaling, softcap,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST_DOTS: tl.constexpr,
):
    """Attention of the rows over dense keys [lo, hi) that are >= `first_key`: (unnormalized acc [M, D], row sum,
    row max), log2 units."""
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h[:, None].to(tl.int64) * sqh + qi[:, None].to(tl.int64) * sql
                + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(k_ptr.dtype.element_ty)
    if UPCAST_DOTS:
        q = q.to(tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = (offs_n < hi) & (offs_n >= first_key)
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * skt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST_DOTS:
            k = k.to(tl.float32)
        if q.dtype == tl.float32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = _scores_to_log2(s, scaling, softcap, HAS_SOFTCAP)
        col = offs_n + tl.where(offs_n >= col_gap_start, col_gap_len, 0)
        s = _apply_mask(s, m_ptr, smb, sml, smc, b, qi, col, key_ok, HAS_MASK, MASK_BOOL)
        if IS_CAUSAL:
            s = tl.where(offs_n[None, :] <= (Ld - Lq + qi)[:, None], s, float("-inf"))
        p, alpha, m_i, l_i = _online_update(s, m_i, l_i)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST_DOTS:
            p = p.to(v.dtype).to(tl.float32)
            v = v.to(tl.float32)
        if v.dtype == tl.float32:
            acc = tl.dot(p, v, acc=acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
    return acc, l_i, m_i


@triton.jit
def _qdot(a, b, acc, DT: tl.constexpr):
    if DT == tl.float32:
        return tl.dot(a, b, acc=acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc=acc)


@triton.jit
def _rescale_add_dot(acc, alpha, a, b, DT: tl.constexpr):
    """`acc * alpha + a @ b` with the product summed from zero and added in float32 round-to-nearest: the tensor
    cores' float32 accumulation truncates, and chaining a whole split's tiles through it biases long splits."""
    tile = _qdot(a, b, tl.zeros((a.shape[0], b.shape[1]), tl.float32), DT)
    return tl.fma(acc, alpha, tile)  # not `acc * alpha + tile`, which Triton folds back into the dot's accumulator


@triton.jit
def _history_query(qr_ptr, srb, srh, srl, b, h, qi, row_ok, scaling, D: tl.constexpr, DT: tl.constexpr,
                   TRANSPOSED: tl.constexpr = False):
    """The rotated, scaled query of the rows as four `DT` quarters [M, D/4] (`TRANSPOSED`: [D/4, M], what the
    token-major dots take) and the float32 row sums of the rounded quarters (the zero-point term).

    The rotated query is read from `qr_ptr` (`query_rotation.rotate_query`'s float32 output, or the query itself
    when there is no rotation); `scaling` (`_history_query_scale`: the softmax scaling, times log2(e) without a
    softcap) is folded in before the rounding to `DT`."""
    QW: tl.constexpr = D // 4
    AXIS: tl.constexpr = 0 if TRANSPOSED else 1  # the feature axis of a quarter
    q_rows = tl.expand_dims(qr_ptr + b.to(tl.int64) * srb + h.to(tl.int64) * srh + qi.to(tl.int64) * srl, AXIS)
    offs_w = tl.expand_dims(tl.arange(0, QW), 1 - AXIS)
    ok = tl.expand_dims(row_ok, AXIS)
    q0 = (tl.load(q_rows + offs_w, mask=ok, other=0.0).to(tl.float32) * scaling).to(DT)
    q1 = (tl.load(q_rows + QW + offs_w, mask=ok, other=0.0).to(tl.float32) * scaling).to(DT)
    q2 = (tl.load(q_rows + 2 * QW + offs_w, mask=ok, other=0.0).to(tl.float32) * scaling).to(DT)
    q3 = (tl.load(q_rows + 3 * QW + offs_w, mask=ok, other=0.0).to(tl.float32) * scaling).to(DT)
    q_sum = (tl.sum(q0.to(tl.float32), axis=AXIS) + tl.sum(q1.to(tl.float32), axis=AXIS)
             + tl.sum(q2.to(tl.float32), axis=AXIS) + tl.sum(q3.to(tl.float32), axis=AXIS))
    return q0, q1, q2, q3, q_sum


@triton.jit
def _history_bases(kc_ptr, skb, skh, vc_ptr, svb, svh, kz_ptr, szb, szh, vz_ptr, swb, swh, b, kvh):
    """Row (b, kvh)'s key codes, value codes, key and value (scale, zero) words."""
    b64 = b.to(tl.int64)
    h64 = kvh.to(tl.int64)
    return (kc_ptr + b64 * skb + h64 * skh, vc_ptr + b64 * svb + h64 * svh, kz_ptr + b64 * szb + h64 * szh,
            vz_ptr + b64 * swb + h64 * swh)


@triton.jit
def _tile_scale_zero(kz_base, szt, vz_base, swt, offs_n, tok_ok, SZ_DT: tl.constexpr, BITS: tl.constexpr):
    """Key scale, key zero, value scale, value zero (float32, zeros centred) of the tile's tokens."""
    k_scale, k_zero = scale_zero(tl.load(kz_base + offs_n * szt, mask=tok_ok, other=0), SZ_DT, BITS)
    v_scale, v_zero = scale_zero(tl.load(vz_base + offs_n * swt, mask=tok_ok, other=0), SZ_DT, BITS)
    return k_scale, k_zero, v_scale, v_zero


@triton.jit
def _code_bytes(base, stride, offs_n, tok_ok, offs_w, QW: tl.constexpr, BITS: tl.constexpr,
                TOKENS_AS_ROWS: tl.constexpr):
    """The tile's packed code bytes (`codes.load_code_bytes`) as [N, D/4] tiles (`TOKENS_AS_ROWS`) or [D/4, N]."""
    if TOKENS_AS_ROWS:
        return load_code_bytes(base + offs_n[:, None].to(tl.int64) * stride, offs_w[None, :], tok_ok[:, None],
                               QW, BITS)
    else:
        return load_code_bytes(base + offs_n[None, :].to(tl.int64) * stride, offs_w[:, None], tok_ok[None, :],
                               QW, BITS)


@triton.jit
def _quant_split(
    qr_ptr, srb, srh, srl,
    kc_ptr, skb, skh, skt, kz_ptr, szb, szh, szt,
    vc_ptr, svb, svh, svt, vz_ptr, swb, swh, swt,
    m_ptr, smb, sml, smc,
    b, kvh, h, qi, row_ok, lo, hi, hist_col0, scaling, softcap,
    D: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DT: tl.constexpr,
    ASM_UNPACK: tl.constexpr, SZ_DT: tl.constexpr,
):
    """Attention of the rows over history tokens [lo, hi) read from packed codes, in the rotated basis, with the
    rows as the MMA's M dimension (scores [M, N]).

    score = scale_t * (q·code_t - zero_t * sum(q)); out = sum_t p_t scale_t code_t - sum_t p_t scale_t zero_t.
    Returns the four quarter accumulators [M, D/4] (zero-point term already removed), row sum and row max.
    """
    QW: tl.constexpr = D // 4
    offs_w = tl.arange(0, QW)
    q_scale = _history_query_scale(scaling, HAS_SOFTCAP)
    q0, q1, q2, q3, q_sum = _history_query(qr_ptr, srb, srh, srl, b, h, qi, row_ok, q_scale, D, DT)
    kc_base, vc_base, kz_base, vz_base = _history_bases(kc_ptr, skb, skh, vc_ptr, svb, svh, kz_ptr, szb, szh,
                                                        vz_ptr, swb, swh, b, kvh)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    zero_acc = tl.zeros((BLOCK_M,), tl.float32)
    acc0 = tl.zeros((BLOCK_M, QW), tl.float32)
    acc1 = tl.zeros((BLOCK_M, QW), tl.float32)
    acc2 = tl.zeros((BLOCK_M, QW), tl.float32)
    acc3 = tl.zeros((BLOCK_M, QW), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < hi
        kb_lo, kb_hi = _code_bytes(kc_base, skt, offs_n, tok_ok, offs_w, QW, BITS, True)
        vb_lo, vb_hi = _code_bytes(vc_base, svt, offs_n, tok_ok, offs_w, QW, BITS, True)
        k_scale, k_zero, v_scale, v_zero = _tile_scale_zero(kz_base, szt, vz_base, swt, offs_n, tok_ok, SZ_DT, BITS)

        k0, k1, k2, k3 = code_planes(kb_lo, kb_hi, BITS, DT, ASM_UNPACK)
        qc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        qc = _qdot(q0, tl.trans(k0), qc, DT)
        qc = _qdot(q1, tl.trans(k1), qc, DT)
        qc = _qdot(q2, tl.trans(k2), qc, DT)
        qc = _qdot(q3, tl.trans(k3), qc, DT)
        s = (qc - q_sum[:, None] * k_zero[None, :]) * k_scale[None, :]
        s = _history_scores_to_log2(s, softcap, HAS_SOFTCAP)
        s = _apply_mask(s, m_ptr, smb, sml, smc, b, qi, hist_col0 + offs_n, tok_ok, HAS_MASK, MASK_BOOL)
        p, alpha, m_i, l_i = _online_update(s, m_i, l_i)

        pv = (p * v_scale[None, :]).to(DT)
        zero_acc = zero_acc * alpha + tl.sum(pv.to(tl.float32) * v_zero[None, :], axis=1)
        v0, v1, v2, v3 = code_planes(vb_lo, vb_hi, BITS, DT, ASM_UNPACK)
        acc0 = _rescale_add_dot(acc0, alpha[:, None], pv, v0, DT)
        acc1 = _rescale_add_dot(acc1, alpha[:, None], pv, v1, DT)
        acc2 = _rescale_add_dot(acc2, alpha[:, None], pv, v2, DT)
        acc3 = _rescale_add_dot(acc3, alpha[:, None], pv, v3, DT)
    zero_acc = zero_acc[:, None]
    return acc0 - zero_acc, acc1 - zero_acc, acc2 - zero_acc, acc3 - zero_acc, l_i, m_i


@triton.jit
def _quant_split_token_major(
    qr_ptr, srb, srh, srl,
    kc_ptr, skb, skh, skt, kz_ptr, szb, szh, szt,
    vc_ptr, svb, svh, svt, vz_ptr, swb, swh, swt,
    m_ptr, smb, sml, smc,
    b, kvh, h, qi, row_ok, lo, hi, hist_col0, scaling, softcap,
    D: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DT: tl.constexpr,
    ASM_UNPACK: tl.constexpr, SZ_DT: tl.constexpr, FOLD_K: tl.constexpr,
):
    """`_quant_split` with the tokens as the MMA's M dimension: scores are `codes @ qᵀ` [N, M] and the output is
    `codesᵀ @ (p * scale)ᵀ` [D/4, M] per quarter, so a decode row block of 8 (a GQA group of <= 8 heads) pads the
    MMA's 8-wide N instead of its 16-tall M. Same arithmetic and rounding points as `_quant_split`.

    Returns the four transposed quarter accumulators [D/4, M] (zero-point term removed), row sum and row max.
    """
    QW: tl.constexpr = D // 4
    offs_w = tl.arange(0, QW)
    q_scale = _history_query_scale(scaling, HAS_SOFTCAP)
    q0t, q1t, q2t, q3t, q_sum = _history_query(qr_ptr, srb, srh, srl, b, h, qi, row_ok, q_scale, D, DT, True)
    if FOLD_K:
        q_off = folded_key_offset(q0t, q1t, q2t, q3t, q_sum, 0)
    kc_base, vc_base, kz_base, vz_base = _history_bases(kc_ptr, skb, skh, vc_ptr, svb, svh, kz_ptr, szb, szh,
                                                        vz_ptr, swb, swh, b, kvh)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    zero_acc = tl.zeros((BLOCK_M,), tl.float32)
    acc0 = tl.zeros((QW, BLOCK_M), tl.float32)
    acc1 = tl.zeros((QW, BLOCK_M), tl.float32)
    acc2 = tl.zeros((QW, BLOCK_M), tl.float32)
    acc3 = tl.zeros((QW, BLOCK_M), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < hi
        kb_lo, kb_hi = _code_bytes(kc_base, skt, offs_n, tok_ok, offs_w, QW, BITS, True)
        vb_lo, vb_hi = _code_bytes(vc_base, svt, offs_n, tok_ok, offs_w, QW, BITS, False)
        k_scale, k_zero, v_scale, v_zero = _tile_scale_zero(kz_base, szt, vz_base, swt, offs_n, tok_ok, SZ_DT, BITS)

        k0, k1, k2, k3 = key_planes(kb_lo, kb_hi, BITS, DT, ASM_UNPACK, FOLD_K)
        qc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        qc = _qdot(k0, q0t, qc, DT)
        qc = _qdot(k1, q1t, qc, DT)
        qc = _qdot(k2, q2t, qc, DT)
        qc = _qdot(k3, q3t, qc, DT)
        if FOLD_K:
            qc = qc - q_off[None, :]
        s = (qc - k_zero[:, None] * q_sum[None, :]) * k_scale[:, None]
        s = _history_scores_to_log2(s, softcap, HAS_SOFTCAP)
        s = _mask_scores(s, m_ptr, smb, sml, smc, b, qi[None, :], hist_col0 + offs_n[:, None], tok_ok[:, None],
                         HAS_MASK, MASK_BOOL)
        p, alpha, m_i, l_i = _online_update(s, m_i, l_i, 0)

        pv = (p * v_scale[:, None]).to(DT)
        zero_acc = zero_acc * alpha + tl.sum(pv.to(tl.float32) * v_zero[:, None], axis=0)
        v0, v1, v2, v3 = code_planes(vb_lo, vb_hi, BITS, DT, ASM_UNPACK)
        acc0 = _rescale_add_dot(acc0, alpha[None, :], v0, pv, DT)
        acc1 = _rescale_add_dot(acc1, alpha[None, :], v1, pv, DT)
        acc2 = _rescale_add_dot(acc2, alpha[None, :], v2, pv, DT)
        acc3 = _rescale_add_dot(acc3, alpha[None, :], v3, pv, DT)
    zero_acc = zero_acc[None, :]
    return acc0 - zero_acc, acc1 - zero_acc, acc2 - zero_acc, acc3 - zero_acc, l_i, m_i


@triton.jit
def _store_partial(o_rows, lse_rows, acc, l_i, m_i, row_ok, col0, WIDTH: tl.constexpr, WRITE_LSE: tl.constexpr,
                   TRANSPOSED: tl.constexpr = False):
    """Normalize and store `acc` ([M, WIDTH], or [WIDTH, M] when `TRANSPOSED`) at columns [col0, col0 + WIDTH)."""
    offs = col0 + tl.arange(0, WIDTH)
    if TRANSPOSED:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[None, :]
        tl.store(o_rows[None, :] + offs[:, None], out, mask=row_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_rows[:, None] + offs[None, :], out, mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.maximum(l_i, 1e-30))) * _LN2)
        tl.store(lse_rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["Ld", "N", "gap_start", "hist_col0", "dense_splits", "dense_split_len",
                                "hist_split_len", "hist_splits", "total_splits", "head0", "Hq_all", "Hkv"])
def _attention_partials_kernel(
    q_ptr, sqb, sqh, sql,
    qr_ptr, srb, srh, srl,
    k_ptr, skb, skh, skt, v_ptr, svb, svh, svt,
    hk_ptr, shkb, shkh, shkt, hkz_ptr, shzb, shzh, shzt,
    hv_ptr, shvb, shvh, shvt, hvz_ptr, shwb, shwh, shwt,
    m_ptr, smb, sml, smc,
    o_ptr, lse_ptr, n_ptr, ds_ptr, ld_ptr, hs_ptr,
    Lq, Ld, N, G, Hkv, gap_start, hist_col0, dense_splits, dense_split_len, hist_split_len, hist_splits,
    total_splits, head0, Hq_all, scaling, softcap,
    D: tl.constexpr, BITS: tl.constexpr, HIST_QUANT: tl.constexpr, N_FROM_PTR: tl.constexpr,
    HAS_DENSE_START: tl.constexpr, BLOCK_M: tl.constexpr, HAS_HIST_START: tl.constexpr,
    BLOCK_N: tl.constexpr, LD_FROM_PTR: tl.constexpr, BLOCK_NQ: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DT: tl.constexpr,
    UPCAST_DOTS: tl.constexpr, ASM_UNPACK: tl.constexpr, SZ_DT: tl.constexpr, TOKEN_MAJOR: tl.constexpr,
    FOLD_K: tl.constexpr, WAIT_ROTATION: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    WAIT_AT_END: tl.constexpr = False, HISTORY_ONLY: tl.constexpr = False,
):
    if LAUNCH_DEPENDENTS:  # the merge (launched as a programmatic dependent) may start its prologue now
        gdc_launch_dependents()
    split = tl.program_id(0)
    if HISTORY_ONLY:  # the grid covers the history splits alone
        split += dense_splits
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.program_id(2) // Hkv
    kvh = tl.program_id(2) % Hkv
    row_ok = rows < G * Lq
    qi = tl.minimum(rows // G, Lq - 1)  # padding rows repeat the last query (computed, never stored)
    h = kvh * G + rows % G
    # the partial rows of this launch's query heads: heads [head0, head0 + Hkv * G) of Hq_all
    part = ((b * Hq_all + head0 + h).to(tl.int64) * Lq + qi) * total_splits + split
    o_rows = o_ptr + part * D
    lse_rows = lse_ptr + part
    if N_FROM_PTR:
        N = tl.load(n_ptr)
        hist_split_len = tl.cdiv(tl.cdiv(N, hist_splits), BLOCK_NQ) * BLOCK_NQ
    if LD_FROM_PTR:  # the dense rows in use, of a buffer of `Ld` (a compiled decode step's BF16 tier)
        Ld = tl.load(ld_ptr)
    if split < dense_splits:
        lo = split * dense_split_len
        hi = tl.minimum(lo + dense_split_len, Ld)
        if IS_CAUSAL:
            last_q = tl.minimum(tl.program_id(1) * BLOCK_M + BLOCK_M - 1, G * Lq - 1) // G
            hi = tl.minimum(hi, Ld - Lq + last_q + 1)
        first_key = 0
        if HAS_DENSE_START:
            first_key = tl.load(ds_ptr + b)
        acc, l_i, m_i = _dense_split(
            q_ptr, sqb, sqh, sql, k_ptr, skb, skh, skt, v_ptr, svb, svh, svt, m_ptr, smb, sml, smc,
            b, kvh, h, qi, row_ok, lo, hi, first_key, Lq, Ld, gap_start, N, scaling, softcap,
            D, BLOCK_M, BLOCK_N, HAS_MASK, MASK_BOOL, IS_CAUSAL, HAS_SOFTCAP, UPCAST_DOTS)
        _store_partial(o_rows, lse_rows, acc, l_i, m_i, row_ok, 0, D, True)
    else:
        if WAIT_ROTATION:  # launched as a dependent of the query rotation: its output is read from here on
            gdc_wait()
        lo = (split - dense_splits) * hist_split_len
        hi = tl.minimum(lo + hist_split_len, N)
        if HAS_HIST_START:  # the row's leading history rows are left padding (`demotion.padded_starts`)
            lo = tl.maximum(lo, tl.load(hs_ptr + b))
        if HIST_QUANT:
            if TOKEN_MAJOR:
                acc0, acc1, acc2, acc3, l_i, m_i = _quant_split_token_major(
                    qr_ptr, srb, srh, srl,
                    hk_ptr, shkb, shkh, shkt, hkz_ptr, shzb, shzh, shzt,
                    hv_ptr, shvb, shvh, shvt, hvz_ptr, shwb, shwh, shwt,
                    m_ptr, smb, sml, smc,
                    b, kvh, h, qi, row_ok, lo, hi, hist_col0, scaling, softcap,
                    D, BITS, BLOCK_M, BLOCK_NQ, HAS_MASK, MASK_BOOL, HAS_SOFTCAP, DT,
                    ASM_UNPACK, SZ_DT, FOLD_K)
            else:
                acc0, acc1, acc2, acc3, l_i, m_i = _quant_split(
                    qr_ptr, srb, srh, srl,
                    hk_ptr, shkb, shkh, shkt, hkz_ptr, shzb, shzh, shzt,
                    hv_ptr, shvb, shvh, shvt, hvz_ptr, shwb, shwh, shwt,
                    m_ptr, smb, sml, smc,
                    b, kvh, h, qi, row_ok, lo, hi, hist_col0, scaling, softcap,
                    D, BITS, BLOCK_M, BLOCK_NQ, HAS_MASK, MASK_BOOL, HAS_SOFTCAP, DT,
                    ASM_UNPACK, SZ_DT)
            QW: tl.constexpr = D // 4
            _store_partial(o_rows, lse_rows, acc0, l_i, m_i, row_ok, 0, QW, True, TOKEN_MAJOR)
            _store_partial(o_rows, lse_rows, acc1, l_i, m_i, row_ok, QW, QW, False, TOKEN_MAJOR)
            _store_partial(o_rows, lse_rows, acc2, l_i, m_i, row_ok, 2 * QW, QW, False, TOKEN_MAJOR)
            _store_partial(o_rows, lse_rows, acc3, l_i, m_i, row_ok, 3 * QW, QW, False, TOKEN_MAJOR)
        else:
            # unquantized history: rotated rows in the model dtype, attended with the rotated query
            acc, l_i, m_i = _dense_split(
                qr_ptr, srb, srh, srl, hk_ptr, shkb, shkh, shkt, hv_ptr, shvb, shvh, shvt, m_ptr, smb, sml, smc,
                b, kvh, h, qi, row_ok, lo, hi, 0, Lq, N, 0, hist_col0, scaling, softcap,
                D, BLOCK_M, BLOCK_N, HAS_MASK, MASK_BOOL, False, HAS_SOFTCAP, UPCAST_DOTS)
            _store_partial(o_rows, lse_rows, acc, l_i, m_i, row_ok, 0, D, True)
    if WAIT_AT_END:  # a dependent of a kernel that writes none of its inputs: finish no earlier than it (a merge
        gdc_wait()  # queued after this kernel waits for this one only)


# Triton's interpreter multiplies bfloat16 dot operands as raw integers: there, the dense tier's dots run on
# float32 copies (P rounded to the value dtype first, as on the GPU).
_UPCAST_DOTS = interpreting()


def _check_layouts(query: torch.Tensor, keys: torch.Tensor | None, values: torch.Tensor | None,
                   rotated_query: torch.Tensor | None, dense_start: torch.Tensor | None,
                   history_start: torch.Tensor | None) -> None:
    """Raise `ValueError` for operands the kernel cannot address: a head_dim stride other than 1, or per-row
    starts that are not a contiguous int32 `[B]`."""
    batch = query.shape[0]
    for t in (query, keys, values, rotated_query):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("attention_partials needs a unit stride along head_dim")
    for name, start in (("dense_start", dense_start), ("history_start", history_start)):
        if start is not None and (start.dtype != torch.int32 or start.shape != (batch,) or not start.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous int32 [{batch}], got {start.dtype} {tuple(start.shape)}")


@dataclass(frozen=True)
class _HistoryOperands:
    """The history tier as the kernel reads it: `keys` / `values` (packed codes `[B, Hkv, N, D * bits / 8]`, or
    rotated rows `[B, Hkv, N, D]`) and the (scale, zero) pairs `[B, Hkv, N]`, one integer word per token."""

    length: int  # N, the history rows (0 without a history)
    length_ptr: torch.Tensor | None  # int32 [1] holding N on the device (a pinned history), else None
    keys: torch.Tensor
    key_scale_zero: torch.Tensor
    values: torch.Tensor
    value_scale_zero: torch.Tensor
    quantized: bool
    bits: int
    scale_dtype: tl.dtype  # what a (scale, zero) pair holds

    def pointer_args(self) -> tuple:
        """Keys, key (scale, zero) words, values, value words, each followed by its `[B, Hkv, N]` strides (zeros
        for what the kernel does not read)."""
        rows = bool(self.length)
        words = self.quantized and rows
        return (self.keys, *(self.keys.stride()[:3] if rows else (0, 0, 0)),
                self.key_scale_zero, *(self.key_scale_zero.stride()[:3] if words else (0, 0, 0)),
                self.values, *(self.values.stride()[:3] if rows else (0, 0, 0)),
                self.value_scale_zero, *(self.value_scale_zero.stride()[:3] if words else (0, 0, 0)))


def _history_operands(history: HistoryTensors | None, partial_lse: torch.Tensor) -> _HistoryOperands:
    """The history's kernel operands, its (scale, zero) pairs viewed as integer words (`codes.PAIR_WORDS`). Typed views
    of `partial_lse` stand in for what the kernel does not read, so that the history branch still compiles: 2-bit
    codes and their words without history rows, the words of an unquantized history."""
    hist_len = history.length if history is not None else 0
    if history is None or hist_len == 0:
        codes, words = partial_lse.view(torch.uint8), partial_lse.view(torch.int32)
        return _HistoryOperands(hist_len, None, codes, words, codes, words, True, 2, tl.float16)
    length_ptr = history.length_ptr if hist_len > 0 else None
    if not history.quantized:
        words = partial_lse.view(torch.int32)
        return _HistoryOperands(hist_len, length_ptr, history.keys, words, history.values, words, False,
                                history.bits, tl.float16)
    scale_dtype = SCALE_DTYPES[history.key_scale_zero.dtype]
    word = PAIR_WORDS[history.key_scale_zero.dtype]
    return _HistoryOperands(hist_len, length_ptr, history.keys, history.key_scale_zero.view(word), history.values,
                            history.value_scale_zero.view(word), True, history.bits, scale_dtype)


def _mask_operands(mask: torch.Tensor | None, query: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int], bool]:
    """(mask tensor, its (batch, query, column) strides, whether it is boolean): a bool mask is read as uint8 and
    a broadcast batch or query dimension has stride 0; without a mask the query stands in."""
    if mask is None:
        return query, (0, 0, 0), True
    mask_bool = mask.dtype == torch.bool
    m = mask.view(torch.uint8) if mask_bool else mask
    m_strides = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2) if mask.shape[2] > 1 else 0,
                 mask.stride(3))
    return m, m_strides, mask_bool


def _check_graph_capture(mask: torch.Tensor | None, query: torch.Tensor, history: _HistoryOperands) -> None:
    """Raise `RuntimeError` for a mask over a history whose length is read on the device while a CUDA graph is
    captured: the graph's replays see the history grow, but the mask keeps its captured width."""
    if (history.length_ptr is not None and mask is not None and query.is_cuda
            and torch.cuda.is_current_stream_capturing()):
        raise RuntimeError("a CUDA graph cannot capture a mask over the history: its width would stay the captured "
                           "length while the history grows")


def _split_counts(plan: SplitPlan, dense_only: bool, history_only: bool,
                  partial_splits: int | None) -> tuple[int, int]:
    """(splits per row of the partial buffers, splits this launch covers): the plan's total for a whole launch,
    its dense splits with `dense_only`, every split past the dense ones with `history_only`."""
    if dense_only and history_only:
        raise ValueError("dense_only and history_only exclude each other")
    if partial_splits is None:
        partial_splits = plan.total_splits
    elif partial_splits < plan.total_splits or not (history_only or dense_only):
        raise ValueError(f"partial_splits={partial_splits} needs dense_only or history_only and at least the "
                         f"plan's {plan.total_splits} splits")
    splits = (plan.dense_splits if dense_only else partial_splits - plan.dense_splits if history_only
              else plan.total_splits)
    return partial_splits, splits


def _tensor_args(query: torch.Tensor, keys: torch.Tensor | None, values: torch.Tensor | None,
                 rotated_query: torch.Tensor | None, history: _HistoryOperands, mask_args: tuple,
                 partial_out: torch.Tensor, partial_lse: torch.Tensor, dense_start: torch.Tensor | None,
                 dense_length: torch.Tensor | None, history_start: torch.Tensor | None) -> tuple:
    """The kernel's tensor arguments in its order, each followed by its strides where it has them: query,
    rotated query, dense keys and values (`[B, H, L]` strides; the query stands in for absent ones), the history
    and the mask operands, the partial buffers, then the device-side history length, dense starts, dense length
    and history starts (`partial_lse` stands in for absent ones: the kernel does not read them)."""
    if keys is None:
        keys = values = query
    if rotated_query is None:
        rotated_query = query
    return (
        query, query.stride(0), query.stride(1), query.stride(2),
        rotated_query, rotated_query.stride(0), rotated_query.stride(1), rotated_query.stride(2),
        keys, keys.stride(0), keys.stride(1), keys.stride(2), values, values.stride(0), values.stride(1),
        values.stride(2),
        *history.pointer_args(),
        *mask_args,
        partial_out, partial_lse, partial_lse if history.length_ptr is None else history.length_ptr,
        partial_lse if dense_start is None else dense_start,
        partial_lse if dense_length is None else dense_length,
        partial_lse if history_start is None else history_start,
    )


def _kernel_keywords(query: torch.Tensor, history: _HistoryOperands, mask: torch.Tensor | None, mask_bool: bool,
                     plan: SplitPlan, softcap: float | None, causal: bool, config: LaunchConfig,
                     dense_start: torch.Tensor | None, dense_length: torch.Tensor | None,
                     history_start: torch.Tensor | None, wait_for_rotation: bool, launch_dependents: bool,
                     overlap_prior: bool, history_only: bool) -> dict:
    """The kernel's keyword arguments: the constexprs it is compiled for, then the launch options (warps,
    pipeline stages, register cap, programmatic dependent launch)."""
    hist_dt = tl.float32 if query.dtype == torch.float32 else tl.float16  # the history dots' operand dtype
    return dict(
        D=query.shape[-1], BITS=history.bits, HIST_QUANT=history.quantized, N_FROM_PTR=history.length_ptr is not None,
        HAS_DENSE_START=dense_start is not None, HAS_HIST_START=history_start is not None and history.length > 0,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n_dense,
        LD_FROM_PTR=dense_length is not None,
        BLOCK_NQ=plan.block_n_history, HAS_MASK=mask is not None, MASK_BOOL=mask_bool, IS_CAUSAL=causal,
        HAS_SOFTCAP=softcap is not None, DT=hist_dt, UPCAST_DOTS=_UPCAST_DOTS,
        ASM_UNPACK=config.asm_unpack and hist_dt == tl.float16 and not _UPCAST_DOTS and history.length > 0,
        SZ_DT=history.scale_dtype, TOKEN_MAJOR=config.token_major,
        FOLD_K=config.fold_key_offsets and config.token_major and history.bits == 2 and hist_dt == tl.float16,
        WAIT_ROTATION=wait_for_rotation, LAUNCH_DEPENDENTS=launch_dependents, WAIT_AT_END=overlap_prior,
        HISTORY_ONLY=history_only,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({} if config.max_registers is None else {"maxnreg": config.max_registers}),
        **({"launch_pdl": True} if wait_for_rotation or overlap_prior else {}),
    )


def attention_partials(
    query: torch.Tensor,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    history: HistoryTensors | None,
    rotated_query: torch.Tensor | None,
    mask: torch.Tensor | None,
    plan: SplitPlan,
    scaling: float,
    softcap: float | None,
    causal: bool,
    gap_start: int,
    hist_col0: int,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    kv_heads: int,
    config: LaunchConfig = LaunchConfig(),
    dense_start: torch.Tensor | None = None,
    launch_dependents: bool = False,
    wait_for_rotation: bool = False,
    dense_only: bool = False,
    overlap_prior: bool = False,
    dense_length: torch.Tensor | None = None,
    history_start: torch.Tensor | None = None,
    history_only: bool = False,
    head_offset: int = 0,
    partial_heads: int | None = None,
    partial_splits: int | None = None,
) -> None:
    """Launch stage 1. `query` `[B, Hq, Lq, D]`; `keys`/`values` `[B, Hkv, Ld, D]` (dense tier, may be None when
    `plan.dense_splits == 0`); for the history, `rotated_query` `[B, Hq, Lq, D]` (`query @ R_K` in float32 from
    `query_rotation.rotate_query`, or the query itself without a rotation);
    `partial_out` / `partial_lse`: float32 buffers of at least `B*Hq*Lq*S*D` / `B*Hq*Lq*S` elements, laid out
    as contiguous `[B, Hq, Lq, S, D]` / `[B, Hq, Lq, S]` (flat workspaces are fine); `dense_start` (int32 `[B]`,
    optional): row b skips its first `dense_start[b]` dense keys (left padding, for steps without a mask);
    `launch_dependents`: let a kernel queued after this one with programmatic dependent launch start at once
    (`merge_splits(after_stage1=True)`); `wait_for_rotation`: launch as a programmatic dependent of the kernel
    queued just before (`rotate_query(launch_dependents=True)`, which wrote `rotated_query`): the dense splits
    start at once, the history splits wait for it. `dense_only`: launch the dense splits alone (another kernel,
    `cuda_history.history_partials`, writes the history splits of the same buffers). `overlap_prior` (with
    `dense_only`): launch as a programmatic dependent of the kernel queued just before, which writes none of this
    call's inputs (the CUDA history kernel): the dense programs run beside its tail, then wait for it to finish, so
    that a dependent merge queued after them sees both kernels' partials (with `history_only` the same, beside
    another run's history launch). `dense_length` (int32 `[1]`, optional):
    only the first `dense_length` dense rows are keys (read on the device; the splits are cut for all of them).
    `history_start` (int32 `[B]`, optional): row b skips its first `history_start[b]` history rows (left padding).
    `history_only`: launch the history splits alone (the BF16 tiers' come from another launch). `head_offset` /
    `partial_heads`: this call's query heads are heads `[head_offset, head_offset + Hq)` of partial buffers laid
    out for `partial_heads` query heads (default: Hq, offset 0): one run of KV heads of a split history
    (`kernels.interface.HeadSplitTensors`), whose other runs other launches write. `partial_splits` (with
    `history_only`): the partial buffers hold that many splits per row (default: `plan.total_splits`), more than
    this run's plan cuts when another run of the layer takes more; the launch covers all of them, and the programs
    past the plan's history write empty partials (-inf, 0) that the merge ignores."""
    batch, q_heads, q_len, _ = query.shape
    groups = q_heads // kv_heads
    dense_len = keys.shape[2] if keys is not None else 0
    _check_layouts(query, keys, values, rotated_query, dense_start, history_start)
    hist = _history_operands(history, partial_lse)
    m, m_strides, mask_bool = _mask_operands(mask, query)
    _check_graph_capture(mask, query, hist)
    partial_splits, splits = _split_counts(plan, dense_only, history_only, partial_splits)
    if splits == 0:
        return
    tensors = _tensor_args(query, keys, values, rotated_query, hist, (m, *m_strides), partial_out, partial_lse,
                           dense_start, dense_length, history_start)
    scalars = (q_len, dense_len, hist.length, groups, kv_heads, gap_start, hist_col0, plan.dense_splits,
               plan.dense_split_len, plan.history_split_len, max(plan.history_splits, 1), partial_splits,
               head_offset, q_heads if partial_heads is None else partial_heads, scaling,
               1.0 if softcap is None else softcap)
    keywords = _kernel_keywords(query, hist, mask, mask_bool, plan, softcap, causal, config, dense_start,
                                dense_length, history_start, wait_for_rotation, launch_dependents, overlap_prior,
                                history_only)
    with launch_device(query):
        launch(_attention_partials_kernel, (splits, plan.row_blocks, batch * kv_heads), *tensors, *scalars, **keywords)
