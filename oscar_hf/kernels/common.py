"""Small `@triton.jit` helpers shared by the kernels (no kernels here)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 -> `dtype` rounding to nearest even; bfloat16 by integer arithmetic so that the interpreter (which
    truncates) and the GPU give the same bits."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
