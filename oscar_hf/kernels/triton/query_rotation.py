"""The query's rotation for the history tier, once per call: `q @ R_K` in float32.

Contract (`rotate_query`): query `[B, Hq, Lq, D]` (any float dtype, unit stride along D) and R_K `[D, D]` or
`[Hkv, D, D]` (float32, unit stride along its rows; query head h takes the rotation of KV head h // (Hq / Hkv))
give `out` `[B, Hq, Lq, D]` float32 (contiguous) = query @ R_K, as three TF32 products (~float32 accuracy).

Stage 1 (`stage1.py`) reads this instead of rotating the query in every history program, each of which would
otherwise load 64 KB of R before its first tile. One program per 16 rows and 32 output columns. On Hopper, stage 1
is launched as a programmatic dependent of this kernel, so only its history programs wait for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from oscar_hf.kernels.triton.common import launch, launch_device
from oscar_hf.kernels.triton.interpreter import interpreting


@triton.jit(do_not_specialize=["Hkv"])  # a run of one KV head would be a variant of its own (stage1.py)
def _rotate_query_kernel(q_ptr, sqb, sqh, sql, r_ptr, srh, srr, o_ptr, Lq, G, Hkv,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, PRECISION: tl.constexpr,
                         LAUNCH_DEPENDENTS: tl.constexpr):
    if LAUNCH_DEPENDENTS:  # stage 1 may start now: its history programs wait for this kernel's writes
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.program_id(1) // Hkv
    kvh = tl.program_id(1) % Hkv
    row_ok = rows < G * Lq
    qi = tl.minimum(rows // G, Lq - 1)
    h = kvh * G + rows % G
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h[:, None].to(tl.int64) * sqh + qi[:, None].to(tl.int64) * sql
                + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    r_base = r_ptr + kvh.to(tl.int64) * srh
    offs_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)  # this program's output columns
    r = tl.load(r_base + offs_d[:, None].to(tl.int64) * srr + offs_j[None, :])
    out = tl.dot(q, r, input_precision=PRECISION)
    o_rows = o_ptr + ((b * Hkv * G + h).to(tl.int64) * Lq + qi) * D
    tl.store(o_rows[:, None] + offs_j[None, :], out, mask=row_ok[:, None])


def rotate_query(query: torch.Tensor, rotation: torch.Tensor, out: torch.Tensor | None = None,
                 launch_dependents: bool = False) -> torch.Tensor:
    """`query @ R_K` per query head (see the module docstring) into `out` (float32 `[B, Hq, Lq, D]`, contiguous;
    allocated when None). `launch_dependents`: let the next kernel, launched as a programmatic dependent, start
    at once (`attention_partials(wait_for_rotation=True)`)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = rotation.shape[0] if rotation.dim() == 3 else 1
    if rotation.shape[-2:] != (dim, dim) or rotation.dim() not in (2, 3) or q_heads % kv_heads:
        raise ValueError(f"rotate_query: rotation {tuple(rotation.shape)} does not fit query {tuple(query.shape)}")
    if query.stride(-1) != 1:
        raise ValueError("rotate_query needs a unit stride along head_dim")
    if rotation.dtype != torch.float32 or rotation.stride(-1) != 1:
        rotation = rotation.float().contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    elif out.dtype != torch.float32 or out.shape != query.shape or not out.is_contiguous():
        raise ValueError(f"rotate_query: out must be a contiguous float32 {tuple(query.shape)}")
    groups = q_heads // kv_heads
    block_m = 16  # the MMA's M: a decode step's GQA group is padded to it
    block_j = min(dim, 32)  # output columns per program: a decode step is latency-bound, so spread it wide
    grid = (triton.cdiv(groups * q_len, block_m), batch * kv_heads, dim // block_j)
    with launch_device(query):
        launch(
            _rotate_query_kernel, grid,
            query, query.stride(0), query.stride(1), query.stride(2),
            rotation, rotation.stride(0) if rotation.dim() == 3 else 0, rotation.stride(-2),
            out, q_len, groups, kv_heads,
            D=dim, BLOCK_M=block_m, BLOCK_J=block_j, PRECISION="ieee" if interpreting() else "tf32x3",
            LAUNCH_DEPENDENTS=launch_dependents, num_warps=4,
        )
    return out
