"""Clip-ratio search on held-out calibration tokens, minimising the attention-output error of `attention_error`.

Coordinate search: the key ratio first (values at their default ratio), then the value ratio (keys at the chosen
ratio). With `per_layer=True` each layer keeps its own best pair (the layers' errors are measured on the same
BF16 inputs, so they are independent); otherwise the pair with the lowest mean relative output MSE over layers.

Per-layer ratios are carried in the `Rotations` metadata (`key_clip_ratios` / `value_clip_ratios`, JSON
`{layer: ratio}`) or, for one pair, `key_clip_ratio` / `value_clip_ratio`; `OscarCache` applies them when it
loads the rotations (`Rotations.clip_ratios`). `apply_clip_ratios` sets other ratios on a fresh cache.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from oscar_hf.calibrate.attention_error import AttentionErrorProbe, Candidate, ClipRatio
from oscar_hf.calibrate.capture import feed
from oscar_hf.kernels.reference.quantize import fake_quantize
from oscar_hf.rotations.rotations import Rotations, recorded_clip_ratios


def encoder_fake_quantizer(encoder: str):
    """Quantize-dequantize rows the way `OscarConfig(encoder=...)` stores them."""
    return functools.partial(fake_quantize, encoder=encoder)


def clip_grid(head_dim: int, lowest: float = 0.75) -> list[ClipRatio]:
    """Every distinct order-statistic clip from `lowest * head_dim` up to no clipping (None).

    Ratio `(i + 0.5) / d` selects `sort(|x|)[i]` without floating-point edge cases.
    """
    first = max(1, int(lowest * head_dim))
    return [(i + 0.5) / head_dim for i in range(first, head_dim - 1)] + [None]


@dataclass
class ClipChoice:
    """Chosen ratios (a float/None, or layer -> ratio) and the searched errors (stage -> ratio -> layer -> rel MSE)."""

    key: ClipRatio | dict[int, ClipRatio]
    value: ClipRatio | dict[int, ClipRatio]
    errors: dict[str, dict[str, dict[int, float]]]
    bits: int = 2  # the code width searched: caches of another width ignore these ratios

    def metadata(self) -> dict[str, str]:
        width = {"clip_bits": str(self.bits)}
        if isinstance(self.key, dict):
            return {"key_clip_ratios": json.dumps({str(i): r for i, r in self.key.items()}),
                    "value_clip_ratios": json.dumps({str(i): r for i, r in self.value.items()}), **width}
        return {"key_clip_ratio": json.dumps(self.key), "value_clip_ratio": json.dumps(self.value), **width}


def shortest_search_sequence(sink: int, recent: int) -> int:
    """The fewest tokens a held-out sequence needs for the search to measure anything: a query sees quantized
    history only beyond `sink + recent + 1` tokens."""
    return sink + recent + 2


def check_search_sequences(sequences: Sequence[torch.Tensor], sink: int, recent: int) -> None:
    """Raise ValueError unless one of the held-out `[1, L]` sequences is long enough to search on (cheap: run it
    before any forward pass)."""
    if not sequences or max(s.shape[-1] for s in sequences) < shortest_search_sequence(sink, recent):
        longest = max((s.shape[-1] for s in sequences), default=0)
        raise ValueError(
            f"clip search needs a held-out sequence longer than sink + recent + 1 = {sink + recent + 1} tokens "
            f"(only then does a query see quantized history); the longest is {longest}"
        )


def _probe(model, sequences, candidates, layer_ids, sink, recent, chunk_tokens, progress, label, query_stride):
    probe = AttentionErrorProbe(candidates, layer_ids, sink, recent, query_stride=query_stride)
    feed(model, sequences, chunk_tokens, progress=label if progress else False,
             total_tokens=sum(s.shape[-1] for s in sequences), observer=probe)
    return {name: {i: e.rel_mse for i, e in layers.items()} for name, layers in probe.errors.items()}


def _choose(errors: dict[ClipRatio, dict[int, float]], per_layer: bool, layer_ids):
    if per_layer:
        return {i: min(errors, key=lambda r: errors[r].get(i, float("inf"))) for i in layer_ids}
    return min(errors, key=lambda r: sum(errors[r].values()) / max(1, len(errors[r])))


def search_clip_ratios(
    model,
    sequences: Sequence[torch.Tensor],
    rotations: Rotations | None,
    layer_ids,
    head_dim: int,
    per_layer: bool = False,
    key_grid: Sequence[ClipRatio] | None = None,
    value_grid: Sequence[ClipRatio] | None = None,
    default_value_clip: ClipRatio = 0.92,
    bits: int = 2,
    scale_dtype: torch.dtype = torch.float16,
    sink: int = 64,
    recent: int = 256,
    chunk_tokens: int = 4096,
    progress: bool = False,
    query_stride: int = 4,
    encoder: str = "minmax",
) -> ClipChoice:
    """Search key then value clip ratios on `sequences` (held-out calibration text longer than `sink + recent`).

    Errors are measured on every `query_stride`-th query position (all keys count); `encoder` is the cache's
    `OscarConfig.encoder` ("minmax" or "lloyd").
    """
    check_search_sequences(sequences, sink, recent)
    key_grid = list(key_grid if key_grid is not None else clip_grid(head_dim))
    value_grid = list(value_grid if value_grid is not None else clip_grid(head_dim))
    base = Candidate(rotations, bits=bits, scale_dtype=scale_dtype, quantizer=encoder_fake_quantizer(encoder))

    key_candidates = {str(r): dataclasses.replace(base, key_clip=r, value_clip=default_value_clip) for r in key_grid}
    key_errors = _probe(model, sequences, key_candidates, layer_ids, sink, recent, chunk_tokens, progress,
                        "clip search K", query_stride)
    key_by_ratio = {r: key_errors[str(r)] for r in key_grid}
    key_choice = _choose(key_by_ratio, per_layer, layer_ids)
    value_candidates = {str(r): dataclasses.replace(base, key_clip=key_choice, value_clip=r) for r in value_grid}
    value_errors = _probe(model, sequences, value_candidates, layer_ids, sink, recent, chunk_tokens, progress,
                          "clip search V", query_stride)
    value_by_ratio = {r: value_errors[str(r)] for r in value_grid}
    value_choice = _choose(value_by_ratio, per_layer, layer_ids)
    return ClipChoice(key_choice, value_choice, {"key": key_errors, "value": value_errors}, bits)


def clip_ratios_from_metadata(metadata: Mapping[str, str]):
    """(key, value) clip ratios recorded by the search: floats/None, `{layer: ratio}` dicts, or (None, None)
    when the metadata holds none (then the preset's ratios apply). See `oscar_hf.rotations.recorded_clip_ratios`."""
    return recorded_clip_ratios(metadata) or (None, None)


def apply_clip_ratios(cache, key: ClipRatio | Mapping[int, ClipRatio], value: ClipRatio | Mapping[int, ClipRatio]):
    """Give each `OscarLayer` of a fresh `cache` its own clip ratios (before the first forward); returns the cache.

    `OscarCache` already applies the ratios its rotations record; this is for trying other ratios (experiments).
    """
    from oscar_hf.layer import OscarLayer

    for layer in cache.layers:
        if not isinstance(layer, OscarLayer):
            continue
        if layer.is_initialized:
            raise ValueError("apply_clip_ratios must be called on a fresh cache, before its first forward")
        k = key.get(layer.layer_idx, layer.config.key_clip_ratio) if isinstance(key, Mapping) else key
        v = value.get(layer.layer_idx, layer.config.value_clip_ratio) if isinstance(value, Mapping) else value
        layer.config = dataclasses.replace(layer.config, key_clip_ratio=k, value_clip_ratio=v)
    return cache
