"""Run-time compilation and launch of CUDA C++ kernels: source -> CUBIN by NVRTC, CUBIN -> function by the CUDA
driver, launch through `cuLaunchKernelEx`, all through ctypes. Nothing here knows what a kernel computes.

NVRTC is the libnvrtc that PyTorch's CUDA wheels ship (or an `nvidia-cuda-nvrtc` wheel): no build step. Compiling
needs no GPU, so the source can be checked on any machine that has the library.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from collections.abc import Mapping, Sequence

import torch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_DEFAULT_SHARED_LIMIT = 48 << 10  # dynamic shared memory a launch may use without that attribute


def load_nvrtc() -> ctypes.CDLL:
    """libnvrtc: the one PyTorch loaded, else one from an `nvidia-cuda-nvrtc` wheel on `sys.path`; OSError when
    there is none."""
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
    raise OSError("compiling CUDA kernels at run time needs libnvrtc (shipped with PyTorch's CUDA wheels; or pip "
                  "install nvidia-cuda-nvrtc)")


def compile_cubin(source_path: str, arch: int, defines: Mapping[str, int]) -> bytes:
    """NVRTC-compile the CUDA C++ file `source_path` for `sm_{arch}` (e.g. 90) with `-D<name>=<value>` for each
    entry of `defines`; returns the CUBIN. Raises RuntimeError with NVRTC's log when the source does not compile."""
    lib = load_nvrtc()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    with open(source_path, "rb") as f:
        source = f.read()
    prog = ctypes.c_void_p()
    name = os.path.basename(source_path).encode()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, name, 0, None, None))
    options = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "-default-device"]
    options += [f"-D{key}={value}" for key, value in defines.items()]
    array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    try:
        if lib.nvrtcCompileProgram(prog, len(options), array) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed on {source_path}:\n{log.value.decode(errors='replace')}")
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


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class Kernel:
    """A function of a loaded CUBIN, launched with `threads` threads per program on the current stream, optionally
    as a programmatic dependent of the kernel queued before it: capturable into CUDA graphs.

    `arg_types` are the ctypes types of the kernel's parameters, in order (a `ctypes.Structure` for a struct passed
    by value); the argument slots are allocated once and reused by every launch (a decode step launches this once
    per layer)."""

    def __init__(self, cubin: bytes, name: str, device_index: int, arg_types: Sequence[type], shared_bytes: int,
                 threads: int):
        with torch.cuda.device(device_index):
            module = torch.cuda._utils._cuda_load_module(cubin, [name])
        self.function = module[name].func
        self.shared_bytes = shared_bytes
        self.threads = threads
        self.libcuda = torch.cuda._utils._get_gpu_runtime_library()
        if shared_bytes > _DEFAULT_SHARED_LIMIT:  # beyond it, a kernel's dynamic shared memory must be asked for
            status = self.libcuda.cuFuncSetAttribute(self.function,
                                                     _MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared_bytes))
            if status != 0:
                raise RuntimeError(f"{name} cannot have {shared_bytes} bytes of shared memory (CUDA error {status})")
        self._slots = [t() for t in arg_types]
        self._pointers = (ctypes.c_void_p * len(self._slots))(
            *[ctypes.cast(ctypes.byref(slot), ctypes.c_void_p) for slot in self._slots])
        self._attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attribute.value.programmatic_stream_serialization = 1
        self._config = _LaunchConfig(block_x=threads, block_y=1, block_z=1, grid_z=1, shared_bytes=shared_bytes,
                                     attrs=ctypes.pointer(self._attribute))

    def __call__(self, grid: tuple[int, int], args: Sequence, dependent: bool = False) -> None:
        for slot, value in zip(self._slots, args, strict=True):
            if isinstance(slot, ctypes.Structure):  # a struct passed by value: its bytes
                ctypes.memmove(ctypes.addressof(slot), ctypes.addressof(value), ctypes.sizeof(slot))
            else:
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
            ctypes.byref(count), self.function, self.threads, ctypes.c_size_t(self.shared_bytes))
        if status != 0:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {status}")
        return count.value
