"""`OscarCache`: the transformers `Cache` users pass to `generate`.

```python
cache = OscarCache(model, rotations="hadamard")      # or a folder / Hub repo id / Rotations / "identity"
out = model.generate(ids, past_key_values=cache, max_new_tokens=256)
```
"""

from __future__ import annotations

import copy
import functools
import json
import os
import weakref

import torch
import transformers
from transformers.cache_utils import Cache
from transformers.utils import logging

from oscar_hf.attention import OSCAR_ATTENTION, register, switch_to_oscar_attention, takes_oscar_attention
from oscar_hf.compile_policy import (
    StepClock,
    await_compile,
    compiled_marker,
    expected_compile_seconds,
    ledger_of,
    note_traced_step,
)
from oscar_hf.config import OscarConfig, checked_bool, checked_int, read_json_file
from oscar_hf.handoff import UpdateRequest, forget_reader_segments, publish_segment
from oscar_hf.kernels.interface import Backend
from oscar_hf.hybrid_layer import oscar_layer_for
from oscar_hf.layer import OscarLayer
from oscar_hf.model_support import attention_shape, own_attention_reason, text_config_of, transformers_cache_layers
from oscar_hf.plan import NAMED_ROTATIONS, live_caches, plan_cache
from oscar_hf.rotations import Rotations
from oscar_hf.rotations.hub import resolve_rotation_folder
from oscar_hf.rotations.io import CONFIG_NAME, SAFETENSORS_NAME

logger = logging.get_logger(__name__)


class OscarCache(Cache):
    """KV cache with a BF16 sink, a rotated, quantized history and a BF16 recent window per layer.

    Args:
        model: a transformers causal LM (its attention is switched to "oscar"), or its config (then set
            `attn_implementation="oscar"` yourself; any other attention still gets correct, dequantized K/V).
        rotations: "hadamard" (data-free), "identity" (none), a `Rotations`, a local folder/file, or a Hub repo id.
        method: preset (`oscar`, `oscar-mixed`, `oscar-hifi`, `oscar-next`, `hadamard`, `quarot`, `clip`,
            `identity`, `none`; `config.PRESETS`); inferred when omitted, unless `options` choose a row format:
            on a file or repo that ranks retrieval, `oscar-next` (2-bit sigma rows with one-byte scale and zero,
            the top tenth of the KV heads at 4 bits: 2.475 bits per element at head_dim 64; `oscar-mixed`, the
            same share of layers, where only layers are ranked), else `oscar` (uniform 2-bit rows, 2.5 bits);
            with no rotations or "hadamard" and the model itself, `oscar-next` on its data-free profile
            (`oscar_hf.profile`: Hadamard rotations and an induction ranking from one forward over random
            tokens); given only a config, `hadamard` (uniform 2-bit rows). A ranked preset given no
            rotations, or "hadamard", runs on that profile too.
        config: a full `OscarConfig` instead of `method` and `**options`.
        fold_value_rotation: fold the value rotations into the model's v_proj/o_proj weights (in place, once), so V
            is produced already rotated and the attention output needs no un-rotation (`rotations/folding.py`):
            the merge then skips its R_Vᵀ product, which dominates small decode calls. The folded model computes
            the same function with any cache, up to rounding the rotated weights.
        max_cache_len: tokens the cache will hold at most (prompt and generated), as for `StaticCache`: decode
            steps run with fixed buffers (`counted_decode`), and a history sized for this many tokens lets every
            step of a compiled `generate` replay one graph. Default: room for `history.DECODE_RESERVE`
            more history tokens than the prompt left (eager steps grow it; compiled steps cannot). At most
            `config.MAX_TOKENS`.
        compile_decode: whether transformers' `generate` may compile the decode step (on a GPU, or where its
            `compile_config` allows): None (default) once this model's eager decode steps in this process have
            taken as long as a compile is expected to (`compile_policy`: a one-off call answers without waiting
            for a compile; a long session compiles once); True from the first call; False never.
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

    def __init__(self, model, rotations: str | os.PathLike | Rotations | None = None, method: str | None = None, *,
                 config: OscarConfig | None = None, fold_value_rotation: bool = False,
                 max_cache_len: int | None = None, compile_decode: bool | None = None,
                 backend: Backend | None = None,
                 recorded_clip_ratios: bool | None = None, subfolder: str | None = None, revision: str | None = None,
                 token: str | bool | None = None, local_files_only: bool = False, **options):
        register()
        checked_bool("fold_value_rotation", fold_value_rotation)
        if max_cache_len is not None:
            max_cache_len = checked_int("max_cache_len", max_cache_len, 1)
        if recorded_clip_ratios is not None:
            checked_bool("recorded_clip_ratios", recorded_clip_ratios)
        hub_options = dict(subfolder=subfolder, revision=revision, token=token, local_files_only=local_files_only)
        own_attention = _own_attention(model)
        plan = plan_cache(model, rotations, method, config, options, fold_value_rotation=fold_value_rotation,
                          recorded_clip_ratios=recorded_clip_ratios, hub_options=hub_options,
                          own_attention=own_attention)
        # transformers' own plan, its full-attention K/V replaced (`model_support`)
        layers = transformers_cache_layers(text_config_of(getattr(model, "config", model)))
        for i, layer in enumerate(plan.layers):
            if layer is not None:
                layers[i] = oscar_layer_for(layers[i], i, layer, backend, max_cache_len)
        super().__init__(layers=layers)
        self._plan = plan  # also what `save_pretrained` records
        # the layers the plan quantizes, in order and as a set (read on every update); every other layer is
        # transformers' own and is asked only the Cache API
        self._quantized_ids = tuple(plan.shape.oscar_layer_ids)
        self._quantized = frozenset(self._quantized_ids)
        self._shares_kv = bool(plan.shape.kv_sources)  # layers read others' tiers (`handoff._FOR_READERS`)
        self._max_cache_len = max_cache_len
        model_config = getattr(model, "config", model)
        self._model_ref = None if model is model_config else weakref.ref(model)
        self._model_config = text_config_of(model_config)
        self._warned_fallback = False
        # whether a forward's mask was sized since the last update, and whether the updates since the last check
        # belonged to such a forward (`_check_attended`)
        self._mask_sized = self._forward_updates = False
        self._foreign_attention = False  # a forward's attention was not "oscar": dequantized K/V from then on
        self.compile_decode = compile_decode
        self._step_clock = StepClock(ledger_of(self if model is model_config else model))
        if model is not model_config and plan.shape.oscar_layer_ids:  # else the model's own attention serves
            if own_attention is None:
                use_oscar_attention(model)
            else:
                logger.warning_once(
                    "OscarCache: %s keeps its own attention (%s): the cache stores its K/V at %s bits and hands that "
                    "attention the whole K/V dequantized every step (correct, without the tiered attention's speed)",
                    type(model).__name__, own_attention, plan.config.bits)
            live_caches(model).add(self)

    @property
    def oscar_config(self) -> OscarConfig:
        """The cache's resolved settings (its high-precision layers or heads filled in from the ranking)."""
        return self._plan.config

    @property
    def rotations(self) -> Rotations | None:
        """The rotations of the full-attention layers; None for the identity."""
        return self._plan.rotations

    @property
    def shape(self):
        """The model's attention shape (`model_support.AttentionShape`)."""
        return self._plan.shape

    # ------------------------------------------------------------------------------------------ Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer_idx not in self._quantized:
            return layer.update(key_states, value_states, *args, **kwargs)
        first = layer_idx == self._quantized_ids[0]
        if first and self._shares_kv:
            forget_reader_segments()
        if torch.compiler.is_compiling():
            note_traced_step()  # the compile `is_compileable` allowed is happening: its marker is left
        elif first:
            self._check_whole_forwards()
            self._check_attended()
            self._step_clock.tick(key_states.shape[-2])
        if torch.compiler.is_compiling() and self.uses_oscar_attention and not layer.counts_step(key_states):
            if layer.readers:  # their attention would find the request, not tiers to read
                raise NotImplementedError(
                    f"layer {layer_idx}'s K/V are read by layers {list(layer.readers)} (KV sharing): a compiled "
                    "prefill cannot hand them its tiers; run the prefill eagerly (compile the decode step only)")
            # a compiled prefill: the attention runs this update with itself, as one opaque op (`handoff`)
            publish_segment(key_states, kwargs, UpdateRequest(layer_idx, layer.handle))
            return key_states, value_states
        if not self.uses_oscar_attention:
            return self._dense_update(layer, key_states, value_states)
        keys, values = layer.update(key_states, value_states)
        publish_segment(keys, kwargs, layer.open_segment())
        return keys, values

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if not torch.compiler.is_compiling():
            self._mask_sized = True  # a forward is starting (transformers sizes its masks before any update)
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

    @property
    def quantized_layers(self) -> list[OscarLayer]:
        """The layers the plan quantizes (`model_support.QUANTIZED`), in order."""
        return [self.layers[i] for i in self._quantized_ids]

    def _leave_counted_decode(self) -> None:
        for layer in self.quantized_layers:
            layer.stop_counted_decode()

    def _check_attended(self) -> None:
        """Before a forward's first update: did the last forward, the first this cache saw, attend through
        "oscar"? If the cache was passed to another model than the one it was built with (one still on SDPA, say),
        every layer's segment is still open, and that attention took the BF16 tiers for every cached token: right,
        since no token had reached the history, so the cache returns dequantized K/V from then on, as to any other
        attention. Checked only while no layer holds history or decodes counted: an `update` outside a forward
        after a forward that an exception stopped looks the same, and is right in the same way."""
        forward, self._forward_updates, self._mask_sized = self._forward_updates, self._mask_sized, False
        if not forward or self._foreign_attention or not self.uses_oscar_attention:
            return
        layers = self.quantized_layers
        if not all(layer.segment_open and layer.counted is None and not layer.history_length for layer in layers):
            return
        self._foreign_attention = True
        self._warned_fallback = True  # `_dense_update`'s warning would name the wrong model's attention
        logger.warning("OscarCache: the model running this cache does not attend with 'oscar' (it was built for "
                       "another model, or the model's attention was switched back): it returns dequantized K/V "
                       "from now on (correct, slow); build the cache with the model that runs it")

    def _check_whole_forwards(self) -> None:
        """Refuse to go on after a forward that updated some layers and not the others (an exception inside one
        layer's attention, an out-of-memory error): their tokens would no longer line up."""
        layers = self.quantized_layers
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
        """Drop the newest tokens of every layer, or of none where the refusal comes first: the OSCAR layers are
        checked before any layer changes (they cannot fail after), and transformers' own layers crop first, so the
        first of them to refuse (a sliding window already past its size, a recurrent state) leaves every layer as
        it was, as it does in DynamicCache."""
        problems = [p for layer in self.quantized_layers if (p := layer.crop_problem(tokens_to_remove)) is not None]
        if problems:
            raise ValueError(problems[0] if len(problems) == 1 else "; ".join(problems))
        kept = [layer for i, layer in enumerate(self.layers) if i not in self._quantized]
        for layer in kept + self.quantized_layers:
            layer.crop(tokens_to_remove)

    @property
    def is_compileable(self) -> bool:
        """Whether transformers' `generate` may compile the decode step: every layer must allow it, and so must
        `compile_decode` (by default `compile_policy`'s rule). A layer not yet filled answers for the device of the
        model's weights (`OscarLayer.compileable_on`), since `generate` decides before the prefill. Never under
        another attention than "oscar": the dequantized K/V it is given grow by a token a step."""
        if not self.can_compile:
            return False
        if torch.compiler.is_compiling():
            return True  # read while tracing a step already compiled: no guard on the policy's host state
        if self._compile_decode is False:
            return False
        ledger = self._step_clock.ledger
        if self._compile_decode or ledger.may_compile(self._expected_compile_seconds):
            await_compile(self._compiled_marker)  # its marker is left once a trace follows (`note_traced_step`)
            return True
        if not ledger.announced:
            ledger.announced = True
            logger.info("OscarCache: generate decodes this model eagerly until its eager steps have cost what a "
                        "compile would (%.0f s so far; oscar_hf.compile_policy); OscarCache(..., "
                        "compile_decode=True) compiles from the first call", ledger.eager_seconds)
        return False

    # computed once per cache, at generate's first question: `is_compileable` is read every step
    @functools.cached_property
    def _compiled_marker(self) -> str | None:
        """`compile_policy.compiled_marker` of this cache's decode step (the versions, the model's config, the
        cache's settings and the model's device type name it)."""
        model = self._model_ref() if self._model_ref is not None else None
        device = getattr(getattr(model, "device", None), "type", None)
        return compiled_marker(torch.__version__, transformers.__version__, self._model_config.to_dict(),
                               self.oscar_config.to_dict(), device)

    @functools.cached_property
    def _expected_compile_seconds(self) -> float:
        return expected_compile_seconds(self._compiled_marker)

    @property
    def compile_decode(self) -> bool | None:
        """Whether `generate` may compile the decode step: None by `compile_policy`'s rule, True, False (see
        `__init__`); settable."""
        return self._compile_decode

    @compile_decode.setter
    def compile_decode(self, value: bool | None) -> None:
        if value is not None:
            checked_bool("compile_decode", value)
        self._compile_decode = value

    @property
    def can_compile(self) -> bool:
        """Whether the decode step could be compiled at all, whatever `compile_decode` says (see `is_compileable`)."""
        if not self.uses_oscar_attention:
            return False
        model = self._model_ref() if self._model_ref is not None else None
        device = getattr(model, "device", None)
        dim = self.shape.head_dim
        return all(layer.compileable_on(device, dim, dim)
                   if i in self._quantized and not layer.is_initialized and device is not None
                   else layer.is_compileable for i, layer in enumerate(self.layers))

    @property
    def uses_oscar_attention(self) -> bool:
        return (not self._foreign_attention
                and getattr(self._model_config, "_attn_implementation", None) == OSCAR_ATTENTION)

    def __deepcopy__(self, memo):
        # Share the immutable model config, master rotations and kernel backends; copy every tier.
        memo[id(self._model_config)] = self._model_config
        memo[id(self._step_clock.ledger)] = self._step_clock.ledger  # the model's: copies count its steps too
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
            live_caches(model).add(clone)
        return clone

    # what pickle and `torch.save` store (the layers: `OscarLayer.__getstate__`): not the model, which is held by
    # a weak reference, nor this process's step clock
    _PROCESS_LOCAL = ("_model_ref", "_step_clock", "_compiled_marker", "_expected_compile_seconds")

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._PROCESS_LOCAL}
        state["_model_ref"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        """An unpickled cache continues the sequences it holds with a model switched to "oscar" (the one it was
        built with, or `use_oscar_attention(model)`); it is not tied to that model's compile bookkeeping."""
        self.__dict__.update(state)
        self._step_clock = StepClock(ledger_of(self))

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
        plan = self._plan
        if plan.rotations_name is None:
            self.rotations.save_pretrained(save_directory)
        setup = {
            "oscar_config": self.oscar_config.to_dict(),
            "rotations": plan.rotations_name or SAFETENSORS_NAME,
            "recorded_clip_ratios": plan.recorded_clip_ratios,
            "fold_value_rotation": plan.folds_value_rotation,
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
        compile_decode: bool | None = None,
        subfolder: str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
    ) -> "OscarCache":
        """The cache `save_pretrained` wrote, for `model` (its attention switched, its value rotations folded if
        the saved cache folded them), from a local folder or a Hub repo (JSON and safetensors only). Raises
        ValueError when `model`'s attention shape differs from the one the setup was saved for. `backend` and
        `compile_decode`, which change how the cache runs and not what it stores, are not saved: pass them here."""
        folder = resolve_rotation_folder(
            pretrained_model_name_or_path, subfolder, revision=revision,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir), token=token,
            local_files_only=local_files_only, force_download=force_download, what="OSCAR setup",
        )
        path = os.path.join(folder, CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: {os.fspath(pretrained_model_name_or_path)!r} holds no "
                                    f"OSCAR setup (OscarCache.save_pretrained writes {CONFIG_NAME})")
        setup = _checked_setup(path, read_json_file(path, "OscarCache.save_pretrained"))
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
                   backend=backend, compile_decode=compile_decode)

    # ------------------------------------------------------------------------------------------ memory
    def nbytes(self) -> int:
        """Bytes of the stored tokens over all layers (BF16 tiers, quantized history, sliding layers)."""
        total = 0
        for i, layer in enumerate(self.layers):
            if i in self._quantized:
                total += layer.nbytes()
            elif layer.is_initialized and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element of the quantized (full-attention) layers, BF16 tiers included."""
        layers = self.quantized_layers
        elements = sum(layer.num_elements() for layer in layers)
        return 8.0 * sum(layer.nbytes() for layer in layers) / elements if elements else 0.0

    def __repr__(self) -> str:
        return (f"OscarCache(method={self.oscar_config.method}, layers={len(self.layers)}, "
                f"tokens={self.get_seq_length()}, rotations={self.rotations!r})")


def _own_attention(model) -> str | None:
    """Why `model` (not a bare config) keeps its own attention (`model_support.own_attention_reason`), or None."""
    if model is getattr(model, "config", model):
        return None
    reason = own_attention_reason(model.config)
    if reason is None and not takes_oscar_attention(model):
        reason = "its layers do not call transformers' AttentionInterface"
    return reason


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
