"""How a stage-1 launch is shaped: the tile / warp / pipeline configuration per head_dim (`LaunchConfig`, measured
defaults in `DEFAULT_LAUNCH`) and how the keys of a call are cut into split-K partials (`plan_splits`).

The kernel that these parameterize is `attention.py`; `backend.TritonBackend` picks a configuration and a plan per
call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

BLOCK_N_DENSE = 64
BLOCK_N_HISTORY = 64


@dataclass(frozen=True)
class LaunchConfig:
    """Stage-1 tile and launch parameters: history tokens per tile, warps and pipeline stages (chosen by the
    sweep in bench/attention.py on the H200)."""

    block_n_history: int = 128
    num_warps: int = 4
    num_stages: int = 3
    asm_unpack: bool = True  # 2-bit codes to float16 by inline PTX (GPU, 16-bit queries; ignored elsewhere)
    programs_per_sm: int = 4  # stage-1 programs to aim for per multiprocessor (sets the split count)
    # Dense-tier keys per tile. Its pipelined K/V tiles set the kernel's shared memory for every program (history
    # programs included): 70 KB at 64 vs 37 KB at 32 for d=128, 3 stages (bench/compile_stage1.py).
    block_n_dense: int = 64
    # Query rows per program (16: the MMA's M; 8 suits the token-major history path, whose N it becomes).
    block_m: int = 16
    # History dots with the tokens as M (`_quant_split_token_major`): decode rows pad N to 8, not M to 16.
    token_major: bool = False
    # Token-major, 2-bit, 16-bit queries: key codes keep the unpacking's magic numbers and the scores are corrected
    # once per row (8% fewer instructions per tile, offline; run 19: 2-4% faster at 100k/bs8 and 32k/bs32, error
    # vs the reference unchanged at 1.0e-3).
    fold_key_offsets: bool = False
    # Register cap per thread (Triton's `maxnreg`; None: ptxas decides). 128 with 2 stages lets 8 two-warp programs
    # share an SM instead of 6, for 104 B of spills (bench/compile_stage1.py).
    max_registers: int | None = None
    # The shortest history split the backend cuts (`TritonBackend(min_history_tokens=None)`): 256 at d=128 (32k/bs1
    # 0.027 vs 0.032 ms at 512, run 35), 512 at d=64 (32k/bs1 0.025 vs 0.029 at 256, runs 31 and 34).
    min_history_tokens: int = 512


# Defaults per head_dim from the launch sweeps on the H200 (bench/RESULTS.md, run 14): token-major history dots
# in 8-row blocks with 32-key dense tiles; 2 warps / 4 programs per SM at head_dim 128 (0.358 ms instead of 0.462 at
# 100k tokens / batch 8), 1 warp / 24 programs per SM at 64 (0.197 ms instead of 0.484); folded key offsets since
# run 19. At 128 since run 25: one warp per 64-token tile (the softmax reduces within the warp, no barrier per
# tile), 16-key dense tiles (18 KB of shared memory), 20 programs per SM: 0.302 vs 0.317 ms at 100k/bs8, 0.382 vs
# 0.438 at 32k/bs32, 0.060 vs 0.065 at 100k/bs1 (0.027 vs 0.023 at 4k/bs1). Other head_dims keep `LaunchConfig()`
# (not swept).
DEFAULT_LAUNCH: dict[int, LaunchConfig] = {
    64: LaunchConfig(num_warps=1, programs_per_sm=24, block_n_dense=32, block_m=8, token_major=True,
                     fold_key_offsets=True),
    128: LaunchConfig(block_n_history=64, num_warps=1, programs_per_sm=20, block_n_dense=16, block_m=8,
                      token_major=True, fold_key_offsets=True, min_history_tokens=256),
}


def default_launch(head_dim: int) -> LaunchConfig:
    """The measured best stage-1 launch configuration for `head_dim` (`LaunchConfig()` where none was swept)."""
    return DEFAULT_LAUNCH.get(head_dim, LaunchConfig())


@dataclass(frozen=True)
class SplitPlan:
    """How the keys are cut: `dense_splits` splits of `dense_split_len` dense keys, then `history_splits` of
    `history_split_len` history tokens, for `row_blocks` blocks of `block_m` query rows."""

    block_m: int
    row_blocks: int
    block_n_history: int
    dense_splits: int
    dense_split_len: int
    history_splits: int
    history_split_len: int
    block_n_dense: int = BLOCK_N_DENSE

    @property
    def total_splits(self) -> int:
        return self.dense_splits + self.history_splits


def _cut(tokens: int, wanted: int, min_tokens: int, block: int, max_splits: int) -> tuple[int, int]:
    if tokens <= 0:
        return 0, block
    splits = max(1, min(wanted, triton.cdiv(tokens, min_tokens), max_splits))
    length = triton.cdiv(triton.cdiv(tokens, splits), block) * block
    return triton.cdiv(tokens, length), length


@functools.lru_cache(maxsize=1024)
def plan_splits(batch: int, kv_heads: int, rows: int, dense_len: int, history_len: int, target_programs: int,
                min_dense_tokens: int = 256, min_history_tokens: int = 512, max_splits: int = 128,
                block_n_history: int = BLOCK_N_HISTORY, block_n_dense: int = BLOCK_N_DENSE,
                small_block_m: int = 16, min_programs: int = 0) -> SplitPlan:
    """Split counts that give about `target_programs` programs (flash-decoding) without splits shorter than
    the minimums; `rows` = query heads per KV head x query length. Every layer of a decode step asks the same
    question, hence the cache.

    When those minimums leave fewer than `min_programs` programs (a short context at batch 1, where the call is
    latency-bound), they drop to two dense tiles and one history tile (run 19: 4k/bs1 0.031 -> 0.028 ms at d=128;
    run 33: 0.018 -> 0.016; the same short minimums lost at 32k/bs1 and 4k/bs8, whose grids fill the GPU anyway).

    Rows come in blocks of 16 (`small_block_m` when all rows fit in it, e.g. 8 for a decode step's GQA group):
    a 64-row variant (8 warps) faulted with an illegal address on the H200 and was dropped (not isolated; see
    bench/RESULTS.md)."""
    block_m = small_block_m if rows <= small_block_m else 16
    row_blocks = triton.cdiv(rows, block_m)
    wanted = triton.cdiv(target_programs, batch * kv_heads * row_blocks)

    def cut(min_dense: int, min_history: int):
        return (_cut(dense_len, wanted, min_dense, block_n_dense, max_splits),
                _cut(history_len, wanted, min_history, block_n_history, max_splits))

    (dense_splits, dense_len_each), (hist_splits, hist_len_each) = cut(min_dense_tokens, min_history_tokens)
    if batch * kv_heads * row_blocks * (dense_splits + hist_splits) < min_programs:
        (dense_splits, dense_len_each), (hist_splits, hist_len_each) = cut(
            min(min_dense_tokens, 2 * block_n_dense), min(min_history_tokens, block_n_history))
    return SplitPlan(block_m, row_blocks, block_n_history, dense_splits, dense_len_each, hist_splits, hist_len_each,
                     block_n_dense)
