"""Small helpers shared by the kernels (no kernels here): `@triton.jit` functions and the launch-device guard."""

from __future__ import annotations

import contextlib
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
