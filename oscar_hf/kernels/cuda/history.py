"""The hand-written history tier of stage 1 (`history_partials.cu`), compiled at run time (`nvrtc.py`) and launched
through the CUDA driver.

Contract: `kernels.triton.stage1.attention_partials`' for the history splits only (same partial layout, rounding
points and log-sum-exp), restricted to the decode hot path: 2- or 4-bit codes (`CODE_BITS`; each width, and the
kernels that read a split layer's runs of both in one launch, a module of its own: the first one asked for starts
all of them compiling on threads), float16 or compact (scale, zero) pairs (`PAIR_DTYPES`), head_dim 64 or 128, at
most 8 query rows per KV head (a GQA group x query positions), no mask, no softcap, a float16/bfloat16 model.
`history_kernel_supports` says whether a call qualifies; the Triton kernel covers everything else and is the path
tested against the reference on CPU (this kernel is checked against both on the GPU).

Why not Triton: the value codes must reach the tensor cores as pairs of tokens, the query and p as fragments of
their own. Triton re-lays the query out every tile and pairs value codes through byte-wise shared-memory loads;
the CUDA kernel builds the fragments in registers and, with at most 4 query rows per KV head (one decode position
of a GQA-4 model), scores two 16-token groups per MMA (kernels `_r4`), so each lane scores, exponentiates and sums
half as many elements.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import triton
from transformers.utils import logging

from oscar_hf.kernels.cuda import nvrtc
from oscar_hf.kernels.reference.quantize import COMPACT, row_bytes
from oscar_hf.kernels.triton.common import compiling_only, launch_device, multiprocessors
from oscar_hf.kernels.triton.launch_plan import SplitPlan

logger = logging.get_logger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "history_partials.cu")
DIMS = (64, 128)
_LOG2E = 1.4426950408889634
MAX_ROWS = 8  # the MMA's N: query rows per KV head
NARROW_ROWS = 4  # at most this many rows: the kernels whose score MMAs carry two token groups
ROW_VARIANTS = (NARROW_ROWS, MAX_ROWS)
TILE = 64  # history tokens per tile; split lengths are multiples of it
WARP = 32  # threads per program
KEY_CHAINS = 4  # independent score accumulators per tile (over its m-tiles): hides the MMA latency of one chain
# pair dtypes the kernel reads: float16 (scale, zero), or compact one-byte codes (`reference.quantize.COMPACT`)
PAIR_DTYPES = (torch.float16, COMPACT)
CODE_BITS = (2, 4)  # code widths the kernel reads
RUNS = 0  # the module of `history_runs_partials`' kernels, which read runs of every width (`CODE_BITS` define 0)
RUNS_PAIRS = torch.float16  # the pair dtype a kernel of runs is loaded under: it reads every run's own


@dataclass(frozen=True)
class CudaHistoryConfig:
    """Compile-time shape of the kernel (its defines; the source states no defaults) and when it is used.

    stages: 64-token tiles per warp in shared memory (stages - 1 in flight).
    min_warps_per_sm: programs per multiprocessor the register allocation must allow.
    magic_planes: bit c set = value plane c keeps its magic number instead of a subtraction (planes 0, 2, 3: the
        same error against the Triton kernel as none, and the fastest whole calls).
    max_splits: cap on history splits per KV head row.
    min_history_bytes: calls with a smaller history (codes + scale/zero of every row) run on the Triton kernel,
        whose call launches one kernel fewer; below about 4 MiB that is faster.
    """

    stages: int = 4
    min_warps_per_sm: int = 8
    magic_planes: int = 0b1101
    max_splits: int = 128
    min_history_bytes: int = 4 << 20

    def defines(self, bits: int = 2) -> dict[str, int]:
        """The `-D` definitions `history_partials.cu` is compiled with for the kernels of `bits`-bit codes (`RUNS`:
        the kernels of runs of both widths)."""
        if bits not in CODE_BITS + (RUNS,):
            raise ValueError(f"the CUDA history kernel reads codes of {CODE_BITS} bits, not {bits}")
        return {"STAGES": self.stages, "MIN_WARPS_PER_SM": self.min_warps_per_sm,
                "MAGIC_PLANES": self.magic_planes, "KEY_CHAINS": KEY_CHAINS, "CODE_BITS": bits}


def compile_cubin(arch: int, config: CudaHistoryConfig = CudaHistoryConfig(), bits: int = 2) -> bytes:
    """NVRTC-compile the kernels of `bits`-bit codes (`RUNS`: of runs of both widths) in `history_partials.cu` for
    `sm_{arch}` (e.g. 90) into a CUBIN; needs no GPU."""
    return nvrtc.compile_cubin(SOURCE, arch, config.defines(bits))


_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# The kernels' parameters (`HISTORY_KERNEL` in `history_partials.cu`), by name and ctypes type, in the source's order
# (tests/test_kernels_cuda_history.py checks them against it); `kernel_arguments` orders a launch's values by them.
PARAMETERS: tuple[tuple[str, type], ...] = (
    # the rotated query and its batch, head and position strides (float32 elements)
    ("rotated_query", _P), ("sqb", _I), ("sqh", _I), ("sql", _I),
    # key codes, key (scale, zero) pairs, value codes, value pairs: each with its batch and KV head strides
    ("key_codes", _P), ("skb", _I), ("skh", _I),
    ("key_sz", _P), ("szb", _I), ("szh", _I),
    ("value_codes", _P), ("svb", _I), ("svh", _I),
    ("value_sz", _P), ("swb", _I), ("swh", _I),
    # the partial buffers, and the history length on the device (read where `length_from_ptr`)
    ("out", _P), ("lse", _P), ("length_ptr", _P),
    ("length", _I), ("groups", _I), ("kv_heads", _I), ("q_len", _I), ("dense_splits", _I), ("split_len", _I),
    ("history_splits", _I), ("total_splits", _I), ("length_from_ptr", _I), ("split_multiple", _I),
    # the query scale (log2 e included), the call's first query head in the partial buffers and their query heads,
    # whether to wait for the kernel queued before only at the end
    ("q_scale", _F), ("head0", _I), ("partial_heads", _I), ("wait_at_end", _I),
)
PARAMETER_NAMES = tuple(name for name, _ in PARAMETERS)
ARG_TYPES = tuple(ctype for _, ctype in PARAMETERS)

MAX_RUNS = 4  # runs of KV heads one launch of `history_runs_partials` reads (`MAX_RUNS` in the source)


class HistoryRun(ctypes.Structure):
    """One run of KV heads (`HistoryRun` in `history_partials.cu`, field for field): its tensors and their batch and
    KV head strides, its first KV head in the layer, its code width and pair format, and its splits."""

    _fields_ = [("key_codes", _P), ("key_sz", _P), ("value_codes", _P), ("value_sz", _P),
                *((name, _I) for name in ("skb", "skh", "szb", "szh", "svb", "svh", "swb", "swh", "head_start",
                                          "bits", "compact", "split_len", "history_splits"))]


class HistoryRuns(ctypes.Structure):
    """A layer's runs, passed by value (`HistoryRuns` in the source)."""

    _fields_ = [("run", HistoryRun * MAX_RUNS), ("count", _I)]


# The parameters of the kernels of runs (`HISTORY_RUNS_KERNEL`), as `PARAMETERS` are for `HISTORY_KERNEL`
RUNS_PARAMETERS: tuple[tuple[str, type], ...] = (
    ("rotated_query", _P), ("sqb", _I), ("sqh", _I), ("sql", _I), ("runs", HistoryRuns), ("out", _P), ("lse", _P),
    ("length_ptr", _P), ("length", _I), ("groups", _I), ("kv_heads", _I), ("q_len", _I), ("dense_splits", _I),
    ("total_splits", _I), ("length_from_ptr", _I), ("split_multiple", _I), ("q_scale", _F), ("partial_heads", _I),
    ("wait_at_end", _I),
)
RUNS_ARG_TYPES = tuple(ctype for _, ctype in RUNS_PARAMETERS)


def kernel_arguments(parameters: tuple[tuple[str, type], ...] = PARAMETERS, **values) -> list:
    """A launch's argument values, given by parameter name (`PARAMETERS`, or `RUNS_PARAMETERS`), in the kernel's
    order."""
    names = tuple(name for name, _ in parameters)
    try:
        ordered = [values[name] for name in names]
    except KeyError as missing:
        raise TypeError(f"the CUDA history kernel's parameter {missing} has no value") from None
    if len(values) != len(names):
        raise TypeError(f"the CUDA history kernel has no parameters {sorted(set(values) - set(names))}")
    return ordered


def stage_bytes(dim: int, bits: int = 2) -> int:
    """Shared memory of one staged tile: codes of 64 keys and 64 values, and their (scale, zero) words."""
    return 2 * TILE * dim * bits // 8 + 2 * TILE * 4


def history_bytes(batch: int, kv_heads: int, length: int, dim: int, pair_dtype: torch.dtype = torch.float16,
                  bits: int = 2) -> int:
    """Bytes of a history a call reads: the codes and (scale, zero) pairs of K and V for every row."""
    return batch * kv_heads * length * 2 * row_bytes(dim, bits, pair_dtype)


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel_name(dim: int, rows: int, pair_dtype: torch.dtype = torch.float16, bits: int = 2) -> str:
    """The kernel for head_dim `dim` whose MMA columns hold `rows` query rows (4: two token groups per MMA),
    reading `bits`-bit codes and (scale, zero) pairs of `pair_dtype` (`PAIR_DTYPES`); `bits` = `RUNS`: the kernel of
    runs, whatever their widths and pairs."""
    if bits == RUNS:
        return f"runs_history_partials_d{dim}_r{rows}"
    return f"int{bits}_history_partials_d{dim}_r{rows}" + ("_compact" if pair_dtype == COMPACT else "")


@functools.lru_cache(maxsize=None)
def load_kernel(device_index: int, dim: int, config: CudaHistoryConfig = CudaHistoryConfig(),
                rows: int = MAX_ROWS, pair_dtype: torch.dtype = torch.float16, bits: int = 2) -> nvrtc.Kernel:
    """Compile (once per device, config and code width) and load the kernel for `dim`, `rows`, `pair_dtype` and
    `bits` on CUDA device `device_index`."""
    # one buffer beyond the pipeline's stages holds a split's partial last tile; runs stage tiles of either width
    stage = max(stage_bytes(dim, width) for width in CODE_BITS) if bits == RUNS else stage_bytes(dim, bits)
    return nvrtc.Kernel(_device_cubin(device_index, config, bits), kernel_name(dim, rows, pair_dtype, bits),
                        device_index, RUNS_ARG_TYPES if bits == RUNS else ARG_TYPES, (config.stages + 1) * stage,
                        WARP)


# NVRTC compiles, one thread per module: the first module asked for starts them all, and they compile side by side
# (NVRTC releases the interpreter lock) instead of one after the other on a new machine's first call
_COMPILES = ThreadPoolExecutor(len(CODE_BITS) + 1, thread_name_prefix="oscar-nvrtc")
_cubins: dict[tuple, Future] = {}
_cubins_lock = threading.Lock()


def _device_cubin(device_index: int, config: CudaHistoryConfig, bits: int) -> bytes:
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = 10 * major + minor
    with _cubins_lock:
        for width in CODE_BITS + (RUNS,):
            if (arch, config, width) not in _cubins:
                _cubins[arch, config, width] = _COMPILES.submit(compile_cubin, arch, config, width)
        compiled = _cubins[arch, config, bits]
    return compiled.result()


@functools.lru_cache(maxsize=None)
def resident_slots(device_index: int, dim: int, config: CudaHistoryConfig = CudaHistoryConfig()) -> int:
    """Programs of the 2-bit kernel resident on the whole device at once (one wave; the fewest of its row and pair
    variants): what a layer's history splits are cut to fill."""
    per_sm = min(load_kernel(device_index, dim, config, rows, pairs).resident_programs()
                 for rows in ROW_VARIANTS for pairs in PAIR_DTYPES)
    return per_sm * multiprocessors(torch.device("cuda", device_index))


@functools.lru_cache(maxsize=None)
def available(device_index: int, config: CudaHistoryConfig = CudaHistoryConfig(), bits: int = 2) -> bool:
    """Whether the kernels of `bits`-bit codes compile and load on this device (sm_80+ and libnvrtc); warns once if
    they do not."""
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return False
    try:
        for dim in DIMS:
            for rows in ROW_VARIANTS:
                for pairs in PAIR_DTYPES if bits != RUNS else (RUNS_PAIRS,):  # one kernel of runs reads both
                    load_kernel(device_index, dim, config, rows, pairs, bits)
    except (OSError, RuntimeError) as error:
        logger.warning_once("OSCAR's CUDA history kernel is unavailable (%s); the Triton kernel is used instead",
                            str(error))
        return False
    return True


def history_kernel_supports(query: torch.Tensor, history, mask, softcap, kv_heads: int) -> bool:
    """Whether this kernel covers a call's history tier (see the module docstring); `history` a
    `kernels.interface.HistoryTensors`."""
    if not query.is_cuda or history is None or not history.quantized:
        return False
    batch, q_heads, q_len, dim = query.shape
    pairs = history.key_scale_zero.dtype
    return (dim in DIMS and history.bits in CODE_BITS and pairs in PAIR_DTYPES and history.value_scale_zero.dtype == pairs
            and query.dtype in (torch.float16, torch.bfloat16)
            and mask is None and softcap is None and (q_heads // kv_heads) * q_len <= MAX_ROWS
            and _code_layout_ok(history))


def _code_layout_ok(history) -> bool:
    """Code rows are contiguous (D/4 bytes apart: the kernel's tile offsets are immediates); (scale, zero) pairs
    are packed per token, and each KV head's pairs start on a 4-byte word (compact pairs: an even capacity), as a
    lane stages them a word at a time; every buffer 16-byte aligned."""
    k, v, kz, vz = history.keys, history.values, history.key_scale_zero, history.value_scale_zero
    return (k.stride(-1) == v.stride(-1) == 1 and k.stride(2) == v.stride(2) == k.shape[-1]
            and kz.stride(-1) == vz.stride(-1) == 1 and kz.stride(2) == vz.stride(2) == 2
            and all(x.stride(d) * x.element_size() % 4 == 0 for x in (kz, vz) for d in (0, 1))
            and all(x.data_ptr() % 16 == 0 for x in (k, v, kz, vz)))


@functools.lru_cache(maxsize=1024)
def plan_history(plan: SplitPlan, history_len: int, kv_rows: int, slots: int,
                 config: CudaHistoryConfig = CudaHistoryConfig()) -> SplitPlan:
    """`plan` with its history cut for this kernel: splits of whole 64-token tiles, as many per KV head row
    (`kv_rows` = batch x KV heads x row blocks) as fill one wave of `slots` resident programs. Every
    layer of a decode step asks the same question, hence the cache."""
    if history_len <= 0:
        return replace(plan, block_n_history=TILE, history_splits=0, history_split_len=TILE)
    wanted = max(1, min(config.max_splits, slots // kv_rows, triton.cdiv(history_len, TILE)))
    length = triton.cdiv(triton.cdiv(history_len, wanted), TILE) * TILE
    return replace(plan, block_n_history=TILE, history_splits=triton.cdiv(history_len, length),
                   history_split_len=length)


def _history_arguments(history) -> dict:
    """A history's tensors as the kernels take them: the codes' and (scale, zero) pairs' addresses, with their batch
    and KV head strides (the pair strides count pairs), by the parameter names of `PARAMETERS` and `HistoryRun`."""
    word = torch.int16 if history.key_scale_zero.dtype == COMPACT else torch.int32  # one token's pair
    keys, values = history.keys, history.values
    kz, vz = history.key_scale_zero.view(word), history.value_scale_zero.view(word)
    return dict(key_codes=keys.data_ptr(), skb=keys.stride(0), skh=keys.stride(1),
                key_sz=kz.data_ptr(), szb=kz.stride(0), szh=kz.stride(1),
                value_codes=values.data_ptr(), svb=values.stride(0), svh=values.stride(1),
                value_sz=vz.data_ptr(), swb=vz.stride(0), swh=vz.stride(1))


def _check_launch(rotated_query: torch.Tensor, dependent: bool, beside: bool) -> None:
    if dependent and beside:
        raise ValueError("a history launch waits for the kernel before it at its start (dependent) or at its end "
                         "(beside), not both")
    if rotated_query.dtype != torch.float32 or rotated_query.stride(-1) != 1:
        raise ValueError("the CUDA history kernel needs the float32 rotated query with a unit stride along head_dim")


def _row_variant(rows: int) -> int:
    """The kernel variant for `rows` query rows per KV head (`ROW_VARIANTS`)."""
    return NARROW_ROWS if rows <= NARROW_ROWS else MAX_ROWS


def history_partials(rotated_query: torch.Tensor, history, plan: SplitPlan, scaling: float, kv_heads: int,
                     partial_out: torch.Tensor, partial_lse: torch.Tensor,
                     config: CudaHistoryConfig = CudaHistoryConfig(), dependent: bool = False,
                     head_offset: int = 0, partial_heads: int | None = None, beside: bool = False,
                     partial_splits: int | None = None) -> None:
    """Write the history splits `[plan.dense_splits, plan.total_splits)` of the partial buffers (the layout of
    `kernels.triton.stage1.attention_partials`). `rotated_query` `[B, Hq, Lq, D]` float32 (`query_rotation.rotate_query`);
    `history` an `kernels.interface.HistoryTensors` that `history_kernel_supports`. `dependent`: launch as a
    programmatic dependent of the kernel queued just before (`rotate_query(launch_dependents=True)`, which wrote
    `rotated_query`): the programs start staging codes at once and wait for it before reading the query.
    `head_offset` / `partial_heads`: the call's query heads are heads `[head_offset, head_offset + Hq)` of partial
    buffers laid out for `partial_heads` (default: Hq, offset 0), as `attention_partials` takes them. `beside`:
    launch as a programmatic dependent of a kernel queued just before that writes none of this call's inputs (the
    history splits of another run of KV heads): the programs run beside it and wait for it only before they
    finish, so that a dependent queued after this call sees both kernels' partials. `partial_splits`: the partial
    buffers hold that many splits per row (default: `plan.total_splits`), more than this call's plan cuts when
    another run of the layer takes more; the launch covers all of them, the ones past the plan's history empty."""
    batch, q_heads, q_len, dim = rotated_query.shape
    _check_launch(rotated_query, dependent, beside)
    if plan.block_n_history % TILE or plan.history_split_len % TILE:
        raise ValueError(f"history splits must be multiples of {TILE} tokens, got {plan.history_split_len}")
    if partial_splits is None:
        partial_splits = plan.total_splits
    elif partial_splits < plan.total_splits:
        raise ValueError(f"partial_splits={partial_splits} is fewer than the plan's {plan.total_splits} splits")
    if plan.history_splits == 0 and partial_splits == plan.total_splits:
        return
    n_from_ptr = history.length_ptr is not None
    length_ptr = history.length_ptr if n_from_ptr else partial_lse
    groups = q_heads // kv_heads
    kernel = load_kernel(device_index(rotated_query.device), dim, config, _row_variant(groups * q_len),
                         history.key_scale_zero.dtype, history.bits)
    query_strides = rotated_query.stride()
    args = kernel_arguments(
        rotated_query=rotated_query.data_ptr(), sqb=query_strides[0], sqh=query_strides[1], sql=query_strides[2],
        **_history_arguments(history), out=partial_out.data_ptr(), lse=partial_lse.data_ptr(), length_ptr=length_ptr.data_ptr(),
        length=history.length, groups=groups, kv_heads=kv_heads, q_len=q_len, dense_splits=plan.dense_splits,
        split_len=plan.history_split_len, history_splits=max(plan.history_splits, 1), total_splits=partial_splits,
        length_from_ptr=int(n_from_ptr), split_multiple=plan.block_n_history, q_scale=scaling * _LOG2E,
        head0=head_offset, partial_heads=q_heads if partial_heads is None else partial_heads,
        wait_at_end=int(beside))
    if compiling_only():  # a compile-only pass (`kernels.triton.precompile`): the module is loaded, nothing runs
        return
    with launch_device(rotated_query):
        kernel((partial_splits - plan.dense_splits, batch * kv_heads), args, dependent or beside)


def history_runs_partials(rotated_query: torch.Tensor, runs, plans, scaling: float, kv_heads: int,
                          partial_out: torch.Tensor, partial_lse: torch.Tensor, partial_splits: int,
                          config: CudaHistoryConfig = CudaHistoryConfig(), dependent: bool = False,
                          beside: bool = False) -> None:
    """`history_partials` for a layer whose history is kept as runs of KV heads (`kernels.interface.HeadRun`s,
    each one's history `history_kernel_supports`, at most `MAX_RUNS`), in one launch: run i's splits are cut by
    `plans[i]`, and the partial buffers hold `partial_splits` splits per row (the dense splits plus the most history
    splits any run takes). `rotated_query` holds every query head of the layer's `kv_heads`, as the partial buffers
    do; `dependent` / `beside` as for `history_partials`."""
    batch, q_heads, q_len, dim = rotated_query.shape
    _check_launch(rotated_query, dependent, beside)
    if not 0 < len(runs) <= MAX_RUNS or len(plans) != len(runs):
        raise ValueError(f"one launch reads 1 to {MAX_RUNS} runs with a plan each, got {len(runs)} runs and "
                         f"{len(plans)} plans")
    if any(p.block_n_history != plans[0].block_n_history or p.dense_splits != plans[0].dense_splits for p in plans):
        raise ValueError("the runs' plans must share their dense splits and tile")
    if any(p.history_split_len % TILE for p in plans) or plans[0].block_n_history % TILE:
        raise ValueError(f"history splits must be multiples of {TILE} tokens")
    if partial_splits < max(p.total_splits for p in plans):
        raise ValueError(f"partial_splits={partial_splits} is fewer than a run's plan cuts")
    if partial_splits == plans[0].dense_splits:  # no history splits to write
        return
    table = HistoryRuns(count=len(runs))
    for i, (run, plan) in enumerate(zip(runs, plans)):
        table.run[i] = HistoryRun(**_history_arguments(run.history), head_start=run.start, bits=run.history.bits,
                                  compact=int(run.history.key_scale_zero.dtype == COMPACT),
                                  split_len=plan.history_split_len, history_splits=max(plan.history_splits, 1))
    first = runs[0].history
    n_from_ptr = first.length_ptr is not None
    kernel = load_kernel(device_index(rotated_query.device), dim, config, _row_variant(q_heads // kv_heads * q_len),
                         RUNS_PAIRS, RUNS)
    query_strides = rotated_query.stride()
    args = kernel_arguments(
        RUNS_PARAMETERS, rotated_query=rotated_query.data_ptr(), sqb=query_strides[0], sqh=query_strides[1],
        sql=query_strides[2], runs=table, out=partial_out.data_ptr(), lse=partial_lse.data_ptr(),
        length_ptr=(first.length_ptr if n_from_ptr else partial_lse).data_ptr(), length=first.length,
        groups=q_heads // kv_heads, kv_heads=kv_heads, q_len=q_len, dense_splits=plans[0].dense_splits,
        total_splits=partial_splits, length_from_ptr=int(n_from_ptr), split_multiple=plans[0].block_n_history,
        q_scale=scaling * _LOG2E, partial_heads=q_heads, wait_at_end=int(beside))
    if compiling_only():  # a compile-only pass (`kernels.triton.precompile`): the module is loaded, nothing runs
        return
    with launch_device(rotated_query):
        kernel((partial_splits - plans[0].dense_splits, batch * kv_heads), args, dependent or beside)
