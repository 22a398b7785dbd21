"""Packed history rows back to dense rotated rows, `(code - zero) * scale` as `reference.quantize.dequantize_rows`
computes it, written in the output's dtype.

Why a chunk of queries wants this: stage 1 dequantizes each history tile inside the attention loop, which a decode
step's few rows per KV head pay once. A chunk of a chunked prefill has thousands of rows per KV head in row blocks,
and every block dequantizes the whole history again: at 8k queries, 512 times per KV head and layer, and the
unpacking, not the tensor cores, sets the time. Dequantizing a piece of the history once into a bounded scratch and
running the BF16 attention over it unpacks it once (`TritonBackend.dequantize_from_rows` says from how many rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_hf.kernels.interface import HistoryTensors
from oscar_hf.kernels.triton.codes import PAIR_WORDS, SCALE_DTYPES, code_planes, load_code_bytes, scale_zero
from oscar_hf.kernels.triton.common import launch, launch_device

BLOCK_TOKENS = 64  # history rows per program


@triton.jit(do_not_specialize=["heads"])  # a run of one KV head would be a variant of its own (stage1.py)
def _dequantize_kernel(codes_ptr, scb, sch, sct, words_ptr, swb, swh, swt, out_ptr, sob, soh, sot, start, n,
                       heads, D: tl.constexpr, BITS: tl.constexpr, SZ_DT: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows `[start, start + n)` of one (batch row, KV head) into `out`'s rows `[0, n)`; one program per
    `BLOCK_T` rows. Codes and zero point are both centred (`codes.code_plane`, `codes.scale_zero`), so their
    difference is the code minus the zero point, as stored."""
    QW: tl.constexpr = D // 4
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = offs_t < n
    offs_w = tl.arange(0, QW)
    token = (start + offs_t).to(tl.int64)
    rows = codes_ptr + b.to(tl.int64) * scb + h.to(tl.int64) * sch + token[:, None] * sct
    lo, hi = load_code_bytes(rows, offs_w[None, :], ok[:, None], QW, BITS)
    q0, q1, q2, q3 = code_planes(lo, hi, BITS, tl.float32, False)
    word = tl.load(words_ptr + b.to(tl.int64) * swb + h.to(tl.int64) * swh + token * swt, mask=ok, other=0)
    scale, zero = scale_zero(word, SZ_DT, BITS)
    scale, zero = scale[:, None], zero[:, None]
    out = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_t[:, None].to(tl.int64) * sot + offs_w[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(out, ((q0 - zero) * scale).to(dt), mask=ok[:, None])
    tl.store(out + QW, ((q1 - zero) * scale).to(dt), mask=ok[:, None])
    tl.store(out + 2 * QW, ((q2 - zero) * scale).to(dt), mask=ok[:, None])
    tl.store(out + 3 * QW, ((q3 - zero) * scale).to(dt), mask=ok[:, None])


def dequantize_rows(codes: torch.Tensor, scale_zero_pairs: torch.Tensor, bits: int, start: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Rows `[start, start + n)` of packed codes `[B, H, N, D * bits / 8]` with their (scale, zero) pairs
    `[B, H, N, 2]` (float pairs or compact codes) into `out` `[B, H, n, D]` (float16, bfloat16 or float32, unit
    stride along D); returns `out`."""
    batch, heads, n, dim = out.shape
    if bits not in (2, 3, 4) or codes.shape[-1] * 8 // bits != dim or dim % 4 or dim & (dim - 1):
        raise ValueError(f"dequantize_rows: {bits}-bit codes of {codes.shape[-1]} bytes do not give rows of {dim}")
    if start < 0 or start + n > codes.shape[2] or codes.shape[:2] != (batch, heads):
        raise ValueError(f"dequantize_rows: rows [{start}, {start + n}) of codes {tuple(codes.shape)} do not fit "
                         f"out {tuple(out.shape)}")
    if codes.stride(-1) != 1 or out.stride(-1) != 1 or scale_zero_pairs.stride(-1) != 1:
        raise ValueError("dequantize_rows needs a unit stride along the last dimension")
    if n == 0:
        return out
    words = scale_zero_pairs.view(PAIR_WORDS[scale_zero_pairs.dtype])  # one integer per token (`codes.scale_zero`)
    grid = (triton.cdiv(n, BLOCK_TOKENS), batch * heads)
    with launch_device(out):
        launch(_dequantize_kernel, grid, codes, codes.stride(0), codes.stride(1), codes.stride(2),
               words, words.stride(0), words.stride(1), words.stride(2),
               out, out.stride(0), out.stride(1), out.stride(2), start, n, heads,
               D=dim, BITS=bits, SZ_DT=SCALE_DTYPES[scale_zero_pairs.dtype], BLOCK_T=BLOCK_TOKENS)
    return out


def dequantize_history(history: HistoryTensors, start: int, keys_out: torch.Tensor,
                       values_out: torch.Tensor) -> None:
    """A quantized history's rotated keys and values of tokens `[start, start + n)` into `keys_out` / `values_out`
    `[B, Hkv, n, D]`."""
    dequantize_rows(history.keys, history.key_scale_zero, history.bits, start, keys_out)
    dequantize_rows(history.values, history.value_scale_zero, history.bits, start, values_out)
