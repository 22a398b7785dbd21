"""The KV caches compared side by side: OSCAR presets and peer caches, each built fresh for a model.

Peers need optional packages, imported only when their cache is built:
- `kivi2`, `quanto2`, `quanto4`: `optimum-quanto` (HF `QuantizedCache(backend="quanto")`);
- `hqq2`, `hqq4`: `hqq` (HF `QuantizedCache(backend="hqq")`);
- `turboquant2`: `turboquant-impl` (its top-level package is `turboquant`; install it in its own `--target`
  folder, several TurboQuant packages share that name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from oscar_hf.cache import OscarCache
from oscar_hf.layer import OscarLayer


@dataclass(frozen=True)
class Method:
    """A named way to build a fresh KV cache for `model`; `oscar` is True for OscarCache-based methods."""

    name: str
    label: str
    build: Callable[[object], object]
    oscar: bool = False
    note: str = ""

    def oscar_template(self, model) -> OscarCache | None:
        """An unused OscarCache with this method's settings (for the decode-equivalent simulation), or None."""
        return self.build(model.config) if self.oscar else None


def _require(module: str, package: str) -> None:
    try:
        __import__(module)
    except ImportError as e:
        raise ImportError(f"this baseline needs `{package}` (pip install {package}); it is imported lazily") from e


def _quantized(backend: str, **options) -> Callable:
    def build(model):
        _require("optimum.quanto" if backend == "quanto" else "hqq", "optimum-quanto" if backend == "quanto" else "hqq")
        from transformers import QuantizedCache

        return QuantizedCache(backend=backend, config=getattr(model, "config", model), **options)

    return build


def _turboquant(nbits: int) -> Callable:
    def build(model):
        _require("turboquant.cache", "turboquant-impl==0.1.0")
        from turboquant.cache import TurboQuantCache

        config = getattr(model, "config", model)
        device = next(model.parameters()).device if hasattr(model, "parameters") else "cpu"
        return TurboQuantCache(config, nbits=nbits, residual_length=128, device=str(device))

    return build


def _oscar(method: str, rotations=None, **options) -> Callable:
    def build(model):
        return OscarCache(model, rotations=rotations, method=method, **options)

    return build


def builtin_methods(rotations: str | None = None, **oscar_options) -> dict[str, Method]:
    """Every method of the side-by-side table, keyed by name.

    `rotations`: calibrated rotations (folder, file or Hub id) for the `oscar`, `oscar-hifi`, `oscar-next` and
    `oscar4` rows;
    without them the `oscar` and `oscar4` rows use the data-free Hadamard rotation (the `hadamard` preset), and
    `oscar-hifi`, which needs the retrieval ranking a rotations file records, cannot be built. `oscar_options` (e.g.
    `recent_tokens=128`) apply to every OSCAR-layout row.
    """
    calibrated = rotations is not None
    oscar_method = "oscar" if calibrated else "hadamard"
    oscar_label = "OSCAR (calibrated)" if calibrated else "OSCAR (Hadamard)"
    kivi = dict(nbits=2, axis_key=-1, axis_value=0, q_group_size=32, residual_length=128)
    methods = [
        Method("bf16", "BF16 (DynamicCache)", lambda m: DynamicCache(config=getattr(m, "config", m))),
        Method("none", "OSCAR layout, unquantized (tiers and merge only)", _oscar("none", **oscar_options), oscar=True),
        Method("identity", "naive INT2 (OSCAR layout, no rotation, no clip)", _oscar("identity", **oscar_options),
               oscar=True),
        Method("quarot", "Hadamard only (QuaRot-style)", _oscar("quarot", **oscar_options), oscar=True),
        Method("clip", "clip only", _oscar("clip", **oscar_options), oscar=True),
        Method("oscar", oscar_label, _oscar(oscar_method, rotations, **oscar_options), oscar=True),
        Method("oscar-hifi", oscar_label.replace("OSCAR", "OSCAR-hifi (2-bit, the top fifth of the layers by retrieval "
                                                 "ranking at 4 bits)", 1),
               _oscar("oscar-hifi", rotations, **oscar_options), oscar=True,
               note="needs rotations that record a retrieval ranking (oscar-calibrate --rank-retrieval-layers)"),
        Method("oscar-next", oscar_label.replace("OSCAR", "OSCAR-next (2-bit sigma rows, one-byte scale and zero, "
                                                 "the top tenth of the layers by retrieval ranking at 4 bits)", 1),
               _oscar("oscar-next", rotations, **oscar_options), oscar=True,
               note="needs rotations that record a retrieval ranking; the PyTorch reference reads its history"),
        Method("oscar4", oscar_label.replace("OSCAR", "OSCAR 4-bit", 1),
               _oscar(oscar_method, rotations, **{**oscar_options, "bits": 4}), oscar=True),
        Method("kivi2", "KIVI-style 2-bit (quanto, per-channel K / per-token V, g32, R128)", _quantized("quanto", **kivi),
               note="prefix lengths must be multiples of 32 tokens"),
        Method("quanto2", "HF QuantizedCache quanto 2-bit (default axes, g64, R128)",
               _quantized("quanto", nbits=2, q_group_size=64, residual_length=128)),
        Method("quanto4", "HF QuantizedCache quanto 4-bit (default axes, g64, R128)",
               _quantized("quanto", nbits=4, q_group_size=64, residual_length=128)),
        Method("hqq2", "HF QuantizedCache HQQ 2-bit (axis 1, g64, R128)",
               _quantized("hqq", nbits=2, axis_key=1, axis_value=1, q_group_size=64, residual_length=128)),
        Method("hqq4", "HF QuantizedCache HQQ 4-bit (axis 1, g64, R128)",
               _quantized("hqq", nbits=4, axis_key=1, axis_value=1, q_group_size=64, residual_length=128)),
        Method("turboquant2", "TurboQuant-MSE 2-bit (turboquant-impl, R128, layer 0 kept full precision)",
               _turboquant(2)),
    ]
    return {m.name: m for m in methods}


DEFAULT_METHODS = ("bf16", "identity", "quarot", "clip", "oscar", "oscar4", "kivi2", "quanto2", "quanto4", "hqq2",
                   "hqq4", "turboquant2")


# ------------------------------------------------------------------------------------------------ storage
def _tensor_bytes(obj, bf16_model: bool, seen: set) -> int:
    """Bytes of the tensors reachable from `obj` (tensors, tensor subclasses, tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), bf16_model, seen) for n in names)
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape))
        if key in seen or obj.numel() == 0:
            return 0
        seen.add(key)
        size = obj.element_size()
        if bf16_model and obj.dtype == torch.float32:
            size = 2
        return obj.numel() * size
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o, bf16_model, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o, bf16_model, seen) for o in obj.values())
    return 0


CACHE_TENSORS = ("keys", "values", "_quantized_keys", "_quantized_values")


def layer_stored_bytes(layer, bf16_model: bool = False) -> int:
    """Bytes one cache layer stores for its tokens (quantized codes, scales/zeros/norms, full-precision tiers).

    `bf16_model=True` counts float32 tensors at 2 bytes: what the same cache stores when the model runs in BF16
    (its full-precision tiers and float scales follow the model dtype). Spare buffer capacity is not counted.
    """
    if isinstance(layer, OscarLayer):
        as_bf16 = bf16_model and layer.is_initialized and layer.dtype == torch.float32
        return layer.nbytes(torch.bfloat16 if as_bf16 else None)
    seen: set = set()
    return sum(_tensor_bytes(getattr(layer, name, None), bf16_model, seen) for name in CACHE_TENSORS)


def bits_per_element(cache, tokens: int, batch: int, num_kv_heads: int, head_dim: int,
                     bf16_model: bool = False) -> float:
    """Stored bits per cached K/V element over all layers, for `tokens` cached tokens."""
    elements = tokens * batch * num_kv_heads * 2 * head_dim * len(cache.layers)
    return 8.0 * sum(layer_stored_bytes(layer, bf16_model) for layer in cache.layers) / elements
