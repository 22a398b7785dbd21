"""Compiling the Triton kernels a call needs on threads, before the call launches them.

A machine's first `generate` call compiles about 20 Triton variants (a kernel specialized for its constexprs and
for properties of its arguments), about 30 s one after another on an H100 (docs/performance.md, "The first call");
Triton keeps them on disk, so this is paid once per machine. Each call compiles its variants one at a time, at its
launches, though `triton.compile` releases the interpreter lock in its passes and runs ptxas as a process of its
own: compiled on threads, the same variants take a third of the time or less.

Which variants a call needs only its own launch code can tell: the constexprs come from its shapes and split plan,
and Triton specializes integer arguments on being 1 or a multiple of 16 and pointers on their alignment. So the
backend runs a call of a kind it has not seen twice (`ParallelCompile.first`): first as a compile-only pass, in
which every launch (`common.launch`) hands its arguments to `kernel.warmup` under Triton's `AsyncCompileMode`, so
that each compile goes to a thread pool and nothing runs on the device; then for real, once every compile has
finished, when each launch finds its kernel in memory.

What makes two calls "of a kind" (`call_shape`) is a guess at what selects variants, and a wrong guess costs time,
never results: a variant the pass did not meet compiles at its launch as before, and a pass over variants already
compiled finds them in memory.

The calls themselves still come one after another (the prefill's demotion and attention, then a decode step's),
so a new machine's first chunked call at 32k/4 went from 36.2 to 28.3 s, not to what compiling all 20 variants at
once would give (H100, 2026-12-06; `experiments.compile.triton_census`). Code that knows calls still to come can
compile them together (`ParallelCompile.rehearse`): a layer handing over to counted decode runs its close and a
demotion block's steps on a copy of itself (`layer._rehearse_hand_over`), so the variants of the close's demotion,
of the decode attention, and of the steps' demotion and window shift compile in one pass instead of three.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from transformers.utils import logging

from oscar_hf.kernels.triton.common import compiling_only, launches_compile_only

logger = logging.get_logger(__name__)

T = TypeVar("T")

# threads of a compile-only pass unless the backend is told otherwise: a first call's 20 variants compiled in 8.7 s
# on 16 threads against 30.1 s on one (H100 host, 2026-12-06)
DEFAULT_COMPILE_THREADS = 16


def default_threads() -> int:
    return min(DEFAULT_COMPILE_THREADS, os.cpu_count() or 1)


def _async_compile_mode():
    """Triton's `AsyncCompileMode` (in a private module of Triton 3.4 and later), or None where it is missing."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


@contextlib.contextmanager
def compile_only(threads: int) -> Iterator[None]:
    """Within the block, kernel launches compile their variant on one of `threads` threads and launch nothing;
    leaving the block waits for every compile and puts each kernel where its launches look it up. Code run in
    the block must not read what its launches would have written."""
    mode = _async_compile_mode()
    with launches_compile_only():
        if mode is None or threads < 2:
            yield  # compiles one at a time, as at a launch, and still launches nothing
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="oscar-compile") as pool, mode(pool):
            yield


def _size_class(n: int) -> int:
    """How Triton tells integers apart when it specializes: 1, a multiple of 16, or anything else."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def call_shape(value) -> object:
    """A hashable summary of a call's arguments: for tensors their dtype, device, and the classes of their sizes,
    strides and alignment; for integers their class; for dataclasses, tuples and lists their parts."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device.type, tuple(_size_class(n) for n in value.shape),
                tuple(_size_class(s) for s in value.stride()), value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return _size_class(value)
    if isinstance(value, float):
        return float
    if isinstance(value, (tuple, list)):
        return tuple(call_shape(v) for v in value)
    if dataclasses.is_dataclass(value):
        return (type(value).__name__,) + tuple(call_shape(getattr(value, f.name)) for f in dataclasses.fields(value))
    return type(value).__name__


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (a pass then would record nothing, and the
    capture has run the call before)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _tracing() -> bool:
    """Whether torch.compile is tracing this code (the backend runs inside opaque ops, but a pass must never be
    traced: it reads data pointers)."""
    return torch.compiler.is_compiling()


class ParallelCompile:
    """Runs each new kind of call (`call_shape`) as a compile-only pass on `threads` threads before running it
    (the module docstring); `threads` below 2 turns it off."""

    def __init__(self, threads: int):
        self.threads = threads
        self._seen: set = set()
        self._warned = False

    def first(self, name: str, args: tuple, device: torch.device, call: Callable[[], T]) -> T:
        """`call()`, after a compile-only pass of it when this is the first call named `name` with arguments of
        this shape on a CUDA device (not inside another pass, nor while a CUDA graph is being captured)."""
        self.rehearse(name, args, device, call)
        return call()

    def rehearse(self, name: str, args: tuple, device: torch.device, calls: Callable[[], object]) -> None:
        """A compile-only pass of `calls()`, code that makes calls yet to come (several, of several kinds), the
        first time `name` comes with arguments of this shape on a CUDA device; it runs nothing for real. Its
        variants then compile at once instead of one call after another."""
        if (self.threads >= 2 and device.type == "cuda" and not compiling_only() and not _capturing()
                and not _tracing()):
            key = (name, call_shape(args))
            if key not in self._seen:
                self._seen.add(key)
                self._compile(name, calls)

    def _compile(self, name: str, call: Callable[[], object]) -> None:
        try:
            with compile_only(self.threads):
                call()
        except Exception as error:  # the call itself then compiles at its launches, and raises what is wrong
            if not self._warned:
                self._warned = True
                logger.warning(f"compiling the kernels of {name} on threads failed ({error!r}); they compile at "
                               "their launches instead")
