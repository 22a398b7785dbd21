"""`TritonBackend`: the kernel implementation of the backend operations (`kernels.interface`).

Inputs the kernels do not cover (head_dim not a power of two in [64, 256], key and value head sizes that differ,
per-head masks) fall back to the PyTorch reference, which defines the semantics either way.

Decode (`tiered_attention`) per layer: the query rotated by R_K once (`query_rotation.py`), one stage-1 launch
covering the BF16 tiers and the quantized history (`stage1.py`) and one stage-2 launch that merges the splits,
un-rotates the history by R_Vᵀ and writes `[B, Lq, Hq, D]` in the model dtype (`merge.py`); where the GPU has
programmatic dependent launch (Hopper and newer), each is launched as a dependent of the one before, so that its
launch and prologue overlap the previous kernel's tail. On CUDA, where the call qualifies
(`kernels.cuda.history.history_kernel_supports`: 2- or 4-bit history with float16 or compact pairs, no mask, head_dim
64/128, <= 8 rows per KV head, no left padding, a history of at least `CudaHistoryConfig.min_history_bytes`), the
history splits come from the hand-written kernel instead and the Triton stage 1 covers the BF16 tiers alone, queued
behind it as a dependent that runs beside its tail. The scratch (split partials, rotated query) is reused across calls (no
allocation that grows with the history), and nothing synchronizes the host.

A chunk of queries (chunked prefill) of at least `dequantize_from_rows` query rows per KV head, without a mask,
dequantizes its history once, piece by piece, into a scratch in the model dtype (`dequantize.py`) and attends to
the pieces with the BF16 tiers' kernel (`_tiered_dequantized`): its thousands of rows per KV head would otherwise
unpack every history tile once per row block.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from oscar_hf.kernels.cuda import history as cuda_history
from oscar_hf.kernels.interface import DecodeCall, DemoteCall, HeadSplitTensors, HistoryTensors, kernel_head_dim
from oscar_hf.kernels.reference.backend import ReferenceBackend
from oscar_hf.kernels.reference.quantize import COMPACT, row_bytes
from oscar_hf.kernels.replay import GraphReplay, layout
from oscar_hf.kernels.triton.common import compiling_only, dependent_launch, multiprocessors
from oscar_hf.kernels.triton.demote import KERNEL_ENCODERS, demote_rows
from oscar_hf.kernels.triton.dequantize import dequantize_history
from oscar_hf.kernels.triton.launch_plan import (
    MAX_SPLITS,
    LaunchConfig,
    SplitPlan,
    default_launch,
    plan_runs,
    plan_splits,
)
from oscar_hf.kernels.triton.merge import merge_splits
from oscar_hf.kernels.triton.precompile import ParallelCompile, default_threads
from oscar_hf.kernels.triton.query_rotation import rotate_query
from oscar_hf.kernels.triton.stage1 import attention_partials

# When the split minimums would leave a launch under this many programs per multiprocessor (a short context at
# batch 1, latency-bound), splits are cut down to one history tile and two dense tiles (`plan_splits`'
# `min_programs`): half of the 8 programs that fit one SM at d=128.
SMALL_GRID_PROGRAMS_PER_SM = 4
# (scale, zero) dtypes the kernels write and read: float pairs and compact (uint8) codes
KERNEL_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, COMPACT)
# A call with at least this many query rows per KV head (query heads of a GQA group x query positions: a chunk of a
# chunked prefill) dequantizes its history once, piece by piece, and attends to the pieces with the BF16 kernel
# (`_tiered_dequantized`), instead of unpacking every history tile once per row block.
DEQUANTIZE_FROM_ROWS = 1024
# The least history tokens per dequantized piece; a piece holds at least as many tokens as the call has rows per KV
# head, so that its scratch (keys and values in 16 bits) is at most one split of the call's float32 partials.
DEQUANTIZE_PIECE_TOKENS = 8192


class TritonBackend(ReferenceBackend):
    """Triton kernels on CUDA (or on CPU under `TRITON_INTERPRET=1`, for tests), and the CUDA history kernel.

    Args:
        history_chunk: passed to the reference fallback.
        target_programs: programs per stage-1 launch to aim for (default: `launch.programs_per_sm` per
            multiprocessor).
        min_dense_tokens / min_history_tokens: the shortest split of each tier (tests lower them to force many
            splits on small inputs); history default: the launch's `min_history_tokens`.
        launch: stage-1 tile sizes, warps and pipeline stages (`LaunchConfig`); default: the measured best for
            the head_dim (`default_launch`).
        cuda_history: use the CUDA history kernel where a call qualifies; `cuda_history_config` its compile-time
            shape and the smallest history it takes.
        eager_graphs: replay an eager decode step's kernels from a CUDA graph (`eager_decode_attention`).
        split_waves: a layer split by KV heads cuts its history for this many waves of the CUDA kernel's programs
            (`_run_split`): its runs' launches share one plan, and more, shorter splits let the wider runs' longer
            programs start first and finish among the others instead of after them.
        dequantize_from_rows: unmasked calls with at least this many query rows per KV head dequantize their
            quantized history piece by piece into a scratch in the model dtype and attend to it with the BF16
            kernel (`_tiered_dequantized`); None: never (every row block unpacks the history itself).
        compile_threads: a call of a new shape first compiles its Triton kernels on this many threads, launching
            nothing, then runs (`precompile.ParallelCompile`); default: up to 16, one per CPU; below 2: each
            kernel compiles at its launch.
    """

    name = "triton"
    decodes_split_histories = True  # `kernels.interface`: decode calls take a `HeadSplitTensors` whole

    def __init__(self, history_chunk: int = 4096, target_programs: int | None = None,
                 min_dense_tokens: int = 256, min_history_tokens: int | None = None, launch: LaunchConfig | None = None,
                 cuda_history: bool = True,
                 cuda_history_config: cuda_history.CudaHistoryConfig = cuda_history.CudaHistoryConfig(),
                 eager_graphs: bool = True, split_waves: int = 4,
                 dequantize_from_rows: int | None = DEQUANTIZE_FROM_ROWS, compile_threads: int | None = None):
        super().__init__(history_chunk=history_chunk)
        self.compile_threads = compile_threads
        self.compiles = ParallelCompile(default_threads() if compile_threads is None else compile_threads)
        self.dequantize_from_rows = dequantize_from_rows
        self.launch = launch
        self.target_programs = target_programs
        self.min_dense_tokens = min_dense_tokens
        self.min_history_tokens = min_history_tokens
        self.cuda_history = cuda_history
        self.cuda_history_config = cuda_history_config
        self._scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.graphs = GraphReplay() if eager_graphs else None
        if split_waves < 1:
            raise ValueError(f"split_waves={split_waves}: expected a whole number of waves >= 1")
        self.split_waves = split_waves

    def graph_capture_problem(self, key_dim: int, value_dim: int, encoder: str,
                              scale_dtype: torch.dtype = torch.float16) -> str | None:
        if encoder not in KERNEL_ENCODERS:
            return f"encoder {encoder!r} demotes through the PyTorch reference"
        if scale_dtype not in KERNEL_SCALE_DTYPES:
            return f"(scale, zero) pairs in {scale_dtype} are read by the PyTorch reference"
        if key_dim != value_dim or not kernel_head_dim(key_dim):
            return "the kernels do not take its head sizes (powers of two from 64 to 256, keys and values alike)"
        return None

    # ------------------------------------------------------------------------------------------ demotion
    def demote(self, x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder="minmax") -> None:
        if (encoder not in KERNEL_ENCODERS or not kernel_head_dim(x.shape[-1])  # lloyd: the reference only
                or scale_zero_out.dtype not in KERNEL_SCALE_DTYPES):
            return super().demote(x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder)
        demote_rows([(x, rotation, clip_ratio, codes_out, scale_zero_out)], bits, encoder=encoder)

    @staticmethod
    def _kernel_demotes_kv(call: DemoteCall) -> bool:
        """Whether the demotion kernel takes keys and values in one launch (else the reference demotes them)."""
        return (call.encoder in KERNEL_ENCODERS and call.keys.shape == call.values.shape
                and kernel_head_dim(call.keys.shape[-1]) and call.key_scale_zero.dtype in KERNEL_SCALE_DTYPES)

    def demote_kv(self, call: DemoteCall) -> None:
        if not self._kernel_demotes_kv(call):
            return super().demote_kv(call)
        self.compiles.first("demote_kv", (call,), call.keys.device, lambda: demote_rows(
            _demotion_pairs(call), call.bits, encoder=call.encoder, only_if=call.only_if))

    def demote_kv_at(self, call: DemoteCall, at: torch.Tensor) -> torch.Tensor:
        if not self._kernel_demotes_kv(call):
            return super().demote_kv_at(call, at)
        lost = torch.empty_like(call.only_if)
        self.compiles.first("demote_kv_at", (call, at), call.keys.device, lambda: demote_rows(
            _demotion_pairs(call), call.bits, encoder=call.encoder, only_if=call.only_if, at=at, lost=lost))
        return lost

    # ------------------------------------------------------------------------------------------ attention
    def dense_attention(self, query, key, value, mask, scaling, softcap=None):
        if not self._supported(query, key, value, mask):
            return super().dense_attention(query, key, value, mask, scaling, softcap)
        return self._partial(query, key, value, None, None, None, mask, scaling, softcap, causal=False,
                             gap_start=key.shape[2], hist_col0=0)

    def history_attention(self, query, history: HistoryTensors, key_rotation, value_rotation, mask, scaling,
                          softcap=None):
        if not history.length or not self._supported(query, None, None, mask, history):
            return super().history_attention(query, history, key_rotation, value_rotation, mask, scaling, softcap)
        return self._partial(query, None, None, history, key_rotation, value_rotation, mask, scaling, softcap,
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
                         scaling, softcap=None, dense_start=None, history_start=None, sinks=None):
        """BF16 tiers (`key`/`value`, model basis) + history between columns `sink_length` and
        `sink_length + history.length`: `[B, Lq, Hq, D]` in the query dtype (`kernels.interface`)."""
        tensors = history if history is not None and history.length else None
        if not self._supported(query, key, value, mask, tensors):
            return super().tiered_attention(query, key, value, mask, history, sink_length, key_rotation,
                                            value_rotation, scaling, softcap, dense_start, history_start, sinks)
        args = (query, key, value, mask, tensors, sink_length, key_rotation, value_rotation, scaling, softcap,
                dense_start, history_start, sinks)
        return self.compiles.first("tiered_attention", args, query.device, lambda: self._tiered_attention(*args))

    def _tiered_attention(self, query, key, value, mask, tensors, sink_length, key_rotation, value_rotation,
                          scaling, softcap, dense_start, history_start, sinks):
        hist_len = tensors.length if tensors is not None else 0
        batch, q_heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        out = self.new_output((batch, q_len, q_heads, dim), query.dtype, query.device)
        if (hist_len and tensors.quantized and mask is None and dense_start is None and history_start is None
                and self.dequantize_from_rows is not None
                and q_heads // kv_heads * q_len >= self.dequantize_from_rows):
            self._tiered_dequantized(query, key, value, tensors, sink_length, key_rotation, value_rotation, scaling,
                                     softcap, out, sinks)
            return out
        self._run(query, key, value, tensors, key_rotation, value_rotation if hist_len else None, mask, scaling, softcap,
                  causal=mask is None and q_len > 1, gap_start=sink_length, hist_col0=sink_length,
                  kv_heads=kv_heads, out=out, out_layout="blhd", lse_out=None, dense_start=dense_start,
                  history_start=history_start, sinks=sinks)
        return out

    def _tiered_dequantized(self, query, key, value, history: HistoryTensors, sink_length, key_rotation,
                            value_rotation, scaling, softcap, out, sinks=None) -> None:
        """`tiered_attention` of an unmasked chunk of queries, the history dequantized once: the BF16 tiers (causal
        among the chunk's own tokens) as one partial, then each piece of the history, dequantized into a scratch
        in the model dtype (rotated basis), attended to by the rotated query (`query @ R_K`, rounded to the model
        dtype as the BF16 tiers' query is) as one partial each; one merge applies `R_Vᵀ` to the history's."""
        batch, q_heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        rows = q_heads // kv_heads * q_len
        piece = -(-max(rows, DEQUANTIZE_PIECE_TOKENS) // 64) * 64
        starts = range(0, history.length, piece)
        splits = 1 + len(starts)
        parts = torch.empty((batch, q_heads, q_len, splits, dim), dtype=torch.float32, device=query.device)
        lses = torch.empty((batch, q_heads, q_len, splits), dtype=torch.float32, device=query.device)
        self._run(query, key, value, None, None, None, None, scaling, softcap, causal=q_len > 1,
                  gap_start=sink_length, hist_col0=sink_length, kv_heads=kv_heads, out=parts[:, :, :, 0],
                  out_layout="bhld", lse_out=lses[..., 0])
        rotated = query if key_rotation is None else rotate_query(query, key_rotation)
        scratch = torch.empty((2, batch, kv_heads, min(piece, history.length), dim), dtype=query.dtype,
                              device=query.device)
        for i, start in enumerate(starts, 1):
            n = min(piece, history.length - start)
            keys, values = scratch[0, :, :, :n], scratch[1, :, :, :n]
            dequantize_history(history, start, keys, values)
            self._run(rotated, keys, values, None, None, None, None, scaling, softcap, causal=False, gap_start=n,
                      hist_col0=0, kv_heads=kv_heads, out=parts[:, :, :, i], out_layout="bhld",
                      lse_out=lses[..., i])
        merge_splits(parts, lses, splits, out, "blhd", value_rotation, 1, kv_heads, sinks=sinks)

    def decode_attention(self, call: DecodeCall) -> torch.Tensor:
        """A single-token step over device-counted BF16 rows and history (`kernels.interface`): the splits are cut
        for the buffers' capacities and the kernels read the lengths, so nothing synchronizes the host. A split
        history (`HeadSplitTensors`) is served in one call (`_run_split`)."""
        if not self._decode_supported(call):  # split histories then go run by run
            return super().decode_attention(call)
        return self.compiles.first("decode_attention", (call,), call.query.device, lambda: self._decode(call))

    def _decode(self, call: DecodeCall) -> torch.Tensor:
        batch, q_heads, q_len, dim = call.query.shape
        out = self.new_output((batch, q_len, q_heads, dim), call.query.dtype, call.query.device)
        if isinstance(call.history, HeadSplitTensors):
            self._run_split(call, out)
            return out
        self._run(call.query, call.keys, call.values, call.history, call.key_rotation,
                  call.value_rotation if call.history is not None else None, None, call.scaling, call.softcap,
                  causal=False, gap_start=0, hist_col0=0, kv_heads=call.keys.shape[1], out=out, out_layout="blhd",
                  lse_out=None, dense_start=call.dense_start, dense_length=call.dense_length,
                  history_start=call.history_start, sinks=call.sinks)
        return out

    def eager_decode_attention(self, call: DecodeCall) -> torch.Tensor:
        """`decode_attention` for an eager step: on CUDA its kernels are captured once per layout (the second call
        with it) and replayed from the CUDA graph after that (`kernels.replay`), one launch for the host instead of
        four. The key names every tensor's layout and address and every setting the launches depend on. A
        compile-only pass (`precompile`) goes straight to the kernels: it runs on tensors that are gone after it,
        whose addresses a later call's may take, so it must leave no key behind."""
        if (self.graphs is None or not call.query.is_cuda or not self._decode_supported(call)
                or compiling_only()):
            return self.decode_attention(call)
        c = call
        key = (layout(c.keys), layout(c.values), layout(c.dense_length), layout(c.dense_start),
               layout(c.history_start), layout(c.key_rotation), layout(c.value_rotation), layout(c.sinks),
               float(c.scaling),
               c.softcap, self._settings(), _history_key(c.history))
        return self.graphs(key, c.query, lambda q: self.decode_attention(replace(c, query=q)),
                           keep=lambda: self._scratch.get(c.query.device))

    def rehearse(self, name: str, args: tuple, device: torch.device, calls) -> None:
        """A compile-only pass of `calls()`, once per `name` and shape of `args` (`ParallelCompile.rehearse`)."""
        self.compiles.rehearse(name, args, device, calls)

    def _settings(self) -> tuple:
        """The constructor settings a launch depends on (part of a replayed call's key)."""
        return (self.launch, self.target_programs, self.min_dense_tokens, self.min_history_tokens,
                self.cuda_history, self.cuda_history_config, self.split_waves, self.dequantize_from_rows)

    def settings(self) -> dict:
        """The constructor's arguments, as data (`kernels.select.backend_spec`)."""
        return {"history_chunk": self.history_chunk, "target_programs": self.target_programs,
                "min_dense_tokens": self.min_dense_tokens, "min_history_tokens": self.min_history_tokens,
                "launch": None if self.launch is None else asdict(self.launch), "cuda_history": self.cuda_history,
                "cuda_history_config": asdict(self.cuda_history_config), "eager_graphs": self.graphs is not None,
                "split_waves": self.split_waves, "dequantize_from_rows": self.dequantize_from_rows,
                "compile_threads": self.compile_threads}

    @classmethod
    def from_settings(cls, settings: dict) -> TritonBackend:
        """The backend `settings()` describes."""
        launch, history_config = settings.get("launch"), settings.get("cuda_history_config")
        return cls(**(settings | {
            "launch": None if launch is None else LaunchConfig(**launch),
            "cuda_history_config": cuda_history.CudaHistoryConfig(**(history_config or {}))}))

    def new_output(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor `tiered_attention` writes every element of (uninitialized)."""
        return torch.empty(shape, dtype=dtype, device=device)

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
             gap_start, hist_col0, kv_heads, out, out_layout, lse_out, dense_start=None, dense_length=None,
             history_start=None, sinks=None):
        batch, q_heads, q_len, dim = query.shape
        dense_len = key.shape[2] if key is not None else 0
        hist_len = tensors.plan_length if tensors is not None else 0
        group_rows = (q_heads // kv_heads) * q_len
        launch = self.launch_for(dim, group_rows, masked=mask is not None)
        plan = self.plan(query.device, batch, kv_heads, group_rows, dense_len, hist_len, launch)
        # the CUDA history kernel reads every history row of a batch row: padded rows go through Triton's
        cuda = history_start is None and self._use_cuda_history(query, tensors, mask, softcap, kv_heads, hist_len)
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
        dependent = dependent_launch(query.device)
        rotating = tensors is not None and key_rotation is not None
        history_query = query
        if rotating or cuda:
            history_query = rotation_scratch[: query.numel()].view(query.shape)
        if cuda:  # the query rotation; CUDA: the history; Triton: the BF16 tiers, beside the history kernel's tail

            def dense_tiers():
                if plan.dense_splits:
                    attention_partials(query, key, value, None, None, None, plan, scaling, softcap, causal,
                                       gap_start, hist_col0, partial_out, partial_lse, kv_heads, launch, dense_start,
                                       dense_only=True, launch_dependents=dependent, overlap_prior=dependent,
                                       dense_length=dense_length)

            if not dependent:
                dense_tiers()
            if rotating:
                rotate_query(query, key_rotation, history_query, launch_dependents=dependent)
            else:
                history_query.copy_(query)
            cuda_history.history_partials(history_query, tensors, plan, scaling, kv_heads, partial_out, partial_lse,
                                          self.cuda_history_config, dependent=dependent and rotating)
            if dependent:
                dense_tiers()
        else:
            if rotating:
                rotate_query(query, key_rotation, history_query, launch_dependents=dependent)
            attention_partials(query, key, value, tensors, history_query, mask, plan, scaling, softcap, causal,
                               gap_start, hist_col0, partial_out, partial_lse, kv_heads, launch, dense_start,
                               launch_dependents=dependent, wait_for_rotation=dependent and rotating,
                               dense_length=dense_length, history_start=history_start)
        merge_splits(partial_out, partial_lse, plan.total_splits, out, out_layout, value_rotation, plan.dense_splits,
                     kv_heads, lse_out, after_stage1=dependent, sinks=sinks)

    def _run_split(self, call: DecodeCall, out: torch.Tensor) -> None:
        """`decode_attention` over a history kept as runs of KV heads of different widths, as one call: the query
        rotated once, the BF16 tiers' splits in one launch and one merge for the whole layer, and the history's
        splits into the same partial buffers: one launch of the CUDA kernel for every run where it takes them all
        (`cuda_history.history_runs_partials`, runs of either code width), else one launch per run (the CUDA kernel
        for the runs it takes, Triton's for the others). The layer's history programs are shared among the runs in
        proportion to their bytes (`plan_runs`): a 4-bit run's splits are half as long as a 2-bit run's, so that all
        programs take about as long.

        Where launches can be programmatic dependents (Hopper+), the BF16 tiers' launch follows the rotation as an
        ordinary launch (so the rotated query is complete when it starts), and each run's history launch is queued
        as a dependent of the launch before it that runs beside it and waits for it only before finishing: the
        runs share the GPU as one wave would, and the merge, a dependent of the last, sees every partial."""
        query, keys, values, split = call.query, call.keys, call.values, call.history
        softcap, history_start, dense_start = call.softcap, call.history_start, call.dense_start
        scaling, key_rotation, value_rotation, dense_length = (call.scaling, call.key_rotation, call.value_rotation,
                                                               call.dense_length)
        batch, q_heads, q_len, dim = query.shape
        kv_heads = keys.shape[1]
        groups = q_heads // kv_heads
        hist_len = split.plan_length
        launch = self.launch_for(dim, groups * q_len)
        plan = self.plan(query.device, batch, kv_heads, groups * q_len, keys.shape[2], hist_len, launch)
        # the CUDA kernel's minimum is the layer's history, not a run's: its launches here are the same either way
        layer_bytes = sum(cuda_history.history_bytes(batch, r.stop - r.start, hist_len, dim,
                                                     r.history.key_scale_zero.dtype, r.history.bits)
                          for r in split.runs)
        cuda = [history_start is None and self._use_cuda_history(query[:, r.start * groups : r.stop * groups],
                                                                 r.history, None, softcap, r.stop - r.start,
                                                                 hist_len, layer_bytes)
                for r in split.runs]
        max_splits = MAX_SPLITS
        if any(cuda):  # whole tiles filling `split_waves` waves of the CUDA kernel's programs over the layer
            plan = cuda_history.plan_history(plan, hist_len, batch * kv_heads * plan.row_blocks,
                                             self.split_waves * self._cuda_slots(query.device, dim),
                                             self.cuda_history_config)
            max_splits = self.cuda_history_config.max_splits
        run_plans, partial_splits = plan_runs(
            plan, hist_len, tuple(r.stop - r.start for r in split.runs),
            tuple(row_bytes(dim, r.history.bits, r.history.key_scale_zero.dtype) for r in split.runs), max_splits)
        rows = batch * q_heads * q_len * partial_splits
        partial_out, partial_lse, rotation_scratch = self._workspace(query.device, rows * dim, rows, query.numel())
        dependent = dependent_launch(query.device)
        rotated = rotation_scratch[: query.numel()].view(query.shape)
        if key_rotation is not None:
            rotate_query(query, key_rotation, rotated)
        else:
            rotated.copy_(query)
        attention_partials(query, keys, values, None, None, None, plan, scaling, softcap, False, 0, 0, partial_out,
                           partial_lse, kv_heads, launch, dense_start, dense_only=True, launch_dependents=dependent,
                           dense_length=dense_length, partial_splits=partial_splits)
        if all(cuda) and len(split.runs) <= cuda_history.MAX_RUNS and cuda_history.available(
                cuda_history.device_index(query.device), self.cuda_history_config, cuda_history.RUNS):
            # every run's splits in one launch
            cuda_history.history_runs_partials(rotated, split.runs, run_plans, scaling, kv_heads, partial_out,
                                               partial_lse, partial_splits, self.cuda_history_config,
                                               beside=dependent and plan.dense_splits > 0)
            order = ()
        else:  # the widest runs first: the GPU starts programs in launch order, and theirs are the most
            order = sorted(range(len(split.runs)), key=lambda i: -split.runs[i].history.bits)
        for i, j in enumerate(order):
            run, run_plan = split.runs[j], run_plans[j]
            first_heads, last_heads = run.start * groups, run.stop * groups
            # beside the launch before; not beside the rotation, whose output it reads
            beside = dependent and (i > 0 or plan.dense_splits > 0)
            if cuda[j]:
                cuda_history.history_partials(rotated[:, first_heads:last_heads], run.history, run_plan, scaling,
                                              run.stop - run.start, partial_out, partial_lse,
                                              self.cuda_history_config, head_offset=first_heads,
                                              partial_heads=q_heads, beside=beside, partial_splits=partial_splits)
            else:
                attention_partials(query[:, first_heads:last_heads], None, None, run.history,
                                   rotated[:, first_heads:last_heads], None, run_plan, scaling, softcap, False, 0, 0,
                                   partial_out, partial_lse, run.stop - run.start, launch,
                                   launch_dependents=dependent, overlap_prior=beside, history_start=history_start,
                                   history_only=True, head_offset=first_heads, partial_heads=q_heads,
                                   partial_splits=partial_splits)
        merge_splits(partial_out, partial_lse, partial_splits, out, "blhd", value_rotation, plan.dense_splits,
                     kv_heads, None, after_stage1=dependent, sinks=call.sinks)

    def _decode_supported(self, call: DecodeCall) -> bool:
        """Whether the kernels serve a decode call (over a split history: in one call, `_run_split`), else the
        reference does (a split history then run by run)."""
        if isinstance(call.history, HeadSplitTensors):
            return all(r.history is not None and self._supported(call.query, call.keys, call.values, None, r.history)
                       for r in call.history.runs)
        return self._supported(call.query, call.keys, call.values, None, call.history)

    def _use_cuda_history(self, query, tensors, mask, softcap, kv_heads, hist_len, history_bytes=None) -> bool:
        """Whether the CUDA kernel reads this history: it qualifies, and the history (`history_bytes`, default
        this call's) is at least the kernel's minimum."""
        if not (self.cuda_history and cuda_history.history_kernel_supports(query, tensors, mask, softcap, kv_heads)):
            return False
        if history_bytes is None:
            history_bytes = cuda_history.history_bytes(query.shape[0], kv_heads, hist_len, query.shape[-1],
                                                       tensors.key_scale_zero.dtype, tensors.bits)
        if history_bytes < self.cuda_history_config.min_history_bytes:
            return False
        return cuda_history.available(cuda_history.device_index(query.device), self.cuda_history_config,
                                      tensors.bits)

    def _cuda_slots(self, device: torch.device, dim: int) -> int:
        """Resident programs of the CUDA history kernel on the whole device (what its splits fill)."""
        return cuda_history.resident_slots(cuda_history.device_index(device), dim, self.cuda_history_config)

    def launch_for(self, head_dim: int, rows: int = 1, masked: bool = False) -> LaunchConfig:
        """The stage-1 launch configuration: the one given to the constructor, else the default for the head_dim,
        the call's query rows per KV head and whether it reads a mask tensor."""
        return self.launch if self.launch is not None else default_launch(head_dim, rows, masked)

    def plan(self, device, batch, kv_heads, rows, dense_len, hist_len, launch: LaunchConfig) -> SplitPlan:
        return plan_splits(batch, kv_heads, rows, dense_len, hist_len, self._target(device, launch),
                           self.min_dense_tokens,
                           launch.min_history_tokens if self.min_history_tokens is None else self.min_history_tokens,
                           block_n_history=launch.block_n_history, block_n_dense=launch.block_n_dense,
                           small_block_m=launch.block_m, many_rows_block_m=launch.many_rows_block_m,
                           min_programs=SMALL_GRID_PROGRAMS_PER_SM * multiprocessors(device))

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
            if self.graphs is not None:  # they write the old scratch, which they would keep allocated
                self.graphs.clear()
        return buffers

    @staticmethod
    def _supported(query, key, value, mask, history=None) -> bool:
        dim = query.shape[-1]
        if not kernel_head_dim(dim) or query.stride(-1) != 1:
            return False
        if key is not None and (key.shape[-1] != dim or value.shape[-1] != dim or key.stride(-1) != 1
                                or value.stride(-1) != 1 or query.shape[1] % key.shape[1]):
            return False
        if history is not None and (history.key_dim != dim or history.value_dim != dim):
            return False
        if history is not None and history.quantized and history.key_scale_zero.dtype not in KERNEL_SCALE_DTYPES:
            return False
        if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.stride(-1) != 1):
            return False
        return True


def _history_key(history) -> tuple | None:
    """What a replayed call's key records of its history: every buffer's layout and the settings (per run of a
    split history)."""
    if history is None:
        return None
    if isinstance(history, HeadSplitTensors):
        return tuple((run.start, run.stop, _history_key(run.history)) for run in history.runs)
    h = history
    return (layout(h.keys), layout(h.values), layout(h.key_scale_zero), layout(h.value_scale_zero), h.length, h.bits,
            layout(h.length_ptr))


def _demotion_pairs(call: DemoteCall) -> list[tuple]:
    """The demotion kernel's per-tensor arguments: (rows, rotation, clip ratio, codes, scale-zero) for keys, then
    values."""
    return [(call.keys, call.key_rotation, call.key_clip_ratio, call.key_codes, call.key_scale_zero),
            (call.values, call.value_rotation, call.value_clip_ratio, call.value_codes, call.value_scale_zero)]
