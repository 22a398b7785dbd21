"""Running the kernels on CPU through Triton's interpreter (`TRITON_INTERPRET=1`), for tests.

The variable must be set before triton is first imported (and transformers imports it): `@triton.jit` reads it when
it decorates a function, triton's own `tl.zeros`/`tl.sum`/... included. `tests/conftest.py` sets it on machines
without CUDA; `kernel_device()` then checks the mode and returns the device to test on.

`kernel_device()` also works around an interpreter bug under numpy >= 2.3: a loop bound computed from
`tl.program_id` is a 1-element array there, and `range()` over it fails ("only 0-dimensional arrays can be
converted to Python scalars").
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_device() -> torch.device:
    """`cpu` under the interpreter, else `cuda`; raises RuntimeError when neither can run the kernels."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if interpreting():
        if not isinstance(tl.zeros, InterpretedFunction):
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; set it first "
                               "(tests/conftest.py does) or run on a CUDA machine")
        _patch_index()
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("the kernels need CUDA, or TRITON_INTERPRET=1 (set before triton is imported)")
    return torch.device("cuda")


def _patch_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_oscar_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._oscar_index_fix = True
    interpreter._patch_lang_tensor = patched
