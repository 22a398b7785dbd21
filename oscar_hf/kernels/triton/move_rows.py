"""Moving BF16 rows down within their buffer in place: the window's shift after a demotion, a padded row's sink.

Contract (`move_rows`): buffers `[B, H, rows, d]` (one shape and dtype, unit stride along d), index long `[B, n]` or
`[1, n]` (contiguous) with `index[b, j] >= start + j`: row `start + j` of row b becomes what row `index[b, j]` held.
Every row is read before it is overwritten, as `kernels.ops.gather_rows` requires.

One program per (batch row, head, block of d columns) walks the n destination rows in tiles of `BLOCK_R`: it loads
a tile's sources, waits at a barrier for all of its threads, then stores the tile. It owns its columns of every
row, so no other program writes what it reads. Since a row only ever moves down (`index[b, j] >= start + j`), no
source is a destination of an earlier tile, and the barrier orders each tile's loads before its stores (a source
may be a later destination in the same tile) and before the next tile's stores. A row that would be copied onto
itself (every row on the seven decode steps of eight that demote nothing: the window's index is then the identity)
is neither loaded nor stored, so such a step costs the launch and n / `BLOCK_R` index reads in a row.
A row at a time instead chains n dependent index loads, 38 us a layer for a 256-row window at batch 1 (H100,
2026-12-06, `python -m bench.profile_generate --context 4096 --batch 1 --timeline`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_hf.kernels.triton.common import launch, launch_device

BLOCK_D = 32  # columns per program: at d = 128, B = 8 and H = 8 there are 256 programs
BLOCK_R = 64  # rows per tile: a 256-row window is four tiles


@triton.jit
def _move_rows_kernel(a_ptr, b_ptr, index_ptr, sb, sh, sr, sib, n, start, H, D,
                      BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, TWO: tl.constexpr):
    b = tl.program_id(0) // H
    h = tl.program_id(0) % H
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    base = b.to(tl.int64) * sb + h.to(tl.int64) * sh
    for first in range(0, n, BLOCK_R):
        j = first + tl.arange(0, BLOCK_R)
        source = tl.load(index_ptr + b * sib + j, mask=j < n, other=0)
        target = start + j
        moves = ((source != target) & (j < n))[:, None] & col_ok[None, :]
        src = base + source.to(tl.int64)[:, None] * sr + cols[None, :]
        dst = base + target.to(tl.int64)[:, None] * sr + cols[None, :]
        a = tl.load(a_ptr + src, mask=moves)
        if TWO:
            v = tl.load(b_ptr + src, mask=moves)
        tl.debug_barrier()  # every thread's loads of the tile before any thread's stores (module docstring)
        tl.store(a_ptr + dst, a, mask=moves)
        if TWO:
            tl.store(b_ptr + dst, v, mask=moves)


def move_rows(buffers: list[torch.Tensor], index: torch.Tensor, start: int, block_rows: int = BLOCK_R) -> None:
    """Launch the move over one or two buffers of one layout (the module docstring's contract), in tiles of
    `block_rows` rows (a power of two)."""
    first = buffers[0]
    batch, heads, _, dim = first.shape
    if len(buffers) > 2 or any(t.shape != first.shape or t.stride() != first.stride() for t in buffers):
        raise ValueError("move_rows takes one or two buffers of one shape and layout")
    if first.stride(3) != 1 or not index.is_contiguous():
        raise ValueError("move_rows needs unit stride along the head dim and a contiguous index")
    index_batch_stride = 0 if index.shape[0] == 1 else index.stride(0)
    grid = (batch * heads, triton.cdiv(dim, BLOCK_D))
    with launch_device(first):
        launch(_move_rows_kernel, grid, first, buffers[-1], index, first.stride(0), first.stride(1), first.stride(2),
               index_batch_stride, index.shape[1], start, heads, dim, BLOCK_D=BLOCK_D, BLOCK_R=block_rows,
               TWO=len(buffers) == 2)
