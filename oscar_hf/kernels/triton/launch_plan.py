"""How a stage-1 launch is shaped: the tile / warp / pipeline configuration per head_dim (`LaunchConfig`, measured
defaults in `DEFAULT_LAUNCH`) and how the keys of a call are cut into split-K partials (`plan_splits`).

The kernel that these parameterize is `stage1.py`; `backend.TritonBackend` picks a configuration and a plan per
call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import triton

BLOCK_N_DENSE = 64
BLOCK_N_HISTORY = 64


@dataclass(frozen=True)
class LaunchConfig:
    """Stage-1 tile and launch parameters: history tokens per tile, warps and pipeline stages."""

    block_n_history: int = 128
    num_warps: int = 4
    num_stages: int = 3
    asm_unpack: bool = True  # 2- and 4-bit codes to float16 by inline PTX (GPU, 16-bit queries; else shifts)
    programs_per_sm: int = 4  # stage-1 programs to aim for per multiprocessor (sets the split count)
    # Dense-tier keys per tile. Its pipelined K/V tiles set the kernel's shared memory for every program (history
    # programs included), so smaller tiles let more programs share an SM.
    block_n_dense: int = 64
    # Query rows per program (16: the MMA's M; 8 suits the token-major history path, whose N it becomes).
    block_m: int = 16
    # Query rows per program when a call has more rows than `block_m` (a chunk of queries: chunked prefill). Each row
    # block reads and dequantizes the whole history again, so larger blocks read it fewer times.
    many_rows_block_m: int = 16
    # History dots with the tokens as M (`_quant_split_token_major`): decode rows pad N to 8, not M to 16.
    token_major: bool = False
    # Token-major, 2-bit, 16-bit queries: key codes keep the unpacking's magic numbers and the scores are corrected
    # once per row (fewer instructions per tile, same error against the reference).
    fold_key_offsets: bool = False
    # Register cap per thread (Triton's `maxnreg`; None: ptxas decides): more programs per SM, at the price of
    # spills.
    max_registers: int | None = None
    # The shortest history split the backend cuts (`TritonBackend(min_history_tokens=None)`): shorter splits fill
    # the GPU at batch 1, longer ones cost fewer partials to merge.
    min_history_tokens: int = 512


# The measured best per head_dim on an H200 (the launch sweeps of the repository's benchmarks):
# token-major history dots in 8-row blocks with folded key offsets; one warp per program, so that a 64-token
# history tile's softmax reduces within the warp with no barrier; small dense tiles, so that many programs share an
# SM. Other head_dims keep `LaunchConfig()` (not swept).
DEFAULT_LAUNCH: dict[int, LaunchConfig] = {
    64: LaunchConfig(num_warps=1, programs_per_sm=24, block_n_dense=32, block_m=8, token_major=True,
                     fold_key_offsets=True),
    128: LaunchConfig(block_n_history=64, num_warps=1, programs_per_sm=20, block_n_dense=16, block_m=8,
                      token_major=True, fold_key_offsets=True, min_history_tokens=256),
}


# A call with more query rows per KV head than a decode step's (a chunk of a chunked prefill) is bound by
# dequantizing the history once per row block, not by the split count: the measured best on an H200 at d=128
# (`bench.prefill_attention`, 8192-query causal chunks without a mask tensor over 32k and 100k tokens, batch 4) is
# 64-row blocks, row-major history dots, 4 warps: 1.55x faster than the decode launch's 16-row token-major blocks,
# 1.5-2.8x faster than 32- or 128-row blocks at 4 warps, and 1-2% faster than 128-row blocks at 8 warps. Calls with
# a mask tensor (padded rows) were not measured and keep the decode launch.
MANY_ROWS_LAUNCH: dict[int, LaunchConfig] = {
    128: LaunchConfig(block_n_history=64, num_warps=4, block_m=16, many_rows_block_m=64),
}


def default_launch(head_dim: int, rows: int = 1, masked: bool = False) -> LaunchConfig:
    """The measured best stage-1 launch configuration for `head_dim` and a call of `rows` query rows per KV head,
    `masked` if it reads a mask tensor (`LaunchConfig()` where none was measured)."""
    decode = DEFAULT_LAUNCH.get(head_dim, LaunchConfig())
    if rows > decode.block_m and not masked:
        return MANY_ROWS_LAUNCH.get(head_dim, decode)
    return decode


MAX_SPLITS = 128  # splits per KV head row of one kind (dense or history) a plan cuts at most


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
                min_dense_tokens: int = 256, min_history_tokens: int = 512, max_splits: int = MAX_SPLITS,
                block_n_history: int = BLOCK_N_HISTORY, block_n_dense: int = BLOCK_N_DENSE,
                small_block_m: int = 16, min_programs: int = 0, many_rows_block_m: int = 16) -> SplitPlan:
    """Split counts that give about `target_programs` programs (flash-decoding) without splits shorter than
    the minimums; `rows` = query heads per KV head x query length. Every layer of a decode step asks the same
    question, hence the cache.

    When those minimums leave fewer than `min_programs` programs (a short context at batch 1, where the call is
    latency-bound), they drop to two dense tiles and one history tile; grids that fill the GPU anyway keep the
    minimums.

    Rows come in blocks of `many_rows_block_m` (`small_block_m` when all rows fit in it, e.g. 8 for a decode step's
    GQA group)."""
    block_m = small_block_m if rows <= small_block_m else many_rows_block_m
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


@functools.lru_cache(maxsize=1024)
def plan_runs(plan: SplitPlan, history_len: int, run_heads: tuple[int, ...], run_row_bytes: tuple[int, ...],
              max_splits: int) -> tuple[tuple[SplitPlan, ...], int]:
    """Each run's history cut, for a layer whose KV heads are kept as runs of different code widths: `plan`'s
    history programs (its `history_splits` for every KV head) shared among the runs in proportion to their heads
    times the bytes of one of their history rows (`run_row_bytes`), so that every program reads about as many
    bytes and no run's programs outlast the others'. Splits stay whole `plan.block_n_history` tiles, at most
    `max_splits` per KV head row.

    Returns the runs' plans (the layer's dense splits, their own history splits) and the splits per partial row:
    the dense splits plus the most history splits any run takes; a run with fewer leaves the rest empty."""
    if plan.history_splits == 0 or history_len <= 0:
        return tuple(plan for _ in run_heads), plan.total_splits
    block = plan.block_n_history
    programs = plan.history_splits * sum(run_heads)  # per batch row and row block
    per_byte = programs / sum(h * b for h, b in zip(run_heads, run_row_bytes))
    plans = []
    for row_bytes in run_row_bytes:
        splits = max(1, min(max_splits, triton.cdiv(history_len, block), round(per_byte * row_bytes)))
        length = triton.cdiv(triton.cdiv(history_len, splits), block) * block
        plans.append(replace(plan, history_splits=triton.cdiv(history_len, length), history_split_len=length))
    return tuple(plans), plan.dense_splits + max(p.history_splits for p in plans)
