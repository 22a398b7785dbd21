"""The KV caches compared side by side, by the names every evaluation command line takes: the `OscarConfig` presets
(`oscar_hf.config.PRESETS`), the 4-bit rows `hadamard4` and `oscar4`, the BF16 reference `bf16`, and peer caches;
each built fresh for a model.

The peer `turboquant3` (TurboQuant-MSE at 3 bits for every layer, the OSCAR paper's headline baseline) is our own
simulation, `eval.diagnostics.turboquant`; the other peers need optional packages, imported only when their cache
is built:
- `kivi2`, `quanto2`, `quanto4`: `optimum-quanto` (HF `QuantizedCache(backend="quanto")`);
- `hqq2`, `hqq4`: `hqq` (HF `QuantizedCache(backend="hqq")`);
- `turboquant2`: `turboquant-impl` (its top-level package is `turboquant`; install it in its own `--target`
  folder, several TurboQuant packages share that name).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache
from transformers.utils import logging

from oscar_hf.cache import OscarCache
from oscar_hf.config import PRESETS, OscarConfig
from oscar_hf.eval.diagnostics.turboquant import TurboQuantMSECache, TurboQuantMSELayer
from oscar_hf.eval.diagnostics.turboquant import bits_per_element as turboquant_bits_per_element
from oscar_hf.layer import OscarLayer
from oscar_hf.plan import NAMED_ROTATIONS
from oscar_hf.rotations.io import rotation_metadata
from oscar_hf.rotations.rotations import KEY_SMOOTHING_KEY

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class Method:
    """A named way to build a fresh KV cache for `model`; `oscar` is True for OscarCache-based methods."""

    name: str
    label: str
    build: Callable[[object], object]
    oscar: bool = False
    prefix_multiple: int = 1  # prompt lengths the cache takes (it quantizes whole groups of this many tokens)

    def oscar_template(self, model) -> OscarCache | None:
        """An unused OscarCache with this method's settings (for the decode-equivalent simulation), or None."""
        return self.build(model.config) if self.oscar else None


def _require(module: str, package: str) -> None:
    try:
        __import__(module)
    except ImportError as e:
        raise ImportError(f"this baseline needs `{package}` (pip install {package}); it is imported lazily") from e


# uniform 3-bit rows at TurboQuant 3-bit's bits per element: the Gaussian-optimal grid of 8 levels with one-byte
# (scale, zero) pairs, unclipped (the sigma grid saturates the tails itself)
_K3V3 = dict(bits=3, encoder="sigma", scale_dtype="compact")


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


# the presets that need calibrated rotations (`PRESETS[...].rotation == "file"`, unranked: a ranked preset given no
# file runs on the model's data-free profile, `oscar_hf.profile`), and the 4-bit row of `oscar`
ROTATION_METHODS = tuple(name for name, preset in PRESETS.items() if preset.rotation == "file" and not (
    preset.high_precision_layer_share or preset.high_precision_head_share)) + ("oscar4",)
# what to use instead when no rotations are given
DATA_FREE_ALTERNATIVE = {"oscar": "hadamard", "oscar4": "hadamard4"}


def _rotations_label(rotations: str | None) -> str:
    if rotations is None:
        return "needs --rotations"
    if rotations in NAMED_ROTATIONS:
        return f"rotations={rotations}"
    # a saved file of Hadamard rotations (kept for its recorded rankings) is not calibrated: say so in the tables,
    # and say when a file smooths its keys (`Rotations.key_smoothing`), which changes what its rows lose
    if os.path.exists(rotations):
        try:
            metadata = rotation_metadata(rotations)
        except (OSError, ValueError):
            metadata = {}  # the build reports the unreadable file; the label need not
        smoothed = ", keys smoothed" if KEY_SMOOTHING_KEY in metadata else ""
        if metadata.get("objective") == "hadamard":
            return f"Hadamard rotations from a file{smoothed}"
        return f"calibrated{smoothed}"
    return "calibrated"


def builtin_methods(rotations: str | None = None, **oscar_options) -> dict[str, Method]:
    """Every method of the side-by-side tables, keyed by name: each `OscarConfig` preset (`config.PRESETS`), the
    4-bit rows `hadamard4` and `oscar4`, the BF16 reference `bf16` and the peer caches.

    `rotations` (folder, file or Hub id, or "hadamard") feed the presets that read calibrated rotations
    (`ROTATION_METHODS`: `oscar`, `oscar-mixed`, `oscar-hifi`, `oscar-next`, `oscar4`); without them those rows are listed but
    cannot be built (`select_methods` says so before any work). `hadamard` and `hadamard4` are the same
    settings as `oscar` and `oscar4` with the data-free Hadamard rotation. `oscar_options` (e.g.
    `recent_tokens=128`) apply to every OSCAR-layout row.
    """
    given = _rotations_label(rotations)
    # a ranked preset given no rotations runs on the model's data-free profile (`oscar_hf.profile`)
    ranked = given if rotations is not None else "data-free profile: Hadamard, keys smoothed, ranked by induction"
    kivi = dict(nbits=2, axis_key=-1, axis_value=0, q_group_size=32, residual_length=128)
    methods = [
        Method("bf16", "BF16 (DynamicCache)", lambda m: DynamicCache(config=getattr(m, "config", m))),
        Method("none", "OSCAR layout, unquantized (tiers and merge only)", _oscar("none", **oscar_options), oscar=True),
        Method("identity", "naive INT2 (OSCAR layout, no rotation, no clip)", _oscar("identity", **oscar_options),
               oscar=True),
        Method("quarot", "Hadamard only (QuaRot-style)", _oscar("quarot", **oscar_options), oscar=True),
        Method("clip", "clip only", _oscar("clip", **oscar_options), oscar=True),
        Method("hadamard", "OSCAR (Hadamard)", _oscar("hadamard", **oscar_options), oscar=True),
        Method("oscar", f"OSCAR ({given})", _oscar("oscar", rotations, **oscar_options), oscar=True),
        Method("oscar-mixed", f"OSCAR-mixed ({ranked}; 2-bit sigma rows, one-byte scale and zero, the top tenth of "
               "the layers by retrieval ranking at 4 bits)", _oscar("oscar-mixed", rotations, **oscar_options),
               oscar=True),
        Method("oscar-hifi", f"OSCAR-hifi ({ranked}; 2-bit, the top fifth of the layers by retrieval ranking at 4 bits)",
               _oscar("oscar-hifi", rotations, **oscar_options), oscar=True),
        Method("oscar-next", f"OSCAR-next ({ranked}; 2-bit sigma rows, one-byte scale and zero, the top tenth of the "
               "KV heads by retrieval ranking at 4 bits)", _oscar("oscar-next", rotations, **oscar_options), oscar=True),
        Method("hadamard3", "OSCAR 3-bit (Hadamard; K3V3 sigma rows, one-byte scale and zero: 3.25 bits/element at "
               "head_dim 64, TurboQuant 3-bit's budget)",
               _oscar("hadamard", **{**oscar_options, **_K3V3}), oscar=True),
        Method("oscar-next3", f"OSCAR-next ({ranked}; 2-bit sigma rows, one-byte scale and zero, the top tenth of the "
               "KV heads by retrieval ranking at 3 bits)",
               _oscar("oscar-next", rotations, **{**oscar_options, "high_precision_bits": 3}), oscar=True),
        Method("hadamard4", "OSCAR 4-bit (Hadamard)", _oscar("hadamard", **{**oscar_options, "bits": 4}), oscar=True),
        Method("oscar4", f"OSCAR 4-bit ({given})", _oscar("oscar", rotations, **{**oscar_options, "bits": 4}),
               oscar=True),
        Method("kivi2", "KIVI-style 2-bit (quanto, per-channel K / per-token V, g32, R128)",
               _quantized("quanto", **kivi), prefix_multiple=kivi["q_group_size"]),
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
        Method("turboquant3", "TurboQuant-MSE 3-bit (own implementation: random orthogonal rotation per layer, "
               "Gaussian Lloyd-Max codes, a BF16 norm per token; every layer, R128): "
               f"{turboquant_bits_per_element(3, 64):g} bits/element at head_dim 64",
               lambda m: TurboQuantMSECache(m, bits=3, residual_length=128)),
    ]
    if oscar_options:  # the label says what the options changed, so a report never names a preset it did not run
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(oscar_options.items()))
        methods = [replace(m, label=f"{m.label}, with {options}") if m.oscar else m for m in methods]
    return {m.name: m for m in methods}


PEER_METHODS = ("kivi2", "quanto2", "quanto4", "hqq2", "hqq4", "turboquant2", "turboquant3")


def default_methods(rotations: str | None = None) -> tuple[str, ...]:
    """The methods of a run that names none: BF16, the OSCAR ablations, the OSCAR rows (`oscar`/`oscar4` with
    rotations, `hadamard`/`hadamard4` without) and the peer caches."""
    oscar_rows = ("oscar", "oscar4") if rotations is not None else ("hadamard", "hadamard4")
    return ("bf16", "identity", "quarot", "clip", *oscar_rows, *PEER_METHODS)


def parse_method_names(names: str | Sequence[str]) -> list[str]:
    """Method names from a comma-separated string or a list of them (each item may hold commas), duplicates
    dropped in order."""
    items = names.split(",") if isinstance(names, str) else [part for item in names for part in item.split(",")]
    return list(dict.fromkeys(n.strip() for n in items if n.strip()))


def select_methods(names: str | Sequence[str] | None = None, rotations: str | None = None,
                   **oscar_options) -> list[Method]:
    """The methods named (comma-separated or a list; None: `default_methods(rotations)`), in order.

    Checked before any work, with what to do instead: unknown names (the known ones listed), `oscar_options` that
    are not `OscarConfig` fields or fail its validation, and methods that read calibrated rotations
    (`ROTATION_METHODS`) when `rotations` is None; `oscar` never stands for Hadamard silently.
    """
    try:
        OscarConfig.from_method("hadamard", **oscar_options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"OSCAR options {oscar_options}: {error}") from error
    available = builtin_methods(rotations, **oscar_options)
    if names is None:
        chosen = list(default_methods(rotations))
        if rotations is None:
            logger.info("no rotations given: the OSCAR rows are hadamard and hadamard4 (data-free Hadamard "
                        "rotation); %s need calibrated rotations", ", ".join(ROTATION_METHODS))
    else:
        chosen = parse_method_names(names)
    if not chosen:
        raise ValueError(f"no method named; known: {', '.join(available)}")
    unknown = [n for n in chosen if n not in available]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(available)}")
    if rotations is None:
        for name in chosen:  # a ranked preset runs on the model's data-free profile (`oscar_hf.profile`)
            if name in ROTATION_METHODS:
                raise ValueError(
                    f"method {name!r} reads calibrated rotations: pass --rotations <folder, file or Hub id> (made by "
                    f"oscar-calibrate), or use {DATA_FREE_ALTERNATIVE[name]!r}, the same settings with the data-free "
                    "Hadamard rotation")
    return [available[n] for n in chosen]


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
    if isinstance(layer, TurboQuantMSELayer):  # it stores dequantized K/V: count its codes and norms instead
        as_bf16 = bf16_model and layer.is_initialized and layer.keys.dtype == torch.float32
        return layer.nbytes(torch.bfloat16 if as_bf16 else None)
    seen: set = set()
    return sum(_tensor_bytes(getattr(layer, name, None), bf16_model, seen) for name in CACHE_TENSORS)


def bits_per_element(cache, tokens: int, batch: int, num_kv_heads: int, head_dim: int,
                     bf16_model: bool = False) -> float:
    """Stored bits per cached K/V element over all layers, for `tokens` cached tokens."""
    elements = tokens * batch * num_kv_heads * 2 * head_dim * len(cache.layers)
    return 8.0 * sum(layer_stored_bytes(layer, bf16_model) for layer in cache.layers) / elements
