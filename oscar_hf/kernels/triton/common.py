"""Small helpers shared by the kernels (no kernels here): `@triton.jit` functions, the launch-device guard and the
one launch call every kernel goes through (`launch`), which a compile-only pass turns into a compile
(`kernels.triton.precompile`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import triton
import triton.language as tl


def launch_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make `tensor`'s CUDA device the current one around a launch.

    Triton launches on the current device and its stream, not on the device of the tensors it is given, so a layer
    placed on cuda:1 by a `device_map` would otherwise run its kernels from cuda:0. A no-op when the device is
    already current, and off CUDA (the interpreter).
    """
    device = tensor.device
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# set by `kernels.triton.precompile.compile_only`: launches compile their kernel and launch nothing
_COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("oscar_hf_compile_only", default=False)


def compiling_only() -> bool:
    """Whether this code runs in a compile-only pass: its launches must leave the device untouched."""
    return _COMPILE_ONLY.get()


@contextlib.contextmanager
def launches_compile_only():
    """Within the block, `launch` compiles and launches nothing (`kernels.triton.precompile.compile_only`)."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; in a compile-only pass, `kernel.warmup(...)` with the same arguments,
    which compiles (or finds) the variant these arguments select and launches nothing."""
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter), as a stand-in."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` can use programmatic dependent launch (Hopper and newer): a kernel launched so
    starts while the one before it drains, and waits (`griddepcontrol.wait`) only where it reads that one's output."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


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
