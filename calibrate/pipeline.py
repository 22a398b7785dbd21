"""The calibration pipeline: statistics from forward passes -> rotations (-> clip ratios, in `clip_search`).

```python
from calibrate import calibrate, CalibrationSettings
rotations = calibrate(model, sequences, CalibrationSettings(per_head=True), progress=True)
rotations.save_pretrained("rotations/")
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from oscar_hf.calibrate.capture import NoAttentionError, Observer, feed
from oscar_hf.calibrate.fit import fit_rotations
from oscar_hf.calibrate.objectives import KEY_OBJECTIVES, VALUE_OBJECTIVES, check_objectives, passes_needed
from oscar_hf.calibrate.smoothing import attach_key_smoothing
from oscar_hf.calibrate.statistics import MomentCollector, Tiers
from oscar_hf.model_support import UnsupportedModelError, attention_shape
from oscar_hf.profile import ChannelPower
from oscar_hf.rotations.rotations import Rotations


@dataclass(frozen=True)
class CalibrationSettings:
    """What to fit. `tiers` says which tokens the statistics count (`Tiers()` = all, as the reference)."""

    key_objective: str = "qqt"
    value_objective: str = "sst"
    per_head: bool = False
    tiers: Tiers = field(default_factory=Tiers)
    chunk_tokens: int = 2048
    max_elements: int = 1 << 23
    # per-channel key smoothing (`calibrate.smoothing`), measured in the statistics' own pass; the key rotation is
    # then fitted to the smoothed keys and queries
    smooth_keys: bool = False

    def __post_init__(self):
        check_objectives(self.key_objective, self.value_objective)
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={self.chunk_tokens}: expected >= 1")


def calibration_layers(model) -> tuple[list[int], int, int]:
    """(full-attention layer ids, KV heads, head_dim) of `model`; raises when there is nothing to calibrate."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no `config`: expected a transformers model")
    try:
        shape = attention_shape(config)
    except AttributeError as e:
        raise UnsupportedModelError(
            f"{type(model).__name__} ({getattr(config, 'model_type', '?')}) does not describe attention layers "
            f"(num_attention_heads / num_hidden_layers): nothing to calibrate ({e})"
        ) from e
    if not shape.oscar_layer_ids:
        raise UnsupportedModelError(
            "the model has no full-attention layers: OscarCache keeps sliding-window layers in BF16, nothing to calibrate"
        )
    return shape.oscar_layer_ids, shape.num_kv_heads, shape.head_dim


def collect_moments(
    model,
    sequences: Sequence[torch.Tensor],
    needs,
    tiers: Tiers = Tiers(),
    chunk_tokens: int = 2048,
    max_elements: int = 1 << 23,
    progress: bool = False,
    also: Observer | None = None,
) -> dict[str, dict[int, torch.Tensor]]:
    """Moment name -> layer -> float64 `[Hkv, d, d]` mean, for the names in `needs` (see `statistics.MOMENTS`).

    One forward pass over `sequences`, plus a second one when "sst" is requested (its weights need the final
    query moment). `also`, another observer of attention calls, sees the first pass too.
    """
    layers, kv_heads, head_dim = calibration_layers(model)
    if not sequences:
        raise ValueError("no calibration sequences: the data is empty")
    needs = frozenset(needs)
    first = (needs - {"sst"}) | ({"query"} if "sst" in needs else set())
    total = sum(s.shape[-1] for s in sequences)
    collector = MomentCollector(layers, kv_heads, head_dim, first, tiers, max_elements=max_elements)
    _run(model, sequences, collector, chunk_tokens, "statistics" if progress else False, total, also)
    result = {name: collector.means(name) for name in first}
    if "sst" in needs:
        second = MomentCollector(layers, kv_heads, head_dim, {"sst"}, tiers, query_moments=result["query"],
                                 max_elements=max_elements)
        _run(model, sequences, second, chunk_tokens, "value weights (2nd pass)" if progress else False, total)
        result["sst"] = second.means("sst")
    return {name: result[name] for name in needs}


def _run(model, sequences, collector: MomentCollector, chunk_tokens, progress, total,
         also: Observer | None = None) -> None:
    def both(*call) -> None:
        collector(*call)
        also(*call)

    feed(model, sequences, chunk_tokens, progress, total, observer=collector if also is None else both)
    if collector.calls == 0:
        raise NoAttentionError(
            f"{type(model).__name__} ran without calling any attention implementation: no attention layers to calibrate"
        )
    missing = sorted(set(collector.layers) - collector.seen_layers)
    if missing:
        raise NoAttentionError(f"full-attention layers {missing} were never called during the forward passes")


def smoothed_key_moments(moments: dict[str, dict[int, torch.Tensor]],
                         scales: dict[int, torch.Tensor]) -> dict[str, dict[int, torch.Tensor]]:
    """The key-objective moments as smoothed keys and queries have them: `E[(q s)(q s)ᵀ] = S E[q qᵀ] S` and
    `E[(k / s)(k / s)ᵀ] = S⁻¹ E[k kᵀ] S⁻¹` per KV head (`S = diag(s)`), for the layers `scales` covers. Value
    moments are unchanged: smoothing leaves every score, hence every softmax weight, as it was."""
    out = dict(moments)
    for name, power in (("query", 1.0), ("key", -1.0)):
        if name not in moments:
            continue
        smoothed = {}
        for layer, m in moments[name].items():
            if layer not in scales:
                smoothed[layer] = m
                continue
            s = scales[layer].to(device=m.device, dtype=m.dtype) ** power  # [Hkv, d]
            smoothed[layer] = s[:, :, None] * m * s[:, None, :]
        out[name] = smoothed
    return out


def rotations_from_moments(
    moments: dict[str, dict[int, torch.Tensor]],
    key_objective: str,
    value_objective: str,
    per_head: bool,
    layer_ids,
    kv_heads: int,
    head_dim: int,
    metadata: dict[str, str] | None = None,
) -> Rotations:
    """Fit the rotations of one (key objective, value objective) pair from collected moments."""
    check_objectives(key_objective, value_objective)
    key_moment, value_moment = KEY_OBJECTIVES[key_objective], VALUE_OBJECTIVES[value_objective]
    info = {
        "objective": f"key={key_objective},value={value_objective}",
        "key_objective": key_objective,
        "value_objective": value_objective,
        "grouping": "kv_head" if per_head else "layer",
        **(metadata or {}),
    }
    return fit_rotations(
        moments[key_moment] if key_moment else None,
        moments[value_moment] if value_moment else None,
        layer_ids, head_dim, kv_heads, per_head, info,
    )


def calibrate(
    model,
    sequences: Sequence[torch.Tensor],
    settings: CalibrationSettings = CalibrationSettings(),
    progress: bool = False,
    metadata: dict[str, str] | None = None,
) -> Rotations:
    """Fit `Rotations` for every full-attention layer of `model` from `[1, L]` token sequences.

    With `settings.smooth_keys` the key smoothing scales are measured in the statistics' first pass and stored with
    the rotations, and the key rotation is fitted to the keys and queries the history will hold, `k / s` and
    `q * s`, not to the raw ones (a rotation fitted before smoothing suits a distribution the history never
    holds). `metadata["data"]` names the text in the smoothing's description."""
    layers, kv_heads, head_dim = calibration_layers(model)
    first, second = passes_needed([settings.key_objective], [settings.value_objective])
    power = ChannelPower.for_model(model) if settings.smooth_keys else None
    moments = collect_moments(model, sequences, first | second, settings.tiers, settings.chunk_tokens,
                              settings.max_elements, progress, also=power)
    scales = power.scales() if power is not None else None
    if scales is not None:
        moments = smoothed_key_moments(moments, scales)
    tiers = settings.tiers
    info = {
        "tokens": str(sum(s.shape[-1] for s in sequences)),
        "sequences": str(len(sequences)),
        "tiers": "all" if not tiers.tier_aware else f"sink={tiers.sink},recent={tiers.recent}",
        "skip_tokens": str(tiers.skip_tokens),
        **(metadata or {}),
    }
    rotations = rotations_from_moments(moments, settings.key_objective, settings.value_objective, settings.per_head,
                                       layers, kv_heads, head_dim, info)
    if scales is None:
        return rotations
    return attach_key_smoothing(rotations, scales, sequences, info.get("data", "calibration sequences"))
