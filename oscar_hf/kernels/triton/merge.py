"""Stage 2 of the tiered attention: merge split partials into the final output, un-rotating the history.

Contract (`merge_partials`): partial outputs `o` `[B, Hq, Lq, S, D]` (float32, normalized) and their natural
log-sum-exps `lse` `[B, Hq, Lq, S]` (float32, -inf = nothing attended). Splits `[0, plain)` are in the output
basis; splits `[plain, S)` are in the rotated basis of the value rotation R (`[D, D]` or `[Hkv, D, D]`) and are
multiplied by `Rᵀ` (float32, IEEE) after being combined. The result is

    out = (sum_s w_s o_s') / sum_s w_s,  w_s = exp(lse_s - max_s lse_s),  o_s' = o_s or o_s Rᵀ,

written in the output tensor's dtype at any strides (e.g. `[B, Lq, Hq, D]`, what transformers expects), plus
optionally the merged log-sum-exp `[B, Hq, Lq]` (float32). With learned sink logits `sink_h` (float32 `[Hq]`,
gpt-oss), each one is a further term `exp(sink_h - max)` of the denominator that adds nothing to the numerator
(`reference.attention.add_sinks`), and the merged log-sum-exp counts it. Rows whose splits are all -inf give 0 and -inf, never
NaN. Query head h belongs to KV head h // G (the rotation of a per-KV-head R).

One program handles `BLOCK_M` rows (query position, head of one GQA group) of one KV head, or of `BATCH_ROWS`
batch entries of one KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from oscar_hf.kernels.triton.common import launch, launch_device, multiprocessors, round_to

BATCH_ROWS_FROM = 8  # the smallest batch whose merge groups rows of several batch entries (`merge_splits`)


@triton.jit
def _split_chunk(o_rows, lse_rows, top, row_ok, s0, lo, hi, offs, D_OFFS: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """sum over splits s0 .. s0 + SPLIT_CHUNK (those in [lo, hi)) of exp(lse_s - top) * o_s[:, offs]: [M, len(offs)]."""
    splits = s0 + tl.arange(0, SPLIT_CHUNK)
    ok = row_ok[:, None] & ((splits >= lo) & (splits < hi))[None, :]
    w = tl.exp(tl.load(lse_rows[:, None] + splits[None, :], mask=ok, other=float("-inf")) - top[:, None])
    o = tl.load(o_rows[:, None, None] + splits[None, :, None] * D_OFFS + offs[None, None, :], mask=ok[:, :, None],
                other=0.0)
    return tl.sum(w[:, :, None] * o, axis=1)


@triton.jit(do_not_specialize=["total_splits", "plain_splits", "Hkv"])
def _merge_kernel(
    o_ptr, lse_ptr, r_ptr, srh, srr, sink_ptr,
    out_ptr, sob, soh, sol, lo_ptr, slb, slh, sll,
    Lq, G, Hkv, B, total_splits, plain_splits,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, HAS_ROT: tl.constexpr, WRITE_LSE: tl.constexpr, COL_SPAN: tl.constexpr,
    WAIT_PRIOR: tl.constexpr, BATCH_ROWS: tl.constexpr, HAS_SINK: tl.constexpr,
):
    kvh = tl.program_id(1) % Hkv
    if BATCH_ROWS > 1:  # the rows of BATCH_ROWS batch entries of one KV head (one R_V): t = (b, row t % (G Lq))
        t = tl.arange(0, BLOCK_M)
        b = (tl.program_id(1) // Hkv) * BATCH_ROWS + t // (G * Lq)
        rows = t % (G * Lq)
        batch_ok = (t < BATCH_ROWS * G * Lq) & (b < B)
        b = tl.minimum(b, B - 1)
    else:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        b = tl.program_id(1) // Hkv
        batch_ok = True
    col0 = 0  # this program's output columns: [col0, col0 + COL_SPAN)
    if COL_SPAN < D:
        col0 = tl.program_id(2) * COL_SPAN
    ONE_BLOCK: tl.constexpr = HAS_ROT and COL_SPAN == BLOCK_J
    if HAS_ROT:
        offs_d = tl.arange(0, D)
        r_base = r_ptr + kvh.to(tl.int64) * srh
    if ONE_BLOCK:  # the program's only R_V tile, loaded first: its latency overlaps the partials' loads
        r_first = tl.load(r_base + (col0 + tl.arange(0, BLOCK_J))[None, :].to(tl.int64) * srr + offs_d[:, None])
    row_ok = (rows < G * Lq) & batch_ok
    qi = tl.minimum(rows // G, Lq - 1)
    h = kvh * G + rows % G
    Hq = Hkv * G
    part0 = ((b * Hq + h).to(tl.int64) * Lq + qi) * total_splits
    lse_rows = lse_ptr + part0
    o_rows = o_ptr + part0 * D
    if WAIT_PRIOR:  # launched as a dependent of stage 1: everything above overlapped its tail
        gdc_wait()

    # every split's log-sum-exp in one load (BLOCK_S >= total_splits), so no loop waits on a load per split
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_rows[:, None] + offs_s[None, :], mask=row_ok[:, None] & (offs_s < total_splits)[None, :],
                  other=float("-inf"))
    top = tl.max(lse, axis=1)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=row_ok, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse - top[:, None]), axis=1)
    if HAS_SINK:
        total += tl.exp(sink - top)
    inv_total = 1.0 / tl.maximum(total, 1.1754943508222875e-38)

    # the partials SPLIT_CHUNK splits per load: [M, SPLIT_CHUNK, D] tiles reduced over the splits
    rotated_from = total_splits
    if HAS_ROT:
        rotated_from = plain_splits
        acc_rot = tl.zeros((BLOCK_M, D), tl.float32)
        for s0 in range(plain_splits, total_splits, SPLIT_CHUNK):
            acc_rot += _split_chunk(o_rows, lse_rows, top, row_ok, s0, plain_splits, total_splits, offs_d, D,
                                    SPLIT_CHUNK)
        acc_rot = tl.where(row_ok[:, None], acc_rot, 0.0)  # one use of the loop's result (a Triton 3.6 pass asserts)

    out_rows = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + qi.to(tl.int64) * sol
    for jj in tl.static_range(0, COL_SPAN, BLOCK_J):
        offs_j = col0 + jj + tl.arange(0, BLOCK_J)
        acc = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
        for s0 in range(0, rotated_from, SPLIT_CHUNK):
            acc += _split_chunk(o_rows, lse_rows, top, row_ok, s0, 0, rotated_from, offs_j, D, SPLIT_CHUNK)
        if HAS_ROT:
            # (acc_rot @ R^T)[:, j] = sum_i acc_rot[:, i] * R[j, i], on the tensor cores as three TF32 products
            # (~float32 accuracy); the float32 FMA product ("ieee") spilled (255 registers + 352 B of stack)
            if ONE_BLOCK:
                r_t = r_first
            else:
                r_t = tl.load(r_base + offs_j[None, :].to(tl.int64) * srr + offs_d[:, None])
            acc = tl.dot(acc_rot, r_t, acc=acc, input_precision="tf32x3")
        out = acc * inv_total[:, None]
        tl.store(out_rows[:, None] + offs_j[None, :], round_to(out, out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse_merged = tl.where(total > 0.0, top + tl.log(tl.maximum(total, 1.1754943508222875e-38)), float("-inf"))
        # the first column program writes it: a branch, not a mask `row_ok & (program_id == 0)`, which Triton 3.9's
        # interpreter types int32 and refuses
        if tl.program_id(2) == 0:
            tl.store(lo_ptr + b.to(tl.int64) * slb + h.to(tl.int64) * slh + qi.to(tl.int64) * sll, lse_merged,
                     mask=row_ok)


def _rotation_operand(value_rotation: torch.Tensor | None, stand_in: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(R_V, its KV-head stride, its row stride): `value_rotation` (`[D, D]`, head stride 0, or `[Hkv, D, D]`) as
    float32 with unit column stride, what the kernel's float32 loads need; without it, `stand_in` and zeros."""
    if value_rotation is None:
        return stand_in, 0, 0
    rot = value_rotation
    if rot.dtype != torch.float32 or rot.stride(-1) != 1:
        rot = rot.float().contiguous()
    return rot, rot.stride(0) if rot.dim() == 3 else 0, rot.stride(-2)


def _row_blocks(rows: int, batch: int, has_rot: bool, batch_rows: int | None) -> tuple[int, int]:
    """(`BLOCK_M`, `BATCH_ROWS`) for `rows` = G * Lq rows per (batch entry, KV head): one batch entry's rows in
    blocks of up to 16, or those of `batch_rows` entries together in one block of at most 16 (`None`: the default
    that `merge_splits` describes)."""
    block_m = min(16, triton.next_power_of_2(rows))  # a decode step's GQA group, not 16 rows
    if batch_rows is None:
        batch_rows = 16 // triton.next_power_of_2(rows) if has_rot and rows <= 8 and batch >= BATCH_ROWS_FROM else 1
    if batch_rows < 1:
        raise ValueError(f"merge_splits: batch_rows must be at least 1, got {batch_rows}")
    if batch_rows > 1:
        if rows * batch_rows > 16:
            raise ValueError(f"merge_splits: batch_rows={batch_rows} x {rows} rows exceed a 16-row block")
        block_m = triton.next_power_of_2(rows * batch_rows)
    return block_m, batch_rows


def _column_blocks(dim: int, has_rot: bool, row_programs: int, column_programs: int | None,
                   device: torch.device) -> tuple[int, int]:
    """(`column_programs`, `BLOCK_J`): the programs sharing a row block's `dim` output columns and the columns each
    merges per step (`None`: the default that `merge_splits` describes, from the `row_programs` of the grid)."""
    if column_programs is None:
        column_programs = dim // 32 if has_rot and row_programs < multiprocessors(device) else 1
    # with R_Vᵀ, 32 columns at a time (registers); else each program's columns in one block
    block_j = min(dim, 32) if has_rot else dim // max(column_programs, 1)
    if column_programs < 1 or block_j < 16 or block_j & (block_j - 1) or dim % (column_programs * block_j):
        raise ValueError(f"merge_splits: column_programs={column_programs} does not divide {dim} columns into "
                         f"blocks of a power of two from 16{' (32 with R_V)' if has_rot else ''}")
    return column_programs, block_j


def merge_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    splits: int,
    out: torch.Tensor,
    out_layout: str = "blhd",
    value_rotation: torch.Tensor | None = None,
    plain_splits: int | None = None,
    kv_heads: int | None = None,
    lse_out: torch.Tensor | None = None,
    column_programs: int | None = None,
    split_chunk: int | None = None,
    num_warps: int = 4,
    after_stage1: bool = False,
    batch_rows: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Merge the `splits` partials per row of `partial_out` / `partial_lse` (float32, laid out as contiguous
    `[B, Hq, Lq, splits, D]` / `[B, Hq, Lq, splits]`; flat workspaces are fine) into `out`.

    `out` is `[B, Lq, Hq, D]` (`out_layout="blhd"`) or `[B, Hq, Lq, D]` (`"bhld"`), any dtype and strides; its
    shape gives B, Hq, Lq and D. Splits from `plain_splits` on are multiplied by `value_rotation`ᵀ (`[D, D]` or
    `[kv_heads, D, D]`). `lse_out` `[B, Hq, Lq]` float32 receives the merged log-sum-exp when given. `sinks`
    (`[Hq]`): learned sink logits, each in its query head's denominator (module docstring).

    `column_programs`: programs sharing a row block's output columns (a power of two up to D / 32 with R_Vᵀ, each
    then merging the rotated splits' whole rows again; up to D / 16 without, each reading only its columns).
    Default: one per 32 columns when R_Vᵀ is applied and the row blocks alone would not give every
    multiprocessor a program (decode at small batch, where the merge is latency-bound), else 1.

    `split_chunk`: splits read per loop step (default `128 // block_m`, the most that compiles without spills:
    fewer, larger loads keep a small merge from waiting on one load per split). `num_warps`: per program.
    `after_stage1`: launch as a programmatic dependent of the stage-1 kernel just queued (Hopper+): the programs
    start, read R_V and wait for stage 1's writes, instead of launching after it drained.
    `batch_rows`: batch entries whose rows (of one KV head, so one R_V) share a program, up to 16 rows. Default:
    as many as fit 16 rows when R_Vᵀ is applied to at most 8 rows per KV head and the batch is at least
    `BATCH_ROWS_FROM`, else 1: at large batch, a quarter of the programs each read R_V once for 16 rows instead of
    4.
    """
    if out_layout == "blhd":
        batch, q_len, q_heads, dim = out.shape
    else:
        batch, q_heads, q_len, dim = out.shape
    kv_heads = kv_heads or q_heads
    groups = q_heads // kv_heads
    if partial_out.numel() < batch * q_heads * q_len * splits * dim:
        raise ValueError("merge_splits: partial_out is too small for the output shape")
    if out.stride(-1) != 1:
        raise ValueError("merge_splits needs a unit stride along head_dim of the output")
    sob, s1, s2 = out.stride(0), out.stride(1), out.stride(2)
    soh, sol = (s2, s1) if out_layout == "blhd" else (s1, s2)
    has_rot = value_rotation is not None and plain_splits is not None and plain_splits < splits
    rot, rot_head_stride, rot_row_stride = _rotation_operand(value_rotation if has_rot else None, partial_out)
    lse_target = lse_out if lse_out is not None else partial_lse
    if sinks is not None:
        sinks = sinks.to(device=out.device, dtype=torch.float32).contiguous()
    lse_strides = lse_out.stride() if lse_out is not None else (0, 0, 0)
    rows = groups * q_len
    block_m, batch_rows = _row_blocks(rows, batch, has_rot, batch_rows)
    row_programs = triton.cdiv(rows, block_m) * triton.cdiv(batch, batch_rows) * kv_heads
    column_programs, block_j = _column_blocks(dim, has_rot, row_programs, column_programs, out.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(batch, batch_rows) * kv_heads, column_programs)
    with launch_device(out):
        launch(
            _merge_kernel, grid,
            partial_out, partial_lse, rot, rot_head_stride, rot_row_stride,
            sinks if sinks is not None else partial_lse,
            out, sob, soh, sol, lse_target, *lse_strides,
            q_len, groups, kv_heads, batch, splits, splits if plain_splits is None else plain_splits,
            D=dim, BLOCK_M=block_m, BLOCK_J=block_j, BLOCK_S=max(16, triton.next_power_of_2(splits)),
            SPLIT_CHUNK=split_chunk or max(1, 128 // block_m), HAS_ROT=has_rot, WRITE_LSE=lse_out is not None,
            COL_SPAN=dim // column_programs, WAIT_PRIOR=after_stage1, BATCH_ROWS=batch_rows, HAS_SINK=sinks is not None,
            num_warps=num_warps, **({"launch_pdl": True} if after_stage1 else {}),
        )
