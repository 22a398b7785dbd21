"""The hand-written history tier of stage 1 (`int2_history.cu`): compiled at run time by NVRTC, launched through
the CUDA driver; no build step, nothing beyond the libnvrtc that PyTorch's CUDA wheels ship.

Contract: `attention.attention_partials`' for the history splits only (same partial layout, rounding points and
log-sum-exp), restricted to the decode hot path: 2-bit codes, float16 (scale, zero), head_dim 64 or 128, at most
8 query rows per KV head (a GQA group x query positions), no mask, no softcap, a float16/bfloat16 model.
`history_kernel_supports` says whether a call qualifies; the Triton kernel covers everything else and is the
path tested against the reference on CPU (this kernel is checked against both on the GPU).

Why not Triton: the value codes must reach the tensor cores as pairs of tokens, the query and p as fragments of
their own; Triton re-lays the query out every tile and pairs value codes through byte-wise shared-memory loads
(1,257 instructions per 64-token warp-tile at d=128). The CUDA kernel builds them in registers and, with at most 4
query rows per KV head, scores two token groups per MMA (686 instructions; the whole call at 100k/bs8 in 159
instead of 254 µs, `bench/RESULTS.md`, runs 38-50).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import warnings
from dataclasses import dataclass, replace

import torch
import triton

from .common import launch_device, multiprocessors
from .launch_plan import SplitPlan

_SOURCE = os.path.join(os.path.dirname(__file__), "int2_history.cu")
_DIMS = (64, 128)
_LOG2E = 1.4426950408889634
MAX_ROWS = 8  # the MMA's N: query rows per KV head
NARROW_ROWS = 4  # at most this many rows: the kernel that puts two token groups into each MMA (`narrow_rows`)
TILE = 64  # history tokens per tile; split lengths are multiples of it


@dataclass(frozen=True)
class CudaHistoryConfig:
    """Compile-time shape of the kernel and how splits are cut for it.

    stages: 64-token tiles per warp in shared memory (stages - 1 in flight).
    min_warps_per_sm: programs per multiprocessor the register allocation must allow.
    magic_planes: bit c set = value plane c keeps its magic number instead of a subtraction. Planes 0, 2, 3 (plane
        0 as 1 + code/4 from the byte's high copy): merged error vs the Triton kernel 1.2-1.5e-4, as with none, and
        0.3-1.3% faster whole calls than planes 2, 3 (run 47); all four: up to 9e-4 (run 47), 1.8e-3 (run 41).
    waves: history splits fill this many waves of resident programs (run 41: one wave, 170.6 us at 100k/bs8,
        against 202 with the Triton plan's 20 programs per SM).
    max_splits: cap on history splits per KV head row.
    narrow_rows: calls with at most 4 query rows per KV head (one query position of a GQA-4 model) use the kernel
        whose score MMAs carry two 16-token groups (block-diagonal query, columns 0-3 and 4-7): half the softmax
        and bookkeeping per lane (686 instead of 813 instructions per tile at d=128; 100k/bs8 whole calls 162.6
        instead of 170.2 us, run 47).
    key_chains: independent score accumulators per tile, over its 2 or 4 m-tiles (run 49, 100k/bs8 whole calls:
        158.7 us with 4, 162.4 with 2 = one chain per m-tile of the narrow kernel, 159.1 with 8, 161.7 with 16).
    diagnostic: measurements only, the partials are garbage: 1 = stage the tiles and attend to none (the
        bandwidth of the copies alone), 2 = also read every lane's words from shared memory, 3 = attend to
        every tile from the first staged buffer with no copies after the prologue (the arithmetic alone).
    min_history_bytes: calls with a smaller history (codes + scale/zero of every row) run on the Triton kernel,
        whose call launches one kernel fewer. Run 65 (whole calls, this kernel): the CUDA path lost below ~4 MB
        (4k/bs1: 18.5 vs 17.0-17.1 us at d=128, 2.2 MB; 15.3 vs 14.8-15.2 at d=64, 1.2 MB), tied at 4.3 MB
        (4k/bs2, 20.8 vs 20.7-21.0) and won above (16k/bs1, 9.3 MB: 23.2 vs 24.7-24.8; d=64 32k/bs1, 10.4 MB:
        22.0 vs 24.9-25.2; d=64 4k/bs8, 9.7 MB: 21.4 vs 23.0-23.2). (Run 44, with the first CUDA kernel, had put
        it at 31-37 MB.)
    """

    stages: int = 4
    min_warps_per_sm: int = 8
    magic_planes: int = 0b1101
    waves: int = 1
    max_splits: int = 128
    min_history_bytes: int = 4 << 20
    narrow_rows: bool = True
    key_chains: int = 4
    diagnostic: int = 0


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc: the one PyTorch loaded, else one from an `nvidia-cuda-nvrtc` wheel on `sys.path`."""
    names = []
    if torch.version.cuda:
        names.append(f"libnvrtc.so.{torch.version.cuda.split('.')[0]}")
    names.append("libnvrtc.so")
    for path in sys.path:
        names += sorted(glob.glob(os.path.join(path, "nvidia", "*", "lib", "libnvrtc.so*")))
    for name in names:
        if "builtins" in name or ".alt." in name:
            continue
        try:
            for builtins in sorted(glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so*"))):
                if ".alt." not in builtins:  # a wheel's library is not on the loader's path: preload its builtins
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("the CUDA history kernel needs libnvrtc (shipped with PyTorch's CUDA wheels; or pip install "
                  "nvidia-cuda-nvrtc)")


def compile_cubin(arch: int, config: CudaHistoryConfig = CudaHistoryConfig()) -> bytes:
    """NVRTC-compile `int2_history.cu` for `sm_{arch}` (e.g. 90) into a CUBIN; needs no GPU."""
    lib = _nvrtc()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    with open(_SOURCE, "rb") as f:
        source = f.read()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"int2_history.cu", 0, None, None))
    options = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "-default-device", f"-DSTAGES={config.stages}",
               f"-DMIN_WARPS_PER_SM={config.min_warps_per_sm}", f"-DMAGIC_PLANES={config.magic_planes}",
               f"-DKEY_CHAINS={config.key_chains}", f"-DDIAGNOSTIC={config.diagnostic}"]
    array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    try:
        if lib.nvrtcCompileProgram(prog, len(options), array) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed on int2_history.cu:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def _check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        raise RuntimeError(f"NVRTC error {status}: {lib.nvrtcGetErrorString(status)}")


_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# rotated query + 3 strides, key codes + 2, key (scale, zero) + 2, value codes + 2, value (scale, zero) + 2,
# out, lse, length pointer, 9 ints (length ... split multiple), the query scale
_ARG_TYPES = [_P, _I, _I, _I] + [_P, _I, _I] * 4 + [_P, _P, _P] + [_I] * 9 + [_F]


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Kernel:
    """A loaded CUDA function with reusable ctypes argument slots, launched (32 threads per program) on the
    current stream, optionally as a programmatic dependent of the kernel queued before it (cuLaunchKernelEx):
    capturable into CUDA graphs."""

    def __init__(self, function: ctypes.c_void_p, shared_bytes: int):
        self.function = function
        self.shared_bytes = shared_bytes
        self.libcuda = torch.cuda._utils._get_gpu_runtime_library()
        self._slots = [t() for t in _ARG_TYPES]
        self._pointers = (ctypes.c_void_p * len(self._slots))(
            *[ctypes.cast(ctypes.byref(slot), ctypes.c_void_p) for slot in self._slots])
        self._attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attribute.value.programmatic_stream_serialization = 1
        self._config = _LaunchConfig(block_x=32, block_y=1, block_z=1, grid_z=1, shared_bytes=shared_bytes,
                                     attrs=ctypes.pointer(self._attribute))

    def __call__(self, grid: tuple[int, int], args: list, dependent: bool = False) -> None:
        for slot, value in zip(self._slots, args):
            slot.value = value
        config = self._config
        config.grid_x, config.grid_y = grid
        config.stream = torch.cuda.current_stream().cuda_stream
        config.num_attrs = 1 if dependent else 0
        status = self.libcuda.cuLaunchKernelEx(ctypes.byref(config), self.function, self._pointers, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {status}")

    def resident_programs(self) -> int:
        """Programs of this kernel that fit on one multiprocessor (registers, shared memory)."""
        count = ctypes.c_int()
        status = self.libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(count), self.function, 32, ctypes.c_size_t(self.shared_bytes))
        if status != 0:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {status}")
        return count.value


def stage_bytes(dim: int) -> int:
    """Shared memory of one staged tile: codes of 64 keys and 64 values, and their (scale, zero) words."""
    return 2 * TILE * dim // 4 + 2 * TILE * 4


def history_bytes(batch: int, kv_heads: int, length: int, dim: int) -> int:
    """Bytes of a 2-bit history a call reads: the codes and float16 (scale, zero) of K and V for every row."""
    return batch * kv_heads * length * 2 * (dim // 4 + 4)


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel_name(dim: int, rows: int) -> str:
    """The kernel for head_dim `dim` whose MMA columns hold `rows` query rows (4: two token groups per MMA)."""
    return f"int2_history_partials_d{dim}_r{rows}"


@functools.lru_cache(maxsize=None)
def load_kernel(device_index: int, dim: int, config: CudaHistoryConfig = CudaHistoryConfig(),
                rows: int = MAX_ROWS) -> _Kernel:
    """Compile (once per device and config) and load the kernel for `dim` and `rows` on CUDA device
    `device_index`."""
    cubin = _device_cubin(device_index, config)
    with torch.cuda.device(device_index):
        module = torch.cuda._utils._cuda_load_module(cubin, [kernel_name(dim, rows)])
    # one buffer beyond the pipeline's stages holds a split's partial last tile
    return _Kernel(module[kernel_name(dim, rows)].func, (config.stages + 1) * stage_bytes(dim))


@functools.lru_cache(maxsize=None)
def _device_cubin(device_index: int, config: CudaHistoryConfig) -> bytes:
    major, minor = torch.cuda.get_device_capability(device_index)
    return compile_cubin(10 * major + minor, config)


def _row_variants(config: CudaHistoryConfig) -> tuple[int, ...]:
    return (NARROW_ROWS, MAX_ROWS) if config.narrow_rows else (MAX_ROWS,)


@functools.lru_cache(maxsize=None)
def resident_slots(device_index: int, dim: int, config: CudaHistoryConfig = CudaHistoryConfig()) -> int:
    """Programs of the kernel resident on the whole device at once (one wave; the fewer of its row variants)."""
    per_sm = min(load_kernel(device_index, dim, config, rows).resident_programs() for rows in _row_variants(config))
    return per_sm * multiprocessors(torch.device("cuda", device_index))


@functools.lru_cache(maxsize=None)
def available(device_index: int, config: CudaHistoryConfig = CudaHistoryConfig()) -> bool:
    """Whether the kernel compiles and loads on this device (sm_80+ and libnvrtc); warns once if it does not."""
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return False
    try:
        for dim in _DIMS:
            for rows in _row_variants(config):
                load_kernel(device_index, dim, config, rows)
    except (OSError, RuntimeError) as error:
        warnings.warn(f"OSCAR's CUDA history kernel is unavailable ({error}); the Triton kernel is used instead",
                      stacklevel=2)
        return False
    return True


def history_kernel_supports(query: torch.Tensor, history, mask, softcap, kv_heads: int) -> bool:
    """Whether this kernel covers a call's history tier (see the module docstring); `history` a
    `attention.HistoryTensors`."""
    if not query.is_cuda or history is None or not history.quantized:
        return False
    batch, q_heads, q_len, dim = query.shape
    return (dim in _DIMS and history.bits == 2 and history.key_scale_zero.dtype == torch.float16
            and history.value_scale_zero.dtype == torch.float16 and query.dtype in (torch.float16, torch.bfloat16)
            and mask is None and softcap is None and (q_heads // kv_heads) * q_len <= MAX_ROWS
            and _code_layout_ok(history))


def _code_layout_ok(history) -> bool:
    """Code rows are contiguous (D/4 bytes apart: the kernel's tile offsets are immediates); (scale, zero) pairs
    are packed per token; every buffer 16-byte aligned."""
    k, v, kz, vz = history.keys, history.values, history.key_scale_zero, history.value_scale_zero
    return (k.stride(-1) == v.stride(-1) == 1 and k.stride(2) == v.stride(2) == k.shape[-1]
            and kz.stride(-1) == vz.stride(-1) == 1 and kz.stride(2) == vz.stride(2) == 2
            and all(x.data_ptr() % 16 == 0 for x in (k, v, kz, vz)))


@functools.lru_cache(maxsize=1024)
def plan_history(plan: SplitPlan, history_len: int, kv_rows: int, slots: int,
                 config: CudaHistoryConfig = CudaHistoryConfig()) -> SplitPlan:
    """`plan` with its history cut for this kernel: splits of whole 64-token tiles, as many per KV head row
    (`kv_rows` = batch x KV heads x row blocks) as fill `config.waves` waves of `slots` resident programs. Every
    layer of a decode step asks the same question, hence the cache."""
    if history_len <= 0:
        return replace(plan, block_n_history=TILE, history_splits=0, history_split_len=TILE)
    wanted = max(1, min(config.max_splits, config.waves * slots // kv_rows, triton.cdiv(history_len, TILE)))
    length = triton.cdiv(triton.cdiv(history_len, wanted), TILE) * TILE
    return replace(plan, block_n_history=TILE, history_splits=triton.cdiv(history_len, length),
                   history_split_len=length)


def history_partials(rotated_query: torch.Tensor, history, plan: SplitPlan, scaling: float, kv_heads: int,
                     partial_out: torch.Tensor, partial_lse: torch.Tensor,
                     config: CudaHistoryConfig = CudaHistoryConfig(), dependent: bool = False) -> None:
    """Write the history splits `[plan.dense_splits, plan.total_splits)` of the partial buffers (the layout of
    `attention.attention_partials`). `rotated_query` `[B, Hq, Lq, D]` float32 (`query_rotation.rotate_query`);
    `history` an `attention.HistoryTensors` that `history_kernel_supports`. `dependent`: launch as a
    programmatic dependent of the kernel queued just before (`rotate_query(launch_dependents=True)`, which wrote
    `rotated_query`): the programs start staging codes at once and wait for it before reading the query."""
    batch, q_heads, q_len, dim = rotated_query.shape
    if rotated_query.dtype != torch.float32 or rotated_query.stride(-1) != 1:
        raise ValueError("history_partials needs the float32 rotated query with a unit stride along head_dim")
    if plan.block_n_history % TILE or plan.history_split_len % TILE:
        raise ValueError(f"history splits must be multiples of {TILE} tokens, got {plan.history_split_len}")
    if plan.history_splits == 0:
        return
    keys, values = history.keys, history.values
    kz = history.key_scale_zero.view(torch.int32)
    vz = history.value_scale_zero.view(torch.int32)
    n_from_ptr = history.length_ptr is not None
    length_ptr = history.length_ptr if n_from_ptr else partial_lse
    groups = q_heads // kv_heads
    rows = NARROW_ROWS if config.narrow_rows and groups * q_len <= NARROW_ROWS else MAX_ROWS
    kernel = load_kernel(device_index(rotated_query.device), dim, config, rows)
    args = [rotated_query.data_ptr(), *rotated_query.stride()[:3],
            keys.data_ptr(), keys.stride(0), keys.stride(1), kz.data_ptr(), kz.stride(0), kz.stride(1),
            values.data_ptr(), values.stride(0), values.stride(1), vz.data_ptr(), vz.stride(0), vz.stride(1),
            partial_out.data_ptr(), partial_lse.data_ptr(), length_ptr.data_ptr(),
            history.length, groups, kv_heads, q_len, plan.dense_splits,
            plan.history_split_len, plan.total_splits, int(n_from_ptr), plan.block_n_history, scaling * _LOG2E]
    with launch_device(rotated_query):
        kernel((plan.history_splits, batch * kv_heads), args, dependent)
