"""`backend_for(device)`: the one place that picks a kernel backend, and the only reader of the environment.

- CUDA devices get the Triton kernels (`kernels.triton.TritonBackend`), with the CUDA history kernel where a call
  qualifies; anything else, or a machine without Triton, gets the PyTorch reference.
- `OSCAR_HF_BACKEND=reference` forces the reference everywhere; `OSCAR_CUDA_HISTORY=0` keeps the Triton backend
  off the CUDA history kernel.

A backend is also data: `backend_spec` writes its kind and constructor settings as a string, and
`backend_from_spec` gives the backend that string describes, one shared instance per string. The custom ops
(`kernels.ops`) name a backend that way, so that a compiled graph holds a description, not an object, and serves
every cache whose backend has the same settings.
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch

from oscar_hf.kernels.interface import Backend
from oscar_hf.kernels.reference.backend import ReferenceBackend

_BACKENDS: dict[str, Backend] = {}  # by spec (`backend_from_spec`)
_CHOSEN: dict[tuple, Backend] = {}  # by choice (`backend_for`), a dict lookup dynamo traces
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
    if key not in _CHOSEN:
        settings = {"history_chunk": history_chunk} | ({"cuda_history": cuda_history} if use_kernels else {})
        _CHOSEN[key] = backend_from_spec(_spec(key[0], settings))
    return _CHOSEN[key]


def _backend_classes() -> dict[str, type]:
    """The backends a spec may name, by kind (Triton's imported only when present)."""
    classes: dict[str, type] = {"reference": ReferenceBackend}
    if _TRITON_IMPORTABLE:
        from oscar_hf.kernels.triton.backend import TritonBackend

        classes["triton"] = TritonBackend
    return classes


def _spec(kind: str, settings: dict) -> str:
    return json.dumps({"kind": kind, "settings": settings}, sort_keys=True)


def has_spec(backend: Backend) -> bool:
    """Whether `backend` is one of the package's own, which `backend_spec` describes."""
    return _backend_classes().get(backend.name) is type(backend)


def backend_spec(backend: Backend) -> str:
    """`backend` as data: its kind and constructor settings (`backend_from_spec` turns it back). Only the package's
    own backends have one: a compiled graph cannot hold another object."""
    if not has_spec(backend):
        raise TypeError(
            f"torch.compile names a kernel backend by its settings, which only the package's own backends "
            f"({', '.join(sorted(_backend_classes()))}) state; {type(backend).__name__} is not one of them: decode "
            "eagerly with it, or leave OscarCache(backend=...) unset")
    return _spec(backend.name, backend.settings())


def reference_for(spec: str) -> Backend:
    """The reference backend with the history chunk of the backend `spec` describes: what the ops run off CUDA."""
    chunk = json.loads(spec)["settings"].get("history_chunk", 4096)
    return backend_from_spec(_spec("reference", {"history_chunk": chunk}))


def backend_from_spec(spec: str) -> Backend:
    """The backend `spec` (from `backend_spec`, or naming only some settings) describes: one shared instance per
    full description, so that its scratch and compiled kernels serve every cache and step that names it."""
    backend = _BACKENDS.get(spec)
    if backend is None:
        described = json.loads(spec)
        cls = _backend_classes()[described["kind"]]
        settings = described["settings"]
        built = cls.from_settings(settings) if hasattr(cls, "from_settings") else cls(**settings)
        backend = _BACKENDS.setdefault(backend_spec(built), built)
        _BACKENDS[spec] = backend
    return backend


def graph_problem(backend: Backend, config, key_dim: int, value_dim: int) -> str | None:
    """Why a decode step of `backend` cannot be captured in a CUDA graph for a layer with settings `config`
    (`OscarConfig`) and heads of these sizes (it reads counts on the host), or None when it can."""
    settings = [config, config.high_precision()] if config.high_precision_heads else [config]
    for each in settings:
        encoder = each.encoder if config.quantize else "minmax"
        problem = backend.graph_capture_problem(key_dim, value_dim, encoder, each.scale_dtype)
        if problem is not None:
            return problem
    return None


def decode_compiles(backend: Backend | None, config, device: torch.device, key_dim: int, value_dim: int,
                    answers: dict) -> bool:
    """Whether transformers may compile a layer's decode step with `backend` (None: the one `backend_for` picks on
    `device`), settings `config` and heads of these sizes: off CUDA always (the backend's host reads run inside the
    compiled step), on CUDA where the step can be captured in a CUDA graph (`graph_problem`). `answers` keeps them
    per (device, head sizes, backend): `generate` asks every step, for every layer, and working one out again (the
    high-precision config included) cost 250 us a step for 36 layers; traced code reads no host memo."""
    if device.type != "cuda":
        return True
    compiling = torch.compiler.is_compiling()
    key = (device, key_dim, value_dim, id(backend))
    answer = None if compiling else answers.get(key)
    if answer is None:
        chosen = backend if backend is not None else backend_for(device, config.history_chunk)
        answer = graph_problem(chosen, config, key_dim, value_dim) is None
        if not compiling:
            answers[key] = answer
    return answer
