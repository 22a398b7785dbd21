"""Which models OscarCache handles, and how each of their layers is cached."""

from __future__ import annotations

from dataclasses import dataclass

OSCAR_LAYER = "oscar"
SLIDING_LAYER = "sliding"



class UnsupportedModelError(ValueError):
    """The model's KV layout is not one OscarCache can hold."""


@dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[str, ...]  # OSCAR_LAYER or SLIDING_LAYER per layer
    sliding_window: int | None

    @property
    def oscar_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == OSCAR_LAYER]


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


def attention_shape(config) -> AttentionShape:
    """Layer plan and head geometry of a model config; raises `UnsupportedModelError` with the reason."""
    cfg = text_config_of(config)
    model_type = getattr(cfg, "model_type", "?")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type}: encoder-decoder models are not supported (decoder-only LMs only)")
    if getattr(cfg, "kv_lora_rank", None):
        raise UnsupportedModelError(
            f"{model_type}: multi-head latent attention (MLA) caches a compressed latent, not per-head K/V; "
            "OscarCache does not support it"
        )
    if (getattr(cfg, "num_kv_shared_layers", None) or 0) > 0 or getattr(cfg, "kv_sharing_modes", None):
        raise UnsupportedModelError(f"{model_type}: layers that share another layer's KV cache are not supported")
    if model_type in ("gpt_oss",):
        raise UnsupportedModelError(f"{model_type}: learned attention-sink logits are not supported")
    num_layers = cfg.num_hidden_layers
    layer_types = getattr(cfg, "layer_types", None)
    sliding_window = getattr(cfg, "sliding_window", None)
    if layer_types is None:
        if getattr(cfg, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"] * num_layers
        elif sliding_window is not None:
            layer_types = ["sliding_attention"] * num_layers
        else:
            layer_types = ["full_attention"] * num_layers
    kinds = []
    for i, layer_type in enumerate(layer_types[:num_layers]):
        if layer_type == "full_attention":
            kinds.append(OSCAR_LAYER)
        elif layer_type == "sliding_attention":
            kinds.append(SLIDING_LAYER)
        else:
            raise UnsupportedModelError(
                f"{model_type}: layer {i} is of type {layer_type!r}; OscarCache supports 'full_attention' "
                "(quantized) and 'sliding_attention' (kept in BF16) layers only"
            )
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{model_type}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return AttentionShape(num_layers, num_heads, num_kv_heads, head_dim, tuple(kinds), sliding_window)
