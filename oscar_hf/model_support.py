"""Which models OscarCache handles, and how each of their layers is cached.

The layer plan is transformers' own: `DynamicCache(config=...)` builds one cache layer per model layer from the
config's `layer_types` (full, sliding and chunked attention, linear-attention / SSM / convolution states, layers
that share another layer's K/V), and OscarCache replaces only the layers that store a growing full-attention K/V:

- `QUANTIZED`: a full-attention layer (alone, or beside a linear-attention state in one decoder layer); also a
  sliding window at least as long as the model's positions, which is full attention in all but name;
- `KEPT`: transformers' own layer, as `DynamicCache` builds it (sliding and chunked windows already bound their
  size; recurrent and convolution states do not grow);
- `SHARED`: a layer that attends to an earlier layer's K/V and stores nothing (Gemma 3n, Gemma 4), listed with
  its source in `AttentionShape.kv_sources`.

Where the tiered "oscar" attention cannot compute a layer's attention (`own_attention_reason`: ALiBi's per-head
position bias, an attention that reads its cache twice, a model whose layers do not call transformers'
AttentionInterface), the model keeps its own attention and the cache hands it the whole K/V dequantized: stored at
2 bits, correct, without the tiered attention's speed. A config with no attention heads (RWKV) has nothing to
quantize.

Refused with `UnsupportedModelError`, before any forward: multi-head latent attention (its cache is a compressed
latent, not per-head K/V), encoder-decoders, and quantized layers of unequal head geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZED = "quantized"
KEPT = "kept"
SHARED = "shared"

ALIBI = "ALiBi adds a per-head position bias to every score, which the tiered attention does not carry"
# model types whose attention the tiered "oscar" attention cannot compute, for every architecture of the family
# (Falcon says ALiBi per config)
OWN_ATTENTION_FAMILIES = {
    "bloom": ALIBI,
    "mpt": ALIBI,
    "diffllama": "its differential attention reads each layer's cache twice per forward, and the cache demotes "
                 "after the first read",
    "doge": "its attention mask carries a bias computed from every cached value",
    "jetmoe": "its query heads read the KV heads repeated, not grouped (a mixture of attention heads)",
    "git": "its layers compute their scores themselves, though it accepts an attention implementation",
    "inkling2_text": "its sink logits are computed per token",
    "inkling2_loop_text": "its sink logits are computed per token",
}


class UnsupportedModelError(ValueError):
    """The model's KV layout is not one OscarCache can hold."""


@dataclass(frozen=True)
class AttentionShape:
    """The layer plan and the quantized layers' head geometry.

    `layer_kinds`: `QUANTIZED`, `KEPT` or `SHARED` per cache layer (as many as transformers' `DynamicCache` builds
    for the config). `kv_sources`: (reading layer, layer whose K/V it reads) for every `SHARED` layer that reads a
    quantized one. `num_kv_heads` / `head_dim`: those of the quantized layers."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[str, ...]
    kv_sources: tuple[tuple[int, int], ...] = ()

    @property
    def oscar_layer_ids(self) -> list[int]:
        """The layers whose K/V the cache quantizes."""
        return [i for i, kind in enumerate(self.layer_kinds) if kind == QUANTIZED]

    def readers_of(self, layer_idx: int) -> list[int]:
        """The layers that attend to `layer_idx`'s K/V besides itself (KV sharing)."""
        return [reader for reader, source in self.kv_sources if source == layer_idx]


def rotary_dim(config, head_dim: int) -> int:
    """How many leading channels of a head RoPE turns: 0 for a model without RoPE, fewer than `head_dim` under a
    `partial_rotary_factor`. transformers' `rotate_half` turns channel i with channel i + r/2 (r this number)."""
    cfg = text_config_of(config)
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # one set per layer type (e.g. Gemma 3)
        params = params["full_attention"]
    if not params and getattr(cfg, "rope_theta", None) is None:
        return 0
    factor = (params or {}).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor) // 2 * 2


def text_config_of(config):
    """The decoder text config of a (possibly multimodal) model config."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def transformers_cache_layers(config) -> list:
    """The cache layers transformers' own `DynamicCache` builds for `config`, one per cached model layer."""
    from transformers import DynamicCache

    return DynamicCache(config=config).layers


def attention_shape(config) -> AttentionShape:
    """Layer plan and head geometry of a model config; raises `UnsupportedModelError` with the reason."""
    cfg = text_config_of(config)
    model_type = getattr(cfg, "model_type", "?")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type}: encoder-decoder models are not supported (decoder-only LMs only)")
    if _any_layer_has(cfg, "kv_lora_rank"):
        raise UnsupportedModelError(
            f"{model_type}: multi-head latent attention (MLA) caches a compressed latent, not per-head K/V; "
            "OscarCache does not support it (docs/models.md)"
        )
    kinds = [_layer_kind(layer, cfg) for layer in transformers_cache_layers(cfg)]
    for i in getattr(cfg, "cross_attention_layers", None) or ():  # Mllama: the image's K/V, which do not grow
        if i < len(kinds):
            kinds[i] = KEPT
    sources = kv_sharing_sources(cfg)
    for reader in sources:
        if reader < len(kinds):
            kinds[reader] = SHARED  # an empty stand-in (`DummyLayer`) in transformers' plan
    quantized = [i for i, kind in enumerate(kinds) if kind == QUANTIZED]
    if not quantized:  # nothing to quantize (windows, recurrent states): no head geometry to read (Mamba has none)
        return AttentionShape(cfg.num_hidden_layers, 0, 0, 0, tuple(kinds))
    try:
        geometry = {_head_geometry(cfg, i) for i in quantized}
    except AttributeError:  # no attention heads (RWKV): transformers plans full-attention layers it never fills
        return AttentionShape(cfg.num_hidden_layers, 0, 0, 0, (KEPT,) * len(kinds))
    if len(geometry) > 1:
        raise UnsupportedModelError(f"{model_type}: its full-attention layers differ in heads or head size "
                                    f"{sorted(geometry)}; OscarCache needs one geometry for them")
    num_heads, num_kv_heads, head_dim = geometry.pop()
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{model_type}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    kv_sources = tuple((r, s) for r, s in sorted(sources.items()) if s < len(kinds) and kinds[s] == QUANTIZED)
    return AttentionShape(cfg.num_hidden_layers, num_heads, num_kv_heads, head_dim, tuple(kinds), kv_sources)


def own_attention_reason(config) -> str | None:
    """Why the model's layers keep their own attention over dequantized K/V instead of the tiered "oscar" one
    (module docstring), or None. A model whose layers do not call transformers' AttentionInterface is found by
    trying to switch it (`attention.takes_oscar_attention`), not from its config."""
    cfg = text_config_of(config)
    if getattr(cfg, "alibi", False):
        return ALIBI
    return OWN_ATTENTION_FAMILIES.get(getattr(cfg, "model_type", None))


def _any_layer_has(cfg, name: str) -> bool:
    """Whether `cfg` sets `name`, for the whole model or (a heterogeneous config, which refuses the global read)
    for any layer."""
    try:
        return bool(getattr(cfg, name, None))
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return any(getattr(layer, name, None) for layer in cfg.per_layer_config)


def _layer_kind(layer, cfg) -> str:
    """`QUANTIZED` for transformers' plain full-attention layers (alone or beside a linear-attention state), and for
    sliding windows no shorter than the model's positions; `KEPT` for every other layer."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionAndFullAttentionLayer

    if type(layer) in (DynamicLayer, LinearAttentionAndFullAttentionLayer):
        return QUANTIZED
    if type(layer) is DynamicSlidingWindowLayer:
        positions = getattr(cfg, "max_position_embeddings", None)
        return QUANTIZED if positions is not None and layer.sliding_window >= positions else KEPT
    return KEPT


def kv_sharing_sources(cfg) -> dict[int, int]:
    """{layer that reads another layer's K/V: that layer}. transformers marks readers either by `kv_sharing_modes`
    ("reuse"; the source is the last earlier "store" layer of the same layer type) or by `num_kv_shared_layers` (the
    last ones; the source is the last earlier non-shared layer of the same type)."""
    layer_types = getattr(cfg, "layer_types", None)
    modes = getattr(cfg, "kv_sharing_modes", None)
    count = getattr(cfg, "num_kv_shared_layers", None) or 0
    if layer_types is None or not (modes or count > 0):
        return {}
    num_layers = cfg.num_hidden_layers
    readers = ([i for i, mode in enumerate(modes) if mode == "reuse"] if modes
               else list(range(num_layers - count, num_layers)))
    first = min(readers, default=num_layers)
    sources = {}
    for reader in readers:
        earlier = [j for j in range(first) if layer_types[j] == layer_types[reader]
                   and (not modes or modes[j] == "store")]
        if earlier:
            sources[reader] = earlier[-1]
    return sources


def _head_geometry(cfg, layer_idx: int | None) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of layer `layer_idx` (a per-layer config where the model has one)."""
    per_layer = getattr(cfg, "per_layer_config", None) if layer_idx is not None else None
    layer_cfg = per_layer[layer_idx] if per_layer else cfg
    num_heads = getattr(layer_cfg, "num_attention_heads", None) or cfg.num_attention_heads
    num_kv_heads = getattr(layer_cfg, "num_key_value_heads", None) or getattr(cfg, "num_key_value_heads", None)
    head_dim = next((getattr(c, name) for c in (layer_cfg, cfg) for name in ("head_dim", "dim_head")  # CPM-Ant
                     if getattr(c, name, None)), None)
    return num_heads, num_kv_heads or num_heads, head_dim or cfg.hidden_size // num_heads
