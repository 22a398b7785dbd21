"""`backend_for(device)`: the one place that picks a kernel backend, and the only reader of the environment.

- CUDA devices get the Triton kernels (`kernels.triton.TritonBackend`), with the CUDA history kernel where a call
  qualifies; anything else, or a machine without Triton, gets the PyTorch reference.
- `OSCAR_HF_BACKEND=reference` forces the reference everywhere; `OSCAR_CUDA_HISTORY=0` keeps the Triton backend
  off the CUDA history kernel.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from oscar_hf.kernels.interface import Backend
from oscar_hf.kernels.reference.backend import ReferenceBackend

_BACKENDS: dict[tuple, Backend] = {}
# looked up once: `backend_for` also runs inside traced code (transformers 5.17 reads `Cache.is_compileable` while
# building a compiled forward's mask), where dynamo cannot trace importlib's lookup
_TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def backend_for(device: torch.device, history_chunk: int = 4096) -> Backend:
    """The backend for tensors on `device` (one shared instance per choice; see the module docstring).

    `history_chunk`: history tokens the reference dequantizes at a time (`OscarConfig.history_chunk`).
    """
    forced = os.environ.get("OSCAR_HF_BACKEND", "").lower()
    if forced not in ("", "reference", "triton"):
        raise ValueError(f"OSCAR_HF_BACKEND={forced!r}: expected 'reference' or 'triton' (or unset)")
    use_kernels = device.type == "cuda" and forced != "reference" and _TRITON_IMPORTABLE
    cuda_history = os.environ.get("OSCAR_CUDA_HISTORY", "1") != "0"
    key = ("triton", history_chunk, cuda_history) if use_kernels else ("reference", history_chunk)
    if key not in _BACKENDS:
        if use_kernels:
            from oscar_hf.kernels.triton.backend import TritonBackend

            _BACKENDS[key] = TritonBackend(history_chunk=history_chunk, cuda_history=cuda_history)
        else:
            _BACKENDS[key] = ReferenceBackend(history_chunk=history_chunk)
    return _BACKENDS[key]

