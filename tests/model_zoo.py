"""Every causal-LM family of the installed transformers, as a tiny random config.

The families come from transformers' own registry (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), so a new release's families
show up by themselves. `tiny_config(model_type)` instantiates the family's config class with its defaults and shrinks
it generically: every size attribute named in `SMALL_SIZES` (found under its canonical name or the class's
`attribute_map` alias) gets a small value, nested configs (text, vision, audio, ...) are shrunk the same way, and the
family's layer pattern (`layer_types`: full / sliding / linear attention, convolution, mamba, ...) keeps its mix of
types over `TINY_LAYERS` layers (`UNIFORM_LAYERS` where every layer is alike). `FAMILY_OVERRIDES` holds the few values
generic shrinking cannot find, each with the reason; `NOT_BUILDABLE` the families transformers cannot build tiny here,
with the reason, as data.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

TINY_LAYERS = 4
UNIFORM_LAYERS = 2  # a family whose tiny layers are all alike gets this many (half the time per check)
PROMPT_TOKENS = 80
PAD_TOKENS = 10  # left padding of the batch's second row
NEW_TOKENS = 8
TINY_VOCAB = 128
SLIDING_WINDOW = 16  # small enough that a window matters on an ~80-token prompt
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

# canonical size attribute -> tiny value; a name absent from a config (or None there, i.e. unused) is left alone
SMALL_SIZES: dict[str, int] = {
    # the transformer trunk
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "embedding_size": 64,
    "num_hidden_layers": TINY_LAYERS,  # the layer counts: `LAYER_COUNTS`
    "num_layers": TINY_LAYERS,
    "n_layers": TINY_LAYERS,
    "num_attention_heads": 4,
    "num_heads": 4,
    "n_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "attention_head_dim": 16,
    "attention_head_size": 16,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "ffn_hidden_size": 128,
    "d_inner": 128,
    "dim_ff": 128,
    "feed_forward_size": 128,
    "intermediate_size_mlp": 128,
    "mlp_only_intermediate_size": 128,
    "dense_intermediate_size": 128,
    "first_dense_intermediate_size": 128,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "n_ctx": 512,
    "max_seq_len": 2048,
    "rotary_dim": 8,
    "sliding_window": SLIDING_WINDOW,
    "sliding_window_size": SLIDING_WINDOW,
    "attention_window_size": SLIDING_WINDOW,
    "attention_chunk_size": SLIDING_WINDOW,
    "local_attention_window_len": SLIDING_WINDOW,
    "window_size": SLIDING_WINDOW,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    # mixtures of experts
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "router_hidden_size": 32,
    # multi-head latent attention and its sparse indexer
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_num_heads": 2,
    "index_head_dim": 16,
    "index_topk": 32,
    # linear attention / state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_head_dim": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_d_head": 16,
    "mamba_d_ssm": 128,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "lru_width": 64,
    "attention_hidden_size": 64,
    # encoder-decoder and multimodal towers
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_encoder_attention_heads": 4,
    "num_decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_source_positions": 2048,
    "max_target_positions": 2048,
    # per-layer-input embeddings (Gemma 3n / 4) and other side towers
    "vocab_size_per_layer_input": TINY_VOCAB,
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    # layer-count splits and dense-before-MoE counts, which must fit the tiny trunk
    "n_input_layers": 1,
    "n_output_layers": 1,
    "num_dense_layers": 1,
    "unpadded_vocab_size": TINY_VOCAB,
    "encoder_hash_byte_group_vocab": TINY_VOCAB,
}

LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layers")
# a config's per-layer pattern: `layer_types`, or (older releases, hybrids) a `layers_block_type` property
LAYER_PATTERNS = ("layer_types", "layers_block_type")
# names of attributes that list layer indices (cross_attention_layers, moe_layers, full_attn_idxs, ...)
LAYER_INDEX_SUFFIXES = ("_layers", "_idxs", "_indices", "_layer_ids")
# sizes set even where the family leaves them None: None means "derived" (hidden_size / heads, or as many KV heads
# as query heads), and some families' models read the raw None; the tiny value is the derived one or GQA 4:2
SET_WHEN_NONE = ("head_dim", "num_key_value_heads")
# position counts: the family's, clamped to [table value, MAX_POSITIONS] (any other size is never made larger)
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_source_positions",
             "max_target_positions")
MAX_POSITIONS = 512  # the default's data-free profile then feeds 2 x 255 tokens: the sweep stays minutes
# (size, follows) in a multi-head latent attention config (`kv_lora_rank` set): where the family has them equal,
# the first stays equal to the second (the RoPE part of the head; K/V expanded per query head from the latent)
MLA_TIED_SIZES = (("head_dim", "qk_rope_head_dim"), ("num_key_value_heads", "num_attention_heads"))

# token-id attributes: set where they exist, so that every id fits the tiny vocabulary
TOKEN_IDS = {"pad_token_id": PAD_TOKEN_ID, "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}

# model_type -> constructor values generic shrinking cannot find, each with the reason; a composite family's values
# for a nested config sit under that config's key (e.g. "text_config")
FAMILY_OVERRIDES: dict[str, dict] = {
    # the layer pattern is a property of attn_layer_period/offset (8/4): 4 layers would hold no attention layer
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    # the layer pattern is run-length pairs (attention_types, 12 x [global, local]) that must add up to the layers
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]]),
    # Mamba-2's heads tile expand * hidden_size (2 * 64) with head_dim (16)
    "mamba2": dict(num_heads=8),
    # the default config has no attention layer (attn_layer_indices unset); Bamba checkpoints put a few among the
    # mamba layers
    "bamba": dict(attn_layer_indices=[3]),
    # the default config has no attention layer (all linear_attention); Granite 4.0 hybrids mix them in
    "granitemoehybrid": dict(layer_types=["linear_attention"] * 3 + ["full_attention"]),
    # the default config has no layer_types, which the model reads (LFM2 checkpoints mix conv and attention layers)
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # the default config leaves the expert counts unset (None), so its MoE layers cannot be built
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    # the default config leaves num_experts_per_tok unset (None), which the router's top-k needs
    "deepseek_v2": dict(num_experts_per_tok=2),
    # the sliding layers' head_dim must equal their qk_nope_head_dim + qk_rope_head_dim: 24 + 8 once their per-layer
    # qk_nope_head_dim (1.5x the global one) is scaled with it
    "dots3_note_text": dict(head_dim=32),
    # ... the vision tower's default expert pyramid spells out its 42 layers (dense layers only fit any depth), and
    # the towers' adapters must match the hidden sizes they join (all 64 here)
    "dots3_note": {
        "text_config": dict(head_dim=32),
        "vision_config": dict(mlp_layer_types=["dense"] * TINY_LAYERS, adapter_in_dim=64, adapter_out_dim=64),
        "audio_config": dict(adapter_input_size=64, adapter_out_dim=64),
    },
    # the default config leaves the QSA indexer unset (None), which the indexed-attention layers need
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=32,
                           indexer_compress_ratio=4),
    "qwen4_exp": {"text_config": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=32,
                                      indexer_compress_ratio=4)},
    # the default config has no RoPE parameters (checkpoints carry one set per layer type), which the model reads; its
    # 3D RoPE splits the head's 8 frequencies into (height, width, time) sections
    "cohere_compass_text": dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}}),
    # the last num_kv_shared_layers layers reuse the KV of the last earlier layer of their type, so both types must
    # come before them: 15 shared layers and a 4:1 pattern need more than 4 layers
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2),
    "gemma3n": {"text_config": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2)},
    # the assistant's text config must have no per-layer input embeddings, which the default text config has
    "gemma4_assistant": {"text_config": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)},
    "gemma4_unified_assistant": {"text_config": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)},
    # every hybrid layer ties its shared transformer's weights to the first hybrid layer's, which transformers
    # refuses with a single hybrid layer (the family's pattern gives one in 4 layers)
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"] * 2),
    # the axial position embedding splits hidden_size (64) into two factors
    "reformer": dict(axial_pos_embds_dim=[32, 32]),
}

# model_type -> (package, what needs it): optional dependencies without which transformers cannot build the family
OPTIONAL_DEPENDENCIES: dict[str, tuple[str, str]] = {
    "gemma3n": ("timm", "its vision tower is a timm model (TimmWrapperModel)"),
}
# model_type -> why transformers cannot build or run this family tiny here (recorded, not hidden)
NOT_BUILDABLE: dict[str, str] = {
    family: f"{why}, and {package} is not installed" for family, (package, why) in OPTIONAL_DEPENDENCIES.items()
    if importlib.util.find_spec(package) is None
}


class TinyConfigUnavailable(RuntimeError):
    """transformers cannot build this family tiny in this environment (the message says why)."""


def causal_lm_families() -> list[str]:
    """Every model type transformers maps to a causal-LM class, sorted (from its registry, not a hand-picked list)."""
    return sorted(model_type for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if model_type in CONFIG_MAPPING)


def tiny_config(model_type: str) -> PretrainedConfig:
    """A tiny random-weight config of family `model_type`: `TINY_LAYERS` layers keeping the family's mix of layer
    types (`UNIFORM_LAYERS` where all its layers are alike), hidden 64, 4 query / 2 KV heads of 16 where the family has
    GQA, vocabulary `TINY_VOCAB`, 2,048 to `MAX_POSITIONS` positions, sliding windows of `SLIDING_WINDOW`. Raises
    `TinyConfigUnavailable` for a family in `NOT_BUILDABLE`."""
    if model_type in NOT_BUILDABLE:
        raise TinyConfigUnavailable(f"{model_type}: {NOT_BUILDABLE[model_type]}")
    config_class = CONFIG_MAPPING[model_type]
    overrides = FAMILY_OVERRIDES.get(model_type, {})
    try:
        default = config_class()
    except Exception:  # a family whose defaults do not validate builds with its overrides
        default = config_class(**overrides)
    config = _shrunk(default, overrides)
    if _layers_alike(config):
        try:
            shallow = _shrunk(default, overrides, UNIFORM_LAYERS)
        except Exception:  # the family needs more layers than that
            shallow = None
        if shallow is not None and _layers_alike(shallow):
            config = shallow
    _set_token_ids(config)
    return config


def layer_types_of(config: PretrainedConfig) -> list[str] | None:
    """The per-layer pattern of a config's text part (the first of `LAYER_PATTERNS` it has, under its
    `attribute_map` name), or None."""
    text = config.get_text_config(decoder=True)
    for name in LAYER_PATTERNS:
        pattern = config_value(text, _attribute_name(text, name))
        if isinstance(pattern, (list, tuple)):
            return list(pattern)
    return None


def config_value(config: PretrainedConfig, name: str):
    """`config.name`, or None where it is absent; the global value of a heterogeneous config's per-layer attribute
    (which plain attribute access refuses)."""
    if name in vars(config):
        return vars(config)[name]
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _field_names(config_class) -> set[str]:
    return {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()


def _attribute_name(config: PretrainedConfig, canonical: str) -> str:
    """The name under which `config` stores the canonical attribute (`attribute_map` aliases, e.g. GPT-2's n_embd)."""
    return type(config).attribute_map.get(canonical, canonical)


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _derived_fields(config_class) -> set[str]:
    """Fields whose default is None or a string ("auto"): the config derives them from the others."""
    if not dataclasses.is_dataclass(config_class):
        return set()
    return {f.name for f in dataclasses.fields(config_class) if f.default is None or isinstance(f.default, str)}


def _layers_alike(config: PretrainedConfig) -> bool:
    """Whether every layer of `config`'s text part is configured alike: its layer pattern (`layer_types`, or a
    `layers_block_type` property) and every other per-layer list (MLP types, NoPE layers, ...) hold one value each,
    and it has no per-layer overrides."""
    text = config.get_text_config(decoder=True)
    layers = next((config_value(text, _attribute_name(text, name)) for name in LAYER_COUNTS
                   if _is_size(config_value(text, _attribute_name(text, name)))), None)
    if layers is None or getattr(text, "is_heterogeneous", False):
        return False
    values = text.to_dict()
    index_lists = {name: value for name, value in values.items() if _is_index_list(name, value)}
    per_layer = [config_value(text, _attribute_name(text, name)) for name in LAYER_PATTERNS]
    per_layer += [value for name, value in values.items()
                  if isinstance(value, (list, tuple)) and len(value) == layers and name not in index_lists]
    if any(isinstance(value, (list, tuple)) and len({repr(v) for v in value}) > 1 for value in per_layer):
        return False
    picked = [{i for i in value if i < layers} for value in index_lists.values()]
    return not any(0 < len(layer_ids) < layers for layer_ids in picked)


def _is_index_list(name: str, value) -> bool:
    """Whether attribute `name` lists layer indices (Mllama's cross_attention_layers, Llama 4's moe_layers, LFM2's
    full_attn_idxs): named so, and increasing whole numbers (SmolLM3's no_rope_layers is a 0/1 flag per layer)."""
    return (name.endswith(LAYER_INDEX_SUFFIXES) and isinstance(value, (list, tuple)) and bool(value)
            and all(_is_size(v) and v >= 0 for v in value) and list(value) == sorted(set(value)))


def _small_sizes(default: PretrainedConfig, layers: int = TINY_LAYERS) -> dict:
    """Constructor values that shrink `default`'s size attributes (`SMALL_SIZES` and the rules above it) to `layers`
    layers. A size the family derives from others (its field defaults to None or "auto") is left to be derived from
    the tiny ones."""
    fields, derived = _field_names(type(default)), _derived_fields(type(default))
    sizes = {}
    for canonical, small in SMALL_SIZES.items():
        name = _attribute_name(default, canonical)
        if fields and name not in fields:
            continue
        value = config_value(default, name)
        if canonical in SET_WHEN_NONE and (value is None or name in derived):
            sizes[name] = small
        elif not _is_size(value) or name in derived:
            continue
        elif canonical in POSITIONS:
            sizes[name] = max(small, min(value, MAX_POSITIONS))
        elif canonical in LAYER_COUNTS:
            sizes[name] = min(value, layers)
        else:
            sizes[name] = min(value, small)
    if config_value(default, _attribute_name(default, "kv_lora_rank")):
        for size, follows in MLA_TIED_SIZES:
            size_name, follows_name = _attribute_name(default, size), _attribute_name(default, follows)
            if size_name in sizes and follows_name in sizes and \
                    config_value(default, size_name) == config_value(default, follows_name):
                sizes[size_name] = sizes[follows_name]
    if "is_decoder" in fields:  # BERT-style families run as a causal LM only as decoders (Reformer refuses else)
        sizes["is_decoder"] = True
    return sizes


def _shrunk(default: PretrainedConfig, overrides: dict, layers: int = TINY_LAYERS) -> PretrainedConfig:
    """`default`'s class rebuilt with its size attributes, nested configs, per-layer overrides and layer pattern made
    tiny (`layers` layers), then `overrides` (constructor values; a nested config's under its key) applied."""
    config_class = type(default)
    kwargs = _small_sizes(default, layers)
    for key in getattr(config_class, "sub_configs", {}):
        sub = config_value(default, key)
        if isinstance(sub, PretrainedConfig):
            kwargs[key] = _shrunk(sub, overrides.get(key, {}), layers)
    kwargs.update({key: value for key, value in overrides.items() if not isinstance(kwargs.get(key), PretrainedConfig)})
    pattern_name = _attribute_name(default, "layer_types")
    try:
        config = config_class(**kwargs)
    except Exception:  # a pattern derived for the family's depth (Zamba2: 54 entries) does not fit: give it
        if pattern_name in kwargs or not isinstance(config_value(default, pattern_name), (list, tuple)):
            raise
        kwargs[pattern_name] = _tiny_pattern(list(config_value(default, pattern_name)))
        config = config_class(**kwargs)
    filled = {key: config_value(config, key) for key in getattr(config_class, "sub_configs", {})
              if not isinstance(kwargs.get(key), PretrainedConfig)}
    filled = {key: sub for key, sub in filled.items() if isinstance(sub, PretrainedConfig)}
    if filled:  # nested configs the family's default leaves None and its constructor fills in, full size
        kwargs.update({key: _shrunk(sub, overrides.get(key, {}), layers) for key, sub in filled.items()})
        config = config_class(**kwargs)
    if pattern_name not in overrides:
        kept = _layer_mix_kept(config, default, pattern_name)
        if kept is not None:
            kwargs[pattern_name] = kept
            config = config_class(**kwargs)
    per_layer = _per_layer_shrunk(config, default)
    if per_layer is not None:
        config = config_class(**kwargs, per_layer_config=per_layer)
    return config


def _tiny_pattern(family: list[str], tiny: list[str] | None = None) -> list[str]:
    """`TINY_LAYERS` layer types holding every type of `family`: the first ones of `tiny` (default: of `family`),
    with the types they miss put last, in order of first appearance."""
    tiny = list(family[:TINY_LAYERS] if tiny is None else tiny)
    missing = [kind for kind in dict.fromkeys(family) if kind not in tiny]
    if len(missing) >= len(tiny):
        raise ValueError(f"{len(set(family))} layer types do not fit {len(tiny)} layers")
    return tiny[: len(tiny) - len(missing)] + missing if missing else tiny


def _layer_mix_kept(config: PretrainedConfig, default: PretrainedConfig, pattern_name: str) -> list[str] | None:
    """The layer pattern that makes `config` hold every layer type `default` holds, or None if it does already (a
    pattern derived for fewer layers can lose the rarer type: Gemma 3's one full-attention layer in six)."""
    family, tiny = config_value(default, pattern_name), config_value(config, pattern_name)
    if not isinstance(family, (list, tuple)) or not isinstance(tiny, (list, tuple)):
        return None
    repaired = _tiny_pattern(list(family), list(tiny))
    return None if repaired == list(tiny) else repaired


def _per_layer_shrunk(config: PretrainedConfig, default: PretrainedConfig) -> dict | None:
    """A heterogeneous config's per-layer overrides (`per_layer_config`, e.g. Gemma 4's wider full-attention heads)
    scaled like the global values they override, or None where it has none: an override that was k times the
    family's global value becomes k times the tiny global value."""
    serialized = config.to_dict().get("per_layer_config")
    if not serialized:
        return None
    scaled = {}
    for layer, layer_overrides in serialized.items():
        scaled[int(layer)] = {}
        for name, value in layer_overrides.items():
            family_value, tiny_value = config_value(default, name), config_value(config, name)
            if _is_size(value) and _is_size(family_value) and _is_size(tiny_value) and family_value > 0:
                value = max(1, round(value * tiny_value / family_value))
            scaled[int(layer)][name] = value
    return scaled


def _set_token_ids(config: PretrainedConfig) -> None:
    for part in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        for name, value in TOKEN_IDS.items():
            if name == "pad_token_id" or hasattr(part, name):
                setattr(part, name, value)


def tiny_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The causal LM of `config` with random weights from `seed`, float32, on the CPU, in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if model.generation_config is not None:
        model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def padded_batch(config: PretrainedConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both `[2, PROMPT_TOKENS]` int64: random tokens (never a special id), the
    second row left-padded with `PAD_TOKENS` pad tokens."""
    vocab = config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(EOS_TOKEN_ID + 1, vocab, (2, PROMPT_TOKENS), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :PAD_TOKENS] = PAD_TOKEN_ID
    mask[1, :PAD_TOKENS] = 0
    return ids, mask


def greedy(model: torch.nn.Module, cache, ids: torch.Tensor, mask: torch.Tensor,
           new_tokens: int = NEW_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy `generate` through `cache` (passed under this release's argument name): `(new_ids, logits)`,
    `[batch, new_tokens]` int64 and `[new_tokens, batch, vocab]` float32, the logits before any processor."""
    from oscar_hf.compat import cache_argument_name

    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True, output_logits=True,
                             pad_token_id=PAD_TOKEN_ID, **{cache_argument_name(model): cache})
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits).float()
