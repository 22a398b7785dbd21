"""The hand-written history tier of stage 1 (`int2_history.cu`): compiled at run time by NVRTC, launched through
the CUDA driver, no build step and no CUDA toolkit beyond what a PyTorch CUDA wheel ships (libnvrtc).

Contract: `attention.attention_partials`' for the history splits only (same partial layout, rounding points and
log-sum-exp), restricted to the decode hot path: 2-bit codes, float16 (scale, zero), head_dim 64 or 128, at most
8 query rows per KV head, no mask, no softcap, a float16/bfloat16 model (float16 history dots). `history_kernel_
supports` says whether a call qualifies; the Triton kernel covers everything else and stays the reference-tested
path on CPU.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import math
import os
import sys

import torch

from .launch_plan import SplitPlan

_SOURCE = os.path.join(os.path.dirname(__file__), "int2_history.cu")
_KERNELS = {64: "int2_history_partials_d64", 128: "int2_history_partials_d128"}
_LOG2E = 1.4426950408889634
MAX_ROWS = 8  # the MMA's N: query rows (GQA group x query positions) per KV head
TILE = 64  # history tokens per tile; split lengths must be multiples of it


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc: the one PyTorch loaded, else one from an `nvidia-cuda-nvrtc` wheel on `sys.path`."""
    names = []
    if torch.version.cuda:
        names.append(f"libnvrtc.so.{torch.version.cuda.split('.')[0]}")
    names.append("libnvrtc.so")
    for path in sys.path:
        names += sorted(glob.glob(os.path.join(path, "nvidia", "*", "lib", "libnvrtc.so*")))
        names += sorted(glob.glob(os.path.join(path, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
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
    raise OSError("the CUDA history kernel needs libnvrtc (shipped with PyTorch's CUDA wheels, or pip install "
                  "nvidia-cuda-nvrtc)")


def compile_cubin(arch: int, stages: int = 4, min_warps_per_sm: int = 1, magic_planes: int = 0) -> bytes:
    """NVRTC-compile `int2_history.cu` for `sm_{arch}` (e.g. 90) into a CUBIN (no GPU needed): `stages` tiles
    of shared memory per warp, registers capped so that `min_warps_per_sm` programs fit on a multiprocessor."""
    lib = _nvrtc()
    with open(_SOURCE, "rb") as f:
        source = f.read()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"int2_history.cu", 0, None, None))
    options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17", b"-default-device"]
    options += [f"-DSTAGES={stages}".encode(), f"-DMIN_WARPS_PER_SM={min_warps_per_sm}".encode(),
                f"-DMAGIC_PLANES={magic_planes}".encode()]
    array = (ctypes.c_char_p * len(options))(*options)
    status = lib.nvrtcCompileProgram(prog, len(options), array)
    if status != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise RuntimeError(f"NVRTC failed on int2_history.cu:\n{log.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
    cubin = ctypes.create_string_buffer(size.value)
    _check(lib, lib.nvrtcGetCUBIN(prog, cubin))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def _check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {status}: {lib.nvrtcGetErrorString(status)}")


class _Kernel:
    """A CUDA function and the ctypes signature of its arguments, launched on the current stream."""

    def __init__(self, function, arg_types, shared_bytes):
        self.function = function
        self.arg_types = arg_types
        self.shared_bytes = shared_bytes
        self.libcuda = torch.cuda._utils._get_gpu_runtime_library()

    def __call__(self, grid, args) -> None:
        values = [t(a) for t, a in zip(self.arg_types, args)]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        stream = torch.cuda.current_stream()
        status = self.libcuda.cuLaunchKernel(self.function, grid[0], grid[1], grid[2], 32, 1, 1, self.shared_bytes,
                                             ctypes.c_void_p(stream.cuda_stream), pointers, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {status}")


_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARG_TYPES = [_P, _I, _I, _I, _P, _I, _I, _P, _I, _I, _P, _I, _I, _P, _I, _I, _P, _P, _P] + [_I] * 10 + [_F]


def stage_bytes(dim: int) -> int:
    """Shared memory of one staged tile: codes of 64 keys and 64 values, and their (scale, zero) words."""
    return 2 * 64 * dim // 4 + 2 * 64 * 4


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, dim: int, stages: int = 4, min_warps_per_sm: int = 1, magic_planes: int = 0) -> _Kernel:
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = compile_cubin(10 * major + minor, stages, min_warps_per_sm, magic_planes)
    with torch.cuda.device(device_index):
        module = torch.cuda._utils._cuda_load_module(cubin, [_KERNELS[dim]])
    return _Kernel(module[_KERNELS[dim]].func, _ARG_TYPES, stages * stage_bytes(dim))


def history_kernel_supports(query: torch.Tensor, history, mask, softcap, kv_heads: int) -> bool:
    """Whether the CUDA kernel covers this call's history tier (see the module docstring)."""
    if not query.is_cuda or torch.cuda.get_device_capability(query.device) < (8, 0):
        return False
    batch, q_heads, q_len, dim = query.shape
    return (dim in _KERNELS and history is not None and history.quantized and history.bits == 2
            and history.key_scale_zero.dtype == torch.float16 and history.value_scale_zero.dtype == torch.float16
            and query.dtype in (torch.float16, torch.bfloat16) and mask is None and softcap is None
            and (q_heads // kv_heads) * q_len <= MAX_ROWS and _code_layout_ok(history))


def _code_layout_ok(history) -> bool:
    """Code rows are contiguous (D/4 bytes apart: the kernel's tile offsets are immediates); (scale, zero) pairs
    are packed per token; every buffer 16-byte aligned."""
    k, v, kz, vz = history.keys, history.values, history.key_scale_zero, history.value_scale_zero
    return (k.stride(-1) == v.stride(-1) == 1 and k.stride(2) == v.stride(2) == k.shape[-1]
            and kz.stride(-1) == vz.stride(-1) == 1 and kz.stride(2) == vz.stride(2) == 2
            and all(x.data_ptr() % 16 == 0 for x in (k, v, kz, vz)))


def history_partials(rotated_query: torch.Tensor, history, plan: SplitPlan, scaling: float, kv_heads: int,
                     partial_out: torch.Tensor, partial_lse: torch.Tensor, stages: int = 4,
                     min_warps_per_sm: int = 1, magic_planes: int = 0) -> None:
    """Write the history splits `[plan.dense_splits, plan.total_splits)` of the partial buffers (layout of
    `attention.attention_partials`); `rotated_query` `[B, Hq, Lq, D]` float32 (`query_rotation.rotate_query`)."""
    batch, q_heads, q_len, dim = rotated_query.shape
    if rotated_query.dtype != torch.float32 or rotated_query.stride(-1) != 1:
        raise ValueError("history_partials needs the float32 rotated query with a unit stride along head_dim")
    if plan.block_n_history % TILE or plan.history_split_len % TILE:
        raise ValueError(f"history splits must be multiples of {TILE} tokens, got {plan.history_split_len}")
    keys, values = history.keys, history.values
    kz = history.key_scale_zero.view(torch.int32)
    vz = history.value_scale_zero.view(torch.int32)
    n_from_ptr = history.length_ptr is not None
    length_ptr = history.length_ptr if n_from_ptr else partial_lse
    kernel = _kernel(rotated_query.device.index if rotated_query.device.index is not None
                     else torch.cuda.current_device(), dim, stages, min_warps_per_sm, magic_planes)
    args = [rotated_query.data_ptr(), *rotated_query.stride()[:3],
            keys.data_ptr(), keys.stride(0), keys.stride(1), kz.data_ptr(), kz.stride(0), kz.stride(1),
            values.data_ptr(), values.stride(0), values.stride(1), vz.data_ptr(), vz.stride(0), vz.stride(1),
            partial_out.data_ptr(), partial_lse.data_ptr(), length_ptr.data_ptr(),
            keys.stride(2), history.length, q_heads // kv_heads, kv_heads, q_len, plan.dense_splits,
            plan.history_split_len, plan.total_splits, int(n_from_ptr), plan.block_n_history, scaling * _LOG2E]
    with torch.cuda.device(rotated_query.device):
        kernel((plan.history_splits, batch * kv_heads, 1), args)


def resident_programs(device_index: int, dim: int, stages: int = 4, min_warps_per_sm: int = 1,
                      magic_planes: int = 0) -> int:
    """Programs (one warp each) of this kernel variant that fit on one multiprocessor (registers, shared memory)."""
    kernel = _kernel(device_index, dim, stages, min_warps_per_sm, magic_planes)
    count = ctypes.c_int()
    status = kernel.libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(count), kernel.function, 32,
                                                                         ctypes.c_size_t(kernel.shared_bytes))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {status}")
    return count.value
