"""The resolver: (model, rotations, config) into a per-layer plan, which `OscarCache` builds its layers from.

In order: the config (a preset with options, or given whole; with no method and no row-format option, rotations
that rank retrieval make the default `oscar-next`, or `oscar-mixed` where they rank layers only, and so does a
model given no rotations: its data-free profile, `profile`, ranks it), the rotations (named, a `Rotations`, a
folder or a Hub repo, checked against the model; for a ranked preset on Hadamard rotations with the model at hand,
the profile's), the high-precision layers or KV heads a share takes from the rotations' ranking, the value
rotations folded into the model's weights (`rotations.folding`, asked for or found there), and per full-attention
layer: its settings (`OscarConfig.for_layer`, with the clip ratios the rotations record) and its rotations, sliced
to this tensor-parallel rank's heads (`parallel`).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch
from transformers.utils import logging

from oscar_hf.config import FORMAT_FIELDS, LAYER_RANKED_DEFAULT_METHOD, RANKED_DEFAULT_METHOD, OscarConfig
from oscar_hf.model_support import QUANTIZED, UnsupportedModelError, attention_shape
from oscar_hf.parallel import local_head_config, local_heads, tensor_parallel_position
from oscar_hf.profile import UnobservedLayersError, data_free_rotations
from oscar_hf.rotations import Rotations
from oscar_hf.rotations.folding import fold_value_rotations, folded_value_rotation

logger = logging.get_logger(__name__)

NAMED_ROTATIONS = ("hadamard", "identity")


@dataclass(frozen=True)
class LayerPlan:
    """One full-attention layer: its settings and its rotations (None: identity; `value_rotation` None also where
    the model's weights hold it, `query_rotation` None where it is the key rotation), and the layers that read its
    K/V (`AttentionShape.readers_of`)."""

    config: OscarConfig
    key_rotation: torch.Tensor | None
    value_rotation: torch.Tensor | None
    query_rotation: torch.Tensor | None
    readers: tuple[int, ...] = ()


@dataclass(frozen=True)
class CachePlan:
    """Everything `OscarCache` is built from, and what `save_pretrained` records of it."""

    config: OscarConfig
    rotations: Rotations | None
    rotations_name: str | None  # "hadamard" or "identity" where no file is needed, else None
    shape: object  # `model_support.AttentionShape`
    layers: tuple[LayerPlan | None, ...]  # None: transformers' own layer (`model_support.KEPT`, `SHARED`)
    recorded_clip_ratios: bool
    folds_value_rotation: bool


def plan_cache(model, rotations, method: str | None, config: OscarConfig | None, options: dict, *,
               fold_value_rotation: bool, recorded_clip_ratios: bool | None, hub_options: dict,
               own_attention: str | None = None) -> CachePlan:
    """The plan of an `OscarCache(model, rotations, method, config=config, **options)` (see its arguments).
    `own_attention`: why the model keeps its own attention (`model_support.own_attention_reason`), or None: then
    no profile can observe it, and the inferred default is the uniform `hadamard` rows."""
    model_config = getattr(model, "config", model)
    shape = attention_shape(model_config)
    if recorded_clip_ratios is None:  # the rotations' ratios, unless the caller chose ratios
        recorded_clip_ratios = not (config is not None or "key_clip_ratio" in options or "value_clip_ratio" in options)
    inferred = config is None and method is None
    weights = model is not model_config and own_attention is None  # a model a data-free profile can observe
    if config is None:
        config = OscarConfig.from_method(method or _infer_method(rotations, weights, options), **options)
    elif method is not None or options:
        raise TypeError("pass either config=OscarConfig(...) or method/options, not both")
    if not shape.oscar_layer_ids:
        # nothing to quantize (every layer a bounded window or a recurrent state): no profile, no rotations
        logger.warning_once("OscarCache: no layer of this model stores a growing full-attention K/V (its windows or "
                            "recurrent states already bound the cache), so nothing is stored at %s bits; the cache "
                            "holds what DynamicCache holds", config.bits)
        return CachePlan(config, None, "identity", shape, (None,) * len(shape.layer_kinds), recorded_clip_ratios,
                         False)
    source = rotations if rotations is not None else config.rotation
    # a ranked preset on Hadamard rotations: the model's own profile ranks it
    profile_ranks = _ranks(config) and (rotations is None or _named(rotations, "hadamard"))
    if own_attention is not None and profile_ranks:
        raise UnsupportedModelError(
            f"method={config.method!r} ranks layers or heads from a profile of the model's attention, which this "
            f"model computes itself ({own_attention}); use method='hadamard' (its default), or rotations that "
            "record a ranking")
    profiled = None
    if weights and profile_ranks:
        try:
            profiled = data_free_rotations(model)
        except UnobservedLayersError as error:
            if not inferred:
                raise
            # the default, where the profile cannot attribute the calls to layers: uniform rows need no profile
            logger.warning_once("OscarCache: %s; the default is method='hadamard' here", error)
            config = OscarConfig.from_method("hadamard", **options)
            source = rotations if rotations is not None else config.rotation
    if profiled is not None:
        resolved, source = resolve_rotations(profiled, shape, hub_options), "hadamard"
        # once per process and method: an evaluation builds a cache per prompt
        logger.info_once("OscarCache: method=%r on data-free rotations: Hadamard, keys smoothed and layers and KV "
                         "heads ranked by induction from one forward over random tokens (oscar_hf.profile)",
                         config.method)
    else:
        resolved = resolve_rotations(source, shape, hub_options)
    if inferred and config.method == "oscar" and _takes_ranked_default(resolved, options):
        default = RANKED_DEFAULT_METHOD if resolved.retrieval_heads() else LAYER_RANKED_DEFAULT_METHOD
        config = OscarConfig.from_method(default, **options)
        logger.info_once("OscarCache: method=%r, the 2-bit default of rotations that rank retrieval "
                         "(method='oscar' stores uniform 2-bit rows)", default)
    config = _with_ranked_precision(config, resolved, shape)
    _check_config(config, shape)
    folded = folded_layers(model, model_config, resolved, shape, fold_value_rotation)
    tp_rank, tp_size = tensor_parallel_position(model)
    layers = []
    for i, kind in enumerate(shape.layer_kinds):
        if kind != QUANTIZED:
            layers.append(None)
            continue
        key_r, value_r = resolved.for_layer(i) if resolved is not None else (None, None)
        query_r = None  # the key rotation, unless the keys are smoothed (`Rotations.key_transforms`)
        if resolved is not None and i in resolved.key_smoothing:
            key_r, query_r = resolved.key_transforms(i)
        key_r, value_r, query_r = (local_heads(r, tp_rank, tp_size) for r in (key_r, value_r, query_r))
        layer_config = local_head_config(config.for_layer(i), tp_rank, tp_size, shape.num_kv_heads)
        if recorded_clip_ratios and i not in config.high_precision_layers:
            layer_config = _recorded_clip_config(layer_config, resolved, i)
        layers.append(LayerPlan(layer_config, key_r, None if i in folded else value_r, query_r,
                                tuple(shape.readers_of(i))))
    name = "identity" if resolved is None else "hadamard" if _named(source, "hadamard") else None
    return CachePlan(config, resolved, name, shape, tuple(layers), recorded_clip_ratios, bool(folded))


def resolve_rotations(source, shape, hub_options: dict) -> Rotations | None:
    """A checked `Rotations` for the model's full-attention layers, or None for the identity."""
    layer_ids = shape.oscar_layer_ids
    if not layer_ids or _named(source, "identity"):
        return None
    if _named(source, "hadamard"):
        return Rotations.hadamard(layer_ids, shape.head_dim)
    if _named(source, "file"):
        raise ValueError(
            "method='oscar' needs calibrated rotations: pass rotations=<folder, file or Hub repo id> "
            "(make them with `oscar-calibrate`), or use method='hadamard' for data-free rotations"
        )
    if not isinstance(source, Rotations):
        source = Rotations.from_pretrained(source, **hub_options)
    source.check_model(layer_ids, shape.head_dim, shape.num_kv_heads)
    return source


def _infer_method(rotations, weights: bool, options: dict) -> str:
    """The preset of a cache given no method: on Hadamard rotations (or none), `RANKED_DEFAULT_METHOD` where the
    model's weights are at hand for its data-free profile and no option chooses a row format, else the uniform
    `hadamard` rows; `identity` for none; `oscar` for a file (which `_takes_ranked_default` may change)."""
    if rotations is None or _named(rotations, "hadamard"):
        ranked = weights and not any(name in options for name in FORMAT_FIELDS)
        return RANKED_DEFAULT_METHOD if ranked else "hadamard"
    if _named(rotations, "identity"):
        return "identity"
    return "oscar"


def _named(rotations, name: str) -> bool:
    """Whether `rotations` is the named source `name` (a string; a path or a `Rotations` never is)."""
    return isinstance(rotations, str) and rotations == name


def _ranks(config: OscarConfig) -> bool:
    """Whether `config` takes high-precision layers or KV heads from a ranking."""
    return bool(config.high_precision_layer_share or config.high_precision_head_share)


def _takes_ranked_default(rotations: Rotations | None, options: dict) -> bool:
    """Whether a cache whose method was inferred as `oscar` stores a ranked preset instead: its rotations record a
    ranking, and no option chooses a row format."""
    return (rotations is not None and bool(rotations.retrieval_layers() or rotations.retrieval_heads())
            and not any(name in options for name in FORMAT_FIELDS))


def _with_ranked_precision(config: OscarConfig, rotations: Rotations | None, shape) -> OscarConfig:
    """`config` with the high-precision layers or KV heads its shares take from the rotations' rankings."""
    if config.high_precision_layer_share and not config.high_precision_layers:
        ranking = rotations.retrieval_layers() if rotations is not None else None
        top = _top_share(config, ranking, config.high_precision_layer_share, len(shape.oscar_layer_ids), "layers",
                         "rank_retrieval_layers", "high_precision_layers=[...]")
        config = dataclasses.replace(config, high_precision_layers=top)
    if config.high_precision_head_share and not (config.high_precision_heads or config.high_precision_layers):
        ranking = rotations.retrieval_heads() if rotations is not None else None
        top = _top_share(config, ranking, config.high_precision_head_share,
                         len(shape.oscar_layer_ids) * shape.num_kv_heads, "KV heads", "rank_retrieval_heads",
                         "high_precision_heads=[(layer, kv_head), ...]")
        config = dataclasses.replace(config, high_precision_heads=top)
    return config


def _top_share(config: OscarConfig, ranking: list | None, share: float, units: int, what: str, ranker: str,
               option: str) -> tuple:
    """The first `share` of `units` entries of a recorded ranking (at least one); ValueError without a ranking."""
    if not ranking:
        raise ValueError(
            f"method={config.method!r} keeps the {what} retrieval depends on at {config.high_precision_bits} bits, "
            f"and these rotations record no ranking of those {what}: rank them with `oscar-calibrate ... "
            f"--rank-retrieval-layers` or `python -m oscar_hf.calibrate.retrieval_layers --model <model> --rotations "
            f"<folder>` (or oscar_hf.calibrate.retrieval_layers.{ranker}), or pass {option}"
        )
    return tuple(ranking[:max(1, math.ceil(share * units))])


def _check_config(config: OscarConfig, shape) -> None:
    """ValueError (or UnsupportedModelError) unless `config` fits the model's attention shape."""
    for row_format in config.row_formats:
        problem = row_format.unpackable(shape.head_dim) if config.quantize else None
        if problem:
            raise UnsupportedModelError(problem)
    unknown = sorted(set(config.high_precision_layers) - set(shape.oscar_layer_ids))
    if unknown:
        raise ValueError(f"high_precision_layers {unknown} are not full-attention layers of this model; those "
                         f"are {shape.oscar_layer_ids}")
    wrong = [pair for pair in config.high_precision_heads
             if pair[0] not in shape.oscar_layer_ids or pair[1] >= shape.num_kv_heads]
    if wrong:
        raise ValueError(f"high_precision_heads {wrong} are not KV heads of this model's full-attention layers (layers "
                         f"{shape.oscar_layer_ids}, KV heads 0-{shape.num_kv_heads - 1})")


def _recorded_clip_config(config: OscarConfig, rotations: Rotations | None, layer_idx: int) -> OscarConfig:
    """`config` with the clip ratios the rotations record for this layer and code width, if any."""
    recorded = rotations.clip_ratios(layer_idx, config.bits) if rotations is not None else None
    if recorded is None:
        return config
    return dataclasses.replace(config, key_clip_ratio=recorded[0], value_clip_ratio=recorded[1])


# ---------------------------------------------------------------------------------------------- folding
def live_caches(model) -> weakref.WeakSet:
    """The OscarCaches built on `model` that are still alive (folding checks them)."""
    caches = model.__dict__.get("_oscar_live_caches")
    if caches is None:
        caches = model.__dict__["_oscar_live_caches"] = weakref.WeakSet()
    return caches


def folded_layers(model, model_config, rotations, shape, fold: bool) -> set[int]:
    """Layers whose value rotation lives in the model's weights (folding them now if asked)."""
    if model is model_config:
        if fold:
            raise ValueError("fold_value_rotation=True needs the model itself, not its config")
        return set()
    already = {i for i in shape.oscar_layer_ids if folded_value_rotation(model, i) is not None}
    for i in already:
        wanted = rotations.value[i] if rotations is not None else None
        if wanted is None or not torch.equal(folded_value_rotation(model, i), wanted):
            raise ValueError(
                f"this model has value rotations folded into its weights (layer {i}) that differ from the requested "
                "ones; build caches with the same rotations, or reload the model"
            )
    if fold and rotations is not None:
        holding = [cache for cache in live_caches(model) if int(cache.get_seq_length())]
        if holding and set(shape.oscar_layer_ids) - already:  # folding would rewrite weights (not a no-op)
            raise ValueError(
                f"fold_value_rotation=True rewrites this model's v_proj/o_proj weights in place, and {len(holding)} "
                "OscarCache(s) built on it hold tokens computed with the current weights, which the folded model "
                "would misread. Fold before filling any cache, or call reset() on those caches first (a "
                "DynamicCache filled on this model becomes invalid the same way)."
            )
        if tensor_parallel_position(model)[1] > 1:
            raise NotImplementedError("fold_value_rotation is not supported on tensor-parallel (sharded) models")
        fold_value_rotations(model, rotations, shape.oscar_layer_ids, shape.num_kv_heads, shape.head_dim)
        return set(shape.oscar_layer_ids)
    return already
