"""`OscarCache`: the transformers `Cache` users pass to `generate`.

```python
cache = OscarCache(model, rotations="hadamard")      # or a folder / Hub repo id / Rotations / "identity"
out = model.generate(ids, past_key_values=cache, max_new_tokens=256)
```
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import weakref

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer
from transformers.utils import logging

from oscar_hf.attention import OSCAR_ATTENTION, register, switch_to_oscar_attention
from oscar_hf.config import (
    CONFIG_NAME,
    FORMAT_FIELDS,
    RANKED_DEFAULT_METHOD,
    RANKED_HEAD_SHARES,
    RANKED_LAYER_SHARES,
    OscarConfig,
    checked_bool,
    checked_int,
)
from oscar_hf.handoff import UpdateRequest, publish_segment
from oscar_hf.kernels.interface import Backend
from oscar_hf.layer import OscarLayer
from oscar_hf.model_support import OSCAR_LAYER, UnsupportedModelError, attention_shape, text_config_of
from oscar_hf.parallel import local_head_config, local_heads, tensor_parallel_position
from oscar_hf.rotations import Rotations
from oscar_hf.rotations.folding import fold_value_rotations, folded_value_rotation
from oscar_hf.rotations.hub import resolve_rotation_folder
from oscar_hf.rotations.io import SAFETENSORS_NAME

logger = logging.get_logger(__name__)

NAMED_ROTATIONS = ("hadamard", "identity")


class OscarCache(Cache):
    """KV cache with a BF16 sink, a rotated, quantized history and a BF16 recent window per layer.

    Args:
        model: a transformers causal LM (its attention is switched to "oscar"), or its config (then set
            `attn_implementation="oscar"` yourself; any other attention still gets correct, dequantized K/V).
        rotations: "hadamard" (data-free), "identity" (none), a `Rotations`, a local folder/file, or a Hub repo id.
        method: preset (`oscar`, `oscar-mixed`, `oscar-hifi`, `oscar-next`, `hadamard`, `quarot`, `clip`,
            `identity`, `none`; `config.PRESETS`); inferred from `rotations` when omitted: nothing means `hadamard`;
            a file or repo means `oscar-mixed` (2-bit sigma rows with one-byte scale and zero, the top tenth of
            the layers at 4 bits: 2.475 bits per element at head_dim 64) when it records a layer ranking
            (`oscar_hf.calibrate.retrieval_layers`) and no `options` choose a row format, else `oscar` (uniform
            2-bit rows, 2.5 bits).
        config: a full `OscarConfig` instead of `method` and `**options`.
        fold_value_rotation: fold the value rotations into the model's v_proj/o_proj weights (in place, once), so V
            is produced already rotated and the attention output needs no un-rotation (`rotations/folding.py`):
            the merge then skips its R_Vᵀ product, which dominates small decode calls. The folded model computes
            the same function with any cache, up to rounding the rotated weights.
        max_cache_len: tokens the cache will hold at most (prompt and generated), as for `StaticCache`: decode
            steps run with fixed buffers (`counted_decode`), and a history sized for this many tokens lets every
            step of a compiled `generate` replay one graph. Default: room for `counted_decode.DECODE_RESERVE`
            more history tokens than the prompt left (eager steps grow it; compiled steps cannot). At most
            `config.MAX_TOKENS`.
        backend: the kernel backend of every layer (`kernels.interface.Backend`, e.g.
            `oscar_hf.kernels.reference.backend.ReferenceBackend()`); default: `kernels.select.backend_for` of each
            layer's device, on first use.
        recorded_clip_ratios: whether clip ratios recorded in the rotations replace the config's (see below);
            default: unless `key_clip_ratio`/`value_clip_ratio` or a full `config` are given.
        subfolder, revision, token, local_files_only: passed to the Hub when `rotations` is a repo id.
        **options: `OscarConfig` fields overriding the preset (e.g. `recent_tokens=128`, `bits=4`).

    Clip ratios recorded in the rotations (by `oscar-calibrate --clip-search`) replace the preset's, per layer,
    unless `recorded_clip_ratios` is False, or the cache's `bits` differ from the code width they were chosen for
    (`Rotations.clip_ratios`).

    `save_pretrained(folder)` writes the setup (config, rotations, the options above that change what is stored)
    and `OscarCache.from_pretrained(model, folder)` rebuilds it.
    """

    def __init__(
        self,
        model,
        rotations: str | os.PathLike | Rotations | None = None,
        method: str | None = None,
        *,
        config: OscarConfig | None = None,
        fold_value_rotation: bool = False,
        max_cache_len: int | None = None,
        backend: Backend | None = None,
        recorded_clip_ratios: bool | None = None,
        subfolder: str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        **options,
    ):
        register()
        checked_bool("fold_value_rotation", fold_value_rotation)
        if max_cache_len is not None:
            max_cache_len = checked_int("max_cache_len", max_cache_len, 1)
        if recorded_clip_ratios is not None:
            checked_bool("recorded_clip_ratios", recorded_clip_ratios)
        model_config = getattr(model, "config", model)
        shape = attention_shape(model_config)
        if recorded_clip_ratios is None:
            recorded_clip_ratios = not (config is not None or "key_clip_ratio" in options
                                        or "value_clip_ratio" in options)
        inferred = config is None and method is None
        if config is None:
            config = OscarConfig.from_method(method or _infer_method(rotations), **options)
        elif method is not None or options:
            raise TypeError("pass either config=OscarConfig(...) or method/options, not both")
        source = rotations if rotations is not None else config.default_rotation
        resolved = _resolve_rotations(
            source, shape,
            dict(subfolder=subfolder, revision=revision, token=token, local_files_only=local_files_only),
        )
        if inferred and config.method == "oscar" and _takes_ranked_default(resolved, options):
            config = OscarConfig.from_method(RANKED_DEFAULT_METHOD, **options)
            logger.info("OscarCache: method=%r, the 2-bit default of rotations that rank their layers by retrieval "
                        "(method='oscar' stores uniform 2-bit rows)", RANKED_DEFAULT_METHOD)
        for bits in config.code_widths:
            if config.quantize and shape.head_dim % (8 // bits):
                raise UnsupportedModelError(f"head_dim={shape.head_dim} is not a multiple of {8 // bits}, the codes "
                                            f"packed per byte at {bits} bits")
        if config.method in RANKED_LAYER_SHARES and not config.high_precision_layers:
            config = dataclasses.replace(config, high_precision_layers=_ranked_layers(config.method, resolved, shape))
        if config.method in RANKED_HEAD_SHARES and not (config.high_precision_heads or config.high_precision_layers):
            config = dataclasses.replace(config, high_precision_heads=_ranked_heads(config.method, resolved, shape))
        folded = _folded_layers(model, model_config, resolved, shape, fold_value_rotation)
        self._model_ref = None if model is model_config else weakref.ref(model)
        unknown = sorted(set(config.high_precision_layers) - set(shape.oscar_layer_ids))
        if unknown:
            raise ValueError(f"high_precision_layers {unknown} are not full-attention layers of this model; those "
                             f"are {shape.oscar_layer_ids}")
        _check_heads(config.high_precision_heads, shape)
        tp_rank, tp_size = tensor_parallel_position(model)
        layers = []
        for i, kind in enumerate(shape.layer_kinds):
            if kind == OSCAR_LAYER:
                key_r, value_r = resolved.for_layer(i) if resolved is not None else (None, None)
                query_r = None  # the key rotation, unless the keys are smoothed (`Rotations.key_transforms`)
                if resolved is not None and i in resolved.key_smoothing:
                    key_r, query_r = resolved.key_transforms(i)
                key_r, value_r, query_r = (local_heads(r, tp_rank, tp_size) for r in (key_r, value_r, query_r))
                layer_config = local_head_config(config.for_layer(i), tp_rank, tp_size, shape.num_kv_heads)
                if recorded_clip_ratios and i not in config.high_precision_layers:
                    layer_config = _recorded_clip_config(layer_config, resolved, i)
                layers.append(OscarLayer(i, layer_config, key_r, None if i in folded else value_r, backend,
                                         max_cache_len=max_cache_len, query_rotation=query_r))
            else:
                layers.append(DynamicSlidingWindowLayer(sliding_window=shape.sliding_window))
        super().__init__(layers=layers)
        self.oscar_config = config
        self.rotations = resolved
        self.shape = shape
        # what `save_pretrained` records besides the config: a named rotation needs no file
        self._rotations_name = ("identity" if resolved is None else
                                "hadamard" if isinstance(source, str) and source == "hadamard" else None)
        self._recorded_clip_ratios = recorded_clip_ratios
        self._folds_value_rotation = bool(folded)
        self._max_cache_len = max_cache_len
        self._model_config = text_config_of(model_config)
        self._warned_fallback = False
        if not shape.oscar_layer_ids:
            logger.warning("every layer of this model uses sliding-window attention: OscarCache keeps them all in BF16")
        if model is not model_config:
            use_oscar_attention(model)
            _live_caches(model).add(self)

    # ------------------------------------------------------------------------------------------ Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if not isinstance(layer, OscarLayer):
            return layer.update(key_states, value_states)
        if layer_idx == self.shape.oscar_layer_ids[0] and not torch.compiler.is_compiling():
            self._check_whole_forwards()
        if torch.compiler.is_compiling() and self.uses_oscar_attention and not layer.counts_step(key_states):
            # a compiled prefill: the attention runs this update with itself, as one opaque op (`handoff`)
            publish_segment(key_states, kwargs, UpdateRequest(layer_idx, layer.handle))
            return key_states, value_states
        if not self.uses_oscar_attention:
            return self._dense_update(layer, key_states, value_states)
        keys, values = layer.update(key_states, value_states)
        publish_segment(keys, kwargs, layer.open_segment())
        return keys, values

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if not self.uses_oscar_attention:
            self._leave_counted_decode()  # the mask must span every cached token, as `_dense_update` returns them
        return super().get_mask_sizes(query_length, layer_idx)

    def _dense_update(self, layer: OscarLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        """`layer.update` for an attention other than "oscar" (the model switched away from it): every cached
        token, history dequantized, in time order (`OscarLayer.dense_kv`), `[B, Hkv, length, d]`. Counted decode
        is left first: its buffers and mask width are fixed, while this attention's keys grow by a token a step."""
        layer.stop_counted_decode()
        layer.update(key_states, value_states)
        if not self._warned_fallback:
            logger.warning(
                "the model's attention is %r, not 'oscar': OscarCache returns dequantized K/V (correct, slow). "
                "Call oscar_hf.use_oscar_attention(model).", self._model_config._attn_implementation,
            )
            self._warned_fallback = True
        return layer.dense_kv()

    def _leave_counted_decode(self) -> None:
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                layer.stop_counted_decode()

    def _check_whole_forwards(self) -> None:
        """Refuse to go on after a forward that updated some layers and not the others (an exception inside one
        layer's attention, an out-of-memory error): their tokens would no longer line up."""
        layers = [layer for layer in self.layers if isinstance(layer, OscarLayer)]
        counts = {layer.layer_idx: layer.updates for layer in layers}
        if len(set(counts.values())) <= 1:
            return
        most = max(counts.values())
        ahead = [i for i, n in counts.items() if n == most]
        if all(layer.segment_open for layer in layers if layer.layer_idx in ahead):
            return  # updates outside a forward (no attention consumed them), layer by layer: the caller's order
        behind = [i for i, n in counts.items() if n != most]
        raise RuntimeError(
            f"a previous forward stopped part-way: layers {ahead} hold its tokens and layers {behind} do not, so "
            "this cache cannot continue. Recover with a copy taken before that forward (copy.deepcopy(cache)), or "
            "call cache.reset() and run the prompt again."
        )

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens of every layer, or of none: every layer is checked before any is changed."""
        problems = [p for layer in self.layers if isinstance(layer, OscarLayer)
                    if (p := layer.crop_problem(tokens_to_remove)) is not None]
        if problems:
            raise ValueError(problems[0] if len(problems) == 1 else "; ".join(problems))
        others = [(layer, dict(layer.__dict__)) for layer in self.layers if not isinstance(layer, OscarLayer)]
        try:
            for layer in self.layers:
                layer.crop(tokens_to_remove)
        except Exception:
            # transformers' own layers replace their tensors when cropping (never edit them in place), so their
            # attributes from before are the state from before; the OSCAR layers were checked and cannot fail
            for layer, state in others:
                layer.__dict__.clear()
                layer.__dict__.update(state)
            raise

    @property
    def is_compileable(self) -> bool:
        """Whether transformers' `generate` may compile the decode step: every layer must allow it. A layer not yet
        filled answers for the device of the model's weights (`OscarLayer.compileable_on`), since `generate`
        decides before the prefill. Never under another attention than "oscar": the dequantized K/V it is given
        grow by a token a step."""
        if not self.uses_oscar_attention:
            return False
        model = self._model_ref() if self._model_ref is not None else None
        device = getattr(model, "device", None)
        dim = self.shape.head_dim
        return all(layer.compileable_on(device, dim, dim)
                   if isinstance(layer, OscarLayer) and not layer.is_initialized and device is not None
                   else layer.is_compileable for layer in self.layers)

    @property
    def uses_oscar_attention(self) -> bool:
        return getattr(self._model_config, "_attn_implementation", None) == OSCAR_ATTENTION

    def __deepcopy__(self, memo):
        # Share the immutable model config, master rotations and kernel backends; copy every tier.
        memo[id(self._model_config)] = self._model_config
        if self.rotations is not None:
            memo[id(self.rotations)] = self.rotations
        for layer in self.layers:
            backend = getattr(layer, "backend", None)
            if backend is not None:
                memo[id(backend)] = backend
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            _live_caches(model).add(clone)
        return clone

    # ------------------------------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the setup to `save_directory`: `oscar_config.json` (the `OscarConfig`, the rotations' name or
        file, the constructor options that change what is stored, the model's attention shape) and, for calibrated
        or other non-named rotations, `oscar_rotations.safetensors` with a model card (`Rotations.save_pretrained`).
        The stored tokens are not saved (a warning says so when there are some); neither is `backend`."""
        tokens = int(self.get_seq_length())
        if tokens:
            # a user saving a filled cache may expect its tokens back: a rebuilt cache starts empty
            logger.warning("OscarCache.save_pretrained saves the setup only, not the %d cached tokens: "
                           "OscarCache.from_pretrained gives an empty cache, to be filled by running the prompt again",
                           tokens)
        os.makedirs(save_directory, exist_ok=True)
        if self._rotations_name is None:
            self.rotations.save_pretrained(save_directory)
        setup = {
            "oscar_config": self.oscar_config.to_dict(),
            "rotations": self._rotations_name or SAFETENSORS_NAME,
            "recorded_clip_ratios": self._recorded_clip_ratios,
            "fold_value_rotation": self._folds_value_rotation,
            "max_cache_len": self._max_cache_len,
            "attention_shape": _shape_record(self.shape),
        }
        with open(os.path.join(save_directory, CONFIG_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(setup, indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls,
        model,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        backend: Backend | None = None,
        subfolder: str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
    ) -> "OscarCache":
        """The cache `save_pretrained` wrote, for `model` (its attention switched, its value rotations folded if
        the saved cache folded them), from a local folder or a Hub repo (JSON and safetensors only). Raises
        ValueError when `model`'s attention shape differs from the one the setup was saved for."""
        folder = resolve_rotation_folder(
            pretrained_model_name_or_path, subfolder, revision=revision,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir), token=token,
            local_files_only=local_files_only, force_download=force_download, what="OSCAR setup",
        )
        path = os.path.join(folder, CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: {os.fspath(pretrained_model_name_or_path)!r} holds no "
                                    f"OSCAR setup (OscarCache.save_pretrained writes {CONFIG_NAME})")
        with open(path, encoding="utf-8") as f:
            setup = _checked_setup(path, json.load(f))
        saved_shape, shape = setup["attention_shape"], _shape_record(attention_shape(getattr(model, "config", model)))
        if saved_shape != shape:
            raise ValueError(f"{path} was saved for a model with attention shape {saved_shape}, and this model's is "
                             f"{shape}: the setup belongs to another model")
        name = setup["rotations"]
        if name not in (*NAMED_ROTATIONS, SAFETENSORS_NAME):
            raise ValueError(f"{path}: rotations={name!r}; expected one of {[*NAMED_ROTATIONS, SAFETENSORS_NAME]}")
        rotations = name if name in NAMED_ROTATIONS else Rotations.from_pretrained(os.path.join(folder, name))
        try:
            config = OscarConfig.from_dict(setup["oscar_config"])
        except ValueError as error:
            raise ValueError(f"{path}: oscar_config: {error}") from None
        return cls(model, rotations, config=config,
                   recorded_clip_ratios=setup["recorded_clip_ratios"],
                   fold_value_rotation=setup["fold_value_rotation"], max_cache_len=setup["max_cache_len"],
                   backend=backend)

    # ------------------------------------------------------------------------------------------ memory
    def nbytes(self) -> int:
        """Bytes of the stored tokens over all layers (BF16 tiers, quantized history, sliding layers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                total += layer.nbytes()
            elif layer.is_initialized and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element of the quantized (full-attention) layers, BF16 tiers included."""
        layers = [layer for layer in self.layers if isinstance(layer, OscarLayer)]
        elements = sum(layer.num_elements() for layer in layers)
        return 8.0 * sum(layer.nbytes() for layer in layers) / elements if elements else 0.0

    def __repr__(self) -> str:
        return (f"OscarCache(method={self.oscar_config.method}, layers={len(self.layers)}, "
                f"tokens={self.get_seq_length()}, rotations={self.rotations!r})")


def use_oscar_attention(model) -> None:
    """Switch `model` to the "oscar" attention implementation (registering it first), for good."""
    previous = switch_to_oscar_attention(model)
    if previous != OSCAR_ATTENTION:
        logger.info("OscarCache: switched %s's attention implementation from %r to %r (the cache's history is read "
                    "by it)", type(model).__name__, previous, OSCAR_ATTENTION)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(generation_config, "cache_implementation", None):
        logger.info("clearing generation_config.cache_implementation=%r so OscarCache can be passed",
                    generation_config.cache_implementation)
        generation_config.cache_implementation = None


def _shape_record(shape) -> dict:
    """The parts of an `AttentionShape` a saved setup must match, as JSON types."""
    return {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "full_attention_layers": shape.oscar_layer_ids}


SETUP_KEYS = ("oscar_config", "rotations", "recorded_clip_ratios", "fold_value_rotation", "max_cache_len",
              "attention_shape")


def _checked_setup(path: str, setup) -> dict:
    """The setup `save_pretrained` wrote to `path` (its keys, each of the type written), or ValueError: a value
    of another type would be read as something else (the string "false" is true, and folds the model's weights)."""
    if not isinstance(setup, dict) or set(setup) != set(SETUP_KEYS):
        found = sorted(setup) if isinstance(setup, dict) else type(setup).__name__
        raise ValueError(f"{path} holds {found}; an OSCAR setup has the keys {sorted(SETUP_KEYS)}")
    try:
        for name, kind in (("oscar_config", dict), ("rotations", str), ("attention_shape", dict)):
            if not isinstance(setup[name], kind):
                raise ValueError(f"{name}={setup[name]!r}: expected a {kind.__name__} (JSON "
                                 f"{'object' if kind is dict else 'string'}), got {type(setup[name]).__name__}")
        checked_bool("recorded_clip_ratios", setup["recorded_clip_ratios"])
        checked_bool("fold_value_rotation", setup["fold_value_rotation"])
        if setup["max_cache_len"] is not None:
            checked_int("max_cache_len", setup["max_cache_len"], 1)
    except ValueError as error:
        raise ValueError(f"{path}: {error}; edit the file, or save the setup again with "
                         "OscarCache.save_pretrained") from None
    return setup


def _live_caches(model) -> weakref.WeakSet:
    """The OscarCaches built on `model` that are still alive (folding checks them)."""
    caches = model.__dict__.get("_oscar_live_caches")
    if caches is None:
        caches = model.__dict__["_oscar_live_caches"] = weakref.WeakSet()
    return caches


def _folded_layers(model, model_config, rotations, shape, fold: bool) -> set[int]:
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
        holding = [cache for cache in _live_caches(model) if int(cache.get_seq_length())]
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


def _recorded_clip_config(config: OscarConfig, rotations: Rotations | None, layer_idx: int) -> OscarConfig:
    """`config` with the clip ratios the rotations record for this layer and code width, if any."""
    recorded = rotations.clip_ratios(layer_idx, config.bits) if rotations is not None else None
    if recorded is None:
        return config
    return dataclasses.replace(config, key_clip_ratio=recorded[0], value_clip_ratio=recorded[1])


def _ranked_layers(method: str, rotations: Rotations | None, shape) -> tuple[int, ...]:
    """The `RANKED_LAYER_SHARES[method]` most retrieval-sensitive full-attention layers the rotations record."""
    ranking = rotations.retrieval_layers() if rotations is not None else None
    return _top_share(method, ranking, RANKED_LAYER_SHARES[method], len(shape.oscar_layer_ids), "layers",
                      "rank_retrieval_layers", "high_precision_layers=[...]")


def _ranked_heads(method: str, rotations: Rotations | None, shape) -> tuple[tuple[int, int], ...]:
    """The `RANKED_HEAD_SHARES[method]` most retrieval-sensitive (layer, KV head) pairs the rotations record."""
    ranking = rotations.retrieval_heads() if rotations is not None else None
    return _top_share(method, ranking, RANKED_HEAD_SHARES[method], len(shape.oscar_layer_ids) * shape.num_kv_heads,
                      "KV heads", "rank_retrieval_heads", "high_precision_heads=[(layer, kv_head), ...]")


def _top_share(method: str, ranking: list | None, share: float, units: int, what: str, ranker: str,
               option: str) -> tuple:
    """The first `share` of `units` entries of a recorded ranking (at least one); ValueError without a ranking."""
    if not ranking:
        raise ValueError(
            f"method={method!r} keeps the {what} retrieval depends on at 4 bits, and these rotations record no "
            f"ranking of those {what}: rank them with `oscar-calibrate ... --rank-retrieval-layers` or `python -m "
            f"oscar_hf.calibrate.retrieval_layers --model <model> --rotations <folder>` (or "
            f"oscar_hf.calibrate.retrieval_layers.{ranker}), or pass {option}"
        )
    return tuple(ranking[:max(1, math.ceil(share * units))])


def _check_heads(heads, shape) -> None:
    """ValueError unless every (layer, KV head) pair names a KV head of a full-attention layer."""
    wrong = [pair for pair in heads if pair[0] not in shape.oscar_layer_ids or pair[1] >= shape.num_kv_heads]
    if wrong:
        raise ValueError(f"high_precision_heads {wrong} are not KV heads of this model's full-attention layers (layers "
                         f"{shape.oscar_layer_ids}, KV heads 0-{shape.num_kv_heads - 1})")


def _takes_ranked_default(rotations: Rotations | None, options: dict) -> bool:
    """Whether a cache whose method was inferred as `oscar` stores `RANKED_DEFAULT_METHOD` instead: its rotations
    record a layer ranking, and no option chooses a row format."""
    return (rotations is not None and bool(rotations.retrieval_layers())
            and not any(name in options for name in FORMAT_FIELDS))


def _infer_method(rotations) -> str:
    if rotations is None or (isinstance(rotations, str) and rotations == "hadamard"):
        return "hadamard"
    if isinstance(rotations, str) and rotations == "identity":
        return "identity"
    return "oscar"


def _resolve_rotations(source, shape, hub_options: dict) -> Rotations | None:
    """A checked `Rotations` for the model's full-attention layers, or None for the identity."""
    layer_ids = shape.oscar_layer_ids
    if not layer_ids or (isinstance(source, str) and source == "identity"):
        return None
    if isinstance(source, str) and source == "hadamard":
        return Rotations.hadamard(layer_ids, shape.head_dim)
    if isinstance(source, str) and source == "file":
        raise ValueError(
            "method='oscar' needs calibrated rotations: pass rotations=<folder, file or Hub repo id> "
            "(make them with `oscar-calibrate`), or use method='hadamard' for data-free rotations"
        )
    if not isinstance(source, Rotations):
        source = Rotations.from_pretrained(source, **hub_options)
    source.check_model(layer_ids, shape.head_dim, shape.num_kv_heads)
    return source
