"""`TritonBackend`: the kernel implementation of the backend operations (see `oscar_hf.backend`).

Inputs the kernels do not cover (head_dim not a power of two in [64, 256], key and value head sizes that differ,
per-head masks) fall back to the PyTorch reference, which defines the semantics either way.

Decode (`tiered_attention`) per layer: the query rotated by R_K once (`kernels/query_rotation.py`), one stage-1
launch covering the BF16 tiers and the quantized history (`kernels/attention.py`) and one stage-2 launch that
merges the splits, un-rotates the history by R_Vᵀ and writes `[B, Lq, Hq, D]` in the model dtype
(`kernels/merge.py`); on Hopper each is a programmatic dependent of the one before. On CUDA, where the call
qualifies (`cuda_history.history_kernel_supports`: 2-bit history, no mask, head_dim 64/128, <= 8 rows per KV
head), the history splits come from the hand-written kernel instead (`kernels/int2_history.cu`) and the Triton
stage 1 covers the BF16 tiers alone. The scratch (split partials, rotated query) is reused across calls (no
allocation that grows with the history), and nothing synchronizes the host.
"""

from __future__ import annotations

import os

import torch

from ..backend import ReferenceBackend
from ..history import QuantizedHistory
from . import cuda_history
from .attention import HistoryTensors, attention_partials
from .common import dependent_launch, multiprocessors
from .launch_plan import LaunchConfig, SplitPlan, default_launch, plan_splits
from .demote import demote_rows
from .merge import merge_splits
from .query_rotation import rotate_query


# The small-grid rule, from run 33 at d=128 with the query rotated once per call: splits of one history tile
# when the grid stays under 4 programs per SM (half of the 8 that fit), 4k/bs1 0.018 -> 0.016 ms. (The history
# split minimum is per launch, `LaunchConfig.min_history_tokens`; 128 dense tokens instead of 256 cost 10% at bs32,
# a third dense split per KV head, run 34.)
SMALL_GRID_PROGRAMS_PER_SM = 4


def kernel_head_dim(dim: int) -> bool:
    """Head sizes the kernels take: powers of two from 64 (a quarter of a row feeds a 16-wide dot) to 256."""
    return 64 <= dim <= 256 and dim & (dim - 1) == 0


class TritonBackend(ReferenceBackend):
    """Triton kernels on CUDA (or on CPU under `TRITON_INTERPRET=1`, for tests).

    Args:
        history_chunk: passed to the reference fallback.
        target_programs: programs per stage-1 launch to aim for (default: `launch.programs_per_sm` per
            multiprocessor).
        min_dense_tokens / min_history_tokens: the shortest split of each tier (tests lower them to force many
            splits on small inputs); history default: the launch's `min_history_tokens`.
        short_splits_on_small_grids: cut splits down to one or two tiles when the minimums would leave the grid
            under `SMALL_GRID_PROGRAMS_PER_SM` programs per multiprocessor (`plan_splits`' `min_programs`).
        launch: stage-1 tile sizes, warps and pipeline stages (`LaunchConfig`); default: the measured best for
            the head_dim (`default_launch`).
        dependent_launches: launch stage 1 as a programmatic dependent of the query rotation, and the merge of
            stage 1, where the GPU has it (`kernels.common.dependent_launch`): each launch and prologue overlaps
            the tail of the kernel before it.
        cuda_history: use the CUDA history kernel where a call qualifies (default: unless the environment sets
            OSCAR_CUDA_HISTORY=0); `cuda_history_config` its compile-time shape and split rule.
        overlap_dense: with the CUDA history kernel and dependent launches, queue the BF16 tiers' Triton kernel
            after it as a programmatic dependent, so that it runs beside the history kernel's tail.
    """

    name = "triton"

    def __init__(self, history_chunk: int = 4096, target_programs: int | None = None,
                 min_dense_tokens: int = 256, min_history_tokens: int | None = None, launch: LaunchConfig | None = None,
                 short_splits_on_small_grids: bool = True, dependent_launches: bool = True,
                 cuda_history: bool | None = None,
                 cuda_history_config: cuda_history.CudaHistoryConfig = cuda_history.CudaHistoryConfig(),
                 overlap_dense: bool = True):
        super().__init__(history_chunk=history_chunk)
        self.launch = launch
        self.target_programs = target_programs
        self.min_dense_tokens = min_dense_tokens
        self.min_history_tokens = min_history_tokens
        self.short_splits_on_small_grids = short_splits_on_small_grids
        self.dependent_launches = dependent_launches
        if cuda_history is None:
            cuda_history = os.environ.get("OSCAR_CUDA_HISTORY", "1") != "0"
        self.cuda_history = cuda_history
        self.cuda_history_config = cuda_history_config
        self.overlap_dense = overlap_dense
        self._scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------ demotion
    def demote(self, x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder="minmax") -> None:
        if encoder != "minmax" or not kernel_head_dim(x.shape[-1]):  # opt-in encoders: the reference only
            return super().demote(x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder)
        demote_rows([(x, rotation, clip_ratio, codes_out, scale_zero_out)], bits)

    def demote_kv(self, keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio, bits,
                  key_codes_out, key_scale_zero_out, value_codes_out, value_scale_zero_out, encoder="minmax") -> None:
        if encoder != "minmax" or keys.shape != values.shape or not kernel_head_dim(keys.shape[-1]):
            return super().demote_kv(keys, values, key_rotation, value_rotation, key_clip_ratio, value_clip_ratio,
                                     bits, key_codes_out, key_scale_zero_out, value_codes_out, value_scale_zero_out,
                                     encoder)
        demote_rows([(keys, key_rotation, key_clip_ratio, key_codes_out, key_scale_zero_out),
                     (values, value_rotation, value_clip_ratio, value_codes_out, value_scale_zero_out)], bits)

    # ------------------------------------------------------------------------------------------ attention
    def dense_attention(self, query, key, value, mask, scaling, softcap=None):
        if not self._supported(query, key, value, mask):
            return super().dense_attention(query, key, value, mask, scaling, softcap)
        return self._partial(query, key, value, None, None, None, mask, scaling, softcap, causal=False,
                             gap_start=key.shape[2], hist_col0=0)

    def history_attention(self, query, history, key_rotation, value_rotation, mask, scaling, softcap=None):
        tensors = _history_tensors(history)
        if tensors is None or not self._supported(query, None, None, mask, history):
            return super().history_attention(query, history, key_rotation, value_rotation, mask, scaling, softcap)
        return self._partial(query, None, None, tensors, key_rotation, value_rotation, mask, scaling, softcap,
                             causal=False, gap_start=0, hist_col0=0, kv_heads=history.num_heads)

    def merge(self, parts):
        if len(parts) == 1:
            return parts[0]
        out0, _ = parts[0]
        if not kernel_head_dim(out0.shape[-1]):
            return super().merge(parts)
        partial_out = torch.stack([o.float() for o, _ in parts], dim=3)
        partial_lse = torch.stack([lse.float() for _, lse in parts], dim=3)
        out = torch.empty(out0.shape, dtype=torch.float32, device=out0.device)
        lse = torch.empty(out0.shape[:-1], dtype=torch.float32, device=out0.device)
        merge_splits(partial_out, partial_lse, len(parts), out, out_layout="bhld", lse_out=lse)
        return out, lse

    def tiered_attention(self, query, key, value, mask, history, sink_length, key_rotation, value_rotation,
                         scaling, softcap=None, dense_start=None, out=None):
        """BF16 tiers (`key`/`value`, model basis) + history between columns `sink_length` and
        `sink_length + history.length`: `[B, Lq, Hq, D]` in the query dtype (see `ReferenceBackend`).

        `out`: an optional `[B, Lq, Hq, D]` tensor to write into (tests poison it first)."""
        hist_len = history.length if history is not None else 0
        tensors = _history_tensors(history) if hist_len else None
        if (hist_len and tensors is None) or not self._supported(query, key, value, mask, history if hist_len else None):
            return super().tiered_attention(query, key, value, mask, history, sink_length, key_rotation,
                                            value_rotation, scaling, softcap, dense_start)
        batch, q_heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        if out is None:
            out = torch.empty((batch, q_len, q_heads, dim), dtype=query.dtype, device=query.device)
        self._run(query, key, value, tensors, key_rotation, value_rotation if hist_len else None, mask, scaling, softcap,
                  causal=mask is None and q_len > 1, gap_start=sink_length, hist_col0=sink_length,
                  kv_heads=kv_heads, out=out, out_layout="blhd", lse_out=None, dense_start=dense_start)
        return out

    # ------------------------------------------------------------------------------------------ internals
    def _partial(self, query, key, value, tensors, key_rotation, value_rotation, mask, scaling, softcap, causal,
                 gap_start, hist_col0, kv_heads=None):
        batch, q_heads, q_len, dim = query.shape
        out = torch.empty((batch, q_heads, q_len, dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((batch, q_heads, q_len), dtype=torch.float32, device=query.device)
        self._run(query, key, value, tensors, key_rotation, value_rotation, mask, scaling, softcap, causal, gap_start,
                  hist_col0, kv_heads or key.shape[1], out, "bhld", lse)
        return out, lse

    def _run(self, query, key, value, tensors, key_rotation, value_rotation, mask, scaling, softcap, causal,
             gap_start, hist_col0, kv_heads, out, out_layout, lse_out, dense_start=None):
        batch, q_heads, q_len, dim = query.shape
        dense_len = key.shape[2] if key is not None else 0
        hist_len = tensors.plan_length if tensors is not None else 0
        launch = self.launch_for(dim)
        plan = self.plan(query.device, batch, kv_heads, (q_heads // kv_heads) * q_len, dense_len, hist_len, launch)
        cuda = self._use_cuda_history(query, tensors, mask, softcap, kv_heads, hist_len)
        if cuda:  # the history cut for the CUDA kernel: whole tiles filling a wave of its resident programs
            plan = cuda_history.plan_history(plan, hist_len, batch * kv_heads * plan.row_blocks,
                                             self._cuda_slots(query.device, dim), self.cuda_history_config)
        if plan.total_splits == 0:  # nothing to attend: an empty softmax
            out.zero_()
            if lse_out is not None:
                lse_out.fill_(float("-inf"))
            return
        rows = batch * q_heads * q_len * plan.total_splits
        partial_out, partial_lse, rotation_scratch = self._workspace(query.device, rows * dim, rows, query.numel())
        dependent = self.dependent_launches and dependent_launch(query.device)
        rotating = tensors is not None and key_rotation is not None
        history_query = query
        if rotating or cuda:
            history_query = rotation_scratch[: query.numel()].view(query.shape)
        if cuda:  # the query rotation; CUDA: the history; Triton: the BF16 tiers
            overlap = dependent and self.overlap_dense

            def dense_tiers():
                if plan.dense_splits:
                    attention_partials(query, key, value, None, None, None, plan, scaling, softcap, causal,
                                       gap_start, hist_col0, partial_out, partial_lse, kv_heads, launch, dense_start,
                                       dense_only=True, launch_dependents=overlap, overlap_prior=overlap)

            if not overlap:
                dense_tiers()
            if rotating:
                rotate_query(query, key_rotation, history_query, launch_dependents=dependent)
            else:
                history_query.copy_(query)
            cuda_history.history_partials(history_query, tensors, plan, scaling, kv_heads, partial_out, partial_lse,
                                          self.cuda_history_config, dependent=dependent and rotating)
            if overlap:  # beside the history kernel's tail
                dense_tiers()
        else:
            if rotating:
                rotate_query(query, key_rotation, history_query, launch_dependents=dependent)
            attention_partials(query, key, value, tensors, history_query, mask, plan, scaling, softcap, causal,
                               gap_start, hist_col0, partial_out, partial_lse, kv_heads, launch, dense_start,
                               launch_dependents=dependent, wait_for_rotation=dependent and rotating)
        merge_splits(partial_out, partial_lse, plan.total_splits, out, out_layout, value_rotation, plan.dense_splits,
                     kv_heads, lse_out, after_stage1=dependent)

    def _use_cuda_history(self, query, tensors, mask, softcap, kv_heads, hist_len) -> bool:
        if not (self.cuda_history and cuda_history.history_kernel_supports(query, tensors, mask, softcap, kv_heads)):
            return False
        history_bytes = cuda_history.history_bytes(query.shape[0], kv_heads, hist_len, query.shape[-1])
        if history_bytes < self.cuda_history_config.min_history_bytes:
            return False
        return cuda_history.available(cuda_history.device_index(query.device), self.cuda_history_config)

    def _cuda_slots(self, device: torch.device, dim: int) -> int:
        """Resident programs of the CUDA history kernel on the whole device (what its splits fill)."""
        return cuda_history.resident_slots(cuda_history.device_index(device), dim, self.cuda_history_config)

    def launch_for(self, head_dim: int) -> LaunchConfig:
        """The stage-1 launch configuration: the one given to the constructor, else the head_dim's default."""
        return self.launch if self.launch is not None else default_launch(head_dim)

    def plan(self, device, batch, kv_heads, rows, dense_len, hist_len, launch: LaunchConfig) -> SplitPlan:
        return plan_splits(batch, kv_heads, rows, dense_len, hist_len, self._target(device, launch),
                           self.min_dense_tokens,
                           launch.min_history_tokens if self.min_history_tokens is None else self.min_history_tokens,
                           block_n_history=launch.block_n_history, block_n_dense=launch.block_n_dense,
                           small_block_m=launch.block_m,
                           min_programs=(SMALL_GRID_PROGRAMS_PER_SM * multiprocessors(device)
                                         if self.short_splits_on_small_grids else 0))

    def _target(self, device: torch.device, launch: LaunchConfig) -> int:
        if self.target_programs is not None:
            return self.target_programs
        return launch.programs_per_sm * multiprocessors(device)

    def _workspace(self, device: torch.device, out_numel: int, lse_numel: int,
                   query_numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat float32 scratch for the split outputs, their log-sum-exps and the rotated query, reused across
        calls on the same device (each call's kernels consume them before the next call's first kernel starts,
        which is not launched as a dependent); grows, never shrinks."""
        buffers = self._scratch.get(device)
        wanted = (max(out_numel, 1 << 16), max(lse_numel, 1 << 12), max(query_numel, 1 << 12))
        if buffers is None or any(b.numel() < n for b, n in zip(buffers, wanted)):
            old = [b.numel() for b in buffers] if buffers is not None else [0, 0, 0]
            buffers = tuple(torch.empty(max(n, o), dtype=torch.float32, device=device) for n, o in zip(wanted, old))
            self._scratch[device] = buffers
        return buffers

    @staticmethod
    def _supported(query, key, value, mask, history=None) -> bool:
        dim = query.shape[-1]
        if not kernel_head_dim(dim) or query.stride(-1) != 1:
            return False
        if key is not None and (key.shape[-1] != dim or value.shape[-1] != dim or key.stride(-1) != 1
                                or value.stride(-1) != 1 or query.shape[1] % key.shape[1]):
            return False
        if history is not None and (getattr(history, "key_dim", dim) != dim or getattr(history, "value_dim", dim) != dim):
            return False
        if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.stride(-1) != 1):
            return False
        return True


def _history_tensors(history) -> HistoryTensors | None:
    if history is None or history.length == 0:
        return None
    if isinstance(history, QuantizedHistory):
        return HistoryTensors(history.key_codes, history.value_codes, history.key_scale_zero,
                              history.value_scale_zero, history.length, history.config.bits, history.device_length)
    keys = getattr(history, "keys", None)
    if keys is None:
        return None
    return HistoryTensors(keys, history.values, None, None, history.length, length_ptr=history.device_length)
