"""`OscarConfig`: every knob of the cache in one validated dataclass, plus the method presets."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass

import torch

from oscar_hf.kernels.reference.quantize import COMPACT, ENCODERS

# A preset fixes how the INT2 history is made. `rotation` is the default rotation source when the user
# passes none: "hadamard" (data-free), "identity" (no rotation) or "file" (calibrated, must be given).
PRESETS: dict[str, dict] = {
    "oscar": dict(rotation="file", quantize=True, key_clip_ratio=0.96, value_clip_ratio=0.92),
    # the 2-bit history, with the layers the rotations rank most retrieval-sensitive at 4 bits (`OscarCache`)
    "oscar-hifi": dict(rotation="file", quantize=True, key_clip_ratio=0.96, value_clip_ratio=0.92),
    # candidate for the next 2-bit default, at <= 2.5 bits: sigma rows with one-byte (scale, zero) codes, and the
    # bits they free spent on the top tenth of the KV heads of the retrieval ranking at 4 bits
    "oscar-next": dict(rotation="file", quantize=True, key_clip_ratio=None, value_clip_ratio=None, encoder="sigma",
                       scale_dtype=torch.uint8),
    # the 2-bit default of rotations that record a retrieval ranking (`OscarCache` picks it): sigma rows with
    # one-byte (scale, zero) codes, and the bits they free spent on the top tenth of the ranked layers at 4 bits.
    # Per layer rather than per KV head (`oscar-next`): a layer of one code width decodes at the bandwidth of a
    # uniform one, a layer split by heads does not (docs/retrieval.md)
    "oscar-mixed": dict(rotation="file", quantize=True, key_clip_ratio=None, value_clip_ratio=None, encoder="sigma",
                        scale_dtype=torch.uint8),
    "hadamard": dict(rotation="hadamard", quantize=True, key_clip_ratio=0.96, value_clip_ratio=0.92),
    "quarot": dict(rotation="hadamard", quantize=True, key_clip_ratio=None, value_clip_ratio=None),
    "clip": dict(rotation="identity", quantize=True, key_clip_ratio=0.96, value_clip_ratio=0.92),
    "identity": dict(rotation="identity", quantize=True, key_clip_ratio=None, value_clip_ratio=None),
    "none": dict(rotation="identity", quantize=False, key_clip_ratio=None, value_clip_ratio=None),
}

# share of the full-attention layers a preset keeps at 4 bits: the top of the rotations' retrieval ranking
HIFI_LAYER_SHARE = 0.2
MIXED_LAYER_SHARE = 0.1
RANKED_LAYER_SHARES = {"oscar-hifi": HIFI_LAYER_SHARE, "oscar-mixed": MIXED_LAYER_SHARE}
# what a cache given rotations with a layer ranking and no format options stores (`OscarCache`); without a ranking
# it stores `oscar`'s uniform rows
RANKED_DEFAULT_METHOD = "oscar-mixed"
# the `OscarConfig` fields that choose a row format: with any of them given, the default stays `oscar`
FORMAT_FIELDS = ("quantize", "bits", "key_clip_ratio", "value_clip_ratio", "scale_dtype", "encoder",
                 "high_precision_layers", "high_precision_heads", "high_precision_bits")
# share of the full-attention layers' KV heads a preset keeps at 4 bits: the top of the rotations' per-head ranking
# (precision per KV head retrieves more than per layer at equal bits: docs/retrieval.md)
RANKED_HEAD_SHARES = {"oscar-next": 0.1}

# "compact": one byte each for the scale and the zero point (`kernels.reference.quantize`, 7)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "compact": torch.uint8}
SCALE_DTYPE_NAMES = {dtype: name for name, dtype in SCALE_DTYPES.items()}

CONFIG_NAME = "oscar_config.json"  # what `OscarCache.save_pretrained` writes beside the rotations


@dataclass(frozen=True)
class OscarConfig:
    """Layout and quantizer settings of an `OscarCache`.

    Token pool per layer: `sink_tokens` BF16 | quantized history | `recent_tokens` BF16. Once the recent window
    holds more than `recent_tokens + demote_block - 1` tokens after a forward, its oldest tokens are demoted so
    that exactly `recent_tokens` remain (a decode step demotes `demote_block` tokens at a time).

    Args:
        method: name of the preset the settings came from (`oscar`, `oscar-mixed`, `oscar-hifi`, `oscar-next`,
            `hadamard`, `quarot`, `clip`, `identity`, `none`); informational once the other fields are set, except
            that an `oscar-mixed` or `oscar-hifi` cache without `high_precision_layers` takes them from its
            rotations' retrieval ranking (`RANKED_LAYER_SHARES`), and an `oscar-next` cache without `high_precision_heads` takes those from its
            rotations' per-head ranking (`RANKED_HEAD_SHARES`).
        sink_tokens: leading tokens kept in BF16 (attention sinks). Left padding is added on top, so every row
            keeps `sink_tokens` real tokens.
        recent_tokens: most recent tokens kept in BF16.
        demote_block: demotion granularity in tokens during decode.
        bits: code width of the history, 2 (4 codes per byte) or 4 (2 codes per byte).
        key_clip_ratio / value_clip_ratio: per-row symmetric clip at the order statistic
            `sort(|x|)[int(ratio * head_dim)]`; `None` disables clipping. The presets clip only at 2 bits
            (`from_method` with `bits=4` gives None unless the ratios are passed too).
        scale_dtype: storage dtype of the per-row (scale, zero) pair: float16 (2.25 bits/element at 2 bits and
            head_dim 128), bfloat16, float32, or "compact" (`torch.uint8`: one byte each, 2.125 bits/element at
            head_dim 128; `kernels.reference.quantize`, 7; the Triton kernels demote and attend to it, and so does the
            CUDA history kernel).
        quantize: False keeps the history in the model dtype (same tiers and merge, no quantization); for tests.
        history_chunk: tokens of history dequantized at a time by the PyTorch reference attention.
        encoder: how a history row's codes and (scale, zero) are chosen: "minmax" (default, the OSCAR reference),
            "lloyd" (opt-in: Lloyd-Max iterations on the uniform grid, `quantize.lloyd_refine`) or "sigma" (opt-in:
            the Gaussian-optimal uniform grid around the row's mean, from its standard deviation; ignores the clip
            ratios). Same stored format and dequantizer; "lloyd" demotes through the PyTorch reference on every
            device, "sigma" through the Triton demotion kernel on CUDA.
        high_precision_layers: layer indices whose history stores `high_precision_bits`-bit codes, unclipped,
            instead of `bits` (the layers retrieval depends on most; `for_layer` gives each layer's settings).
        high_precision_heads: (layer, KV head) pairs stored like a high-precision layer, the rest of their layer
            at `bits`: the layer's history is kept as runs of adjacent KV heads, one width each
            (`head_groups`). Heads of a layer in `high_precision_layers` are high-precision already.
        high_precision_bits: code width of those layers and heads, 2 or 4.
    """

    method: str = "hadamard"
    sink_tokens: int = 64
    recent_tokens: int = 256
    demote_block: int = 8
    bits: int = 2
    key_clip_ratio: float | None = 0.96
    value_clip_ratio: float | None = 0.92
    scale_dtype: torch.dtype = torch.float16
    quantize: bool = True
    history_chunk: int = 4096
    encoder: str = "minmax"
    high_precision_layers: tuple[int, ...] = ()
    high_precision_heads: tuple[tuple[int, int], ...] = ()
    high_precision_bits: int = 4

    def __post_init__(self):
        if isinstance(self.scale_dtype, str):
            if self.scale_dtype not in SCALE_DTYPES:
                raise ValueError(f"scale_dtype={self.scale_dtype!r}: expected one of {sorted(SCALE_DTYPES)}")
            object.__setattr__(self, "scale_dtype", SCALE_DTYPES[self.scale_dtype])
        if self.scale_dtype not in SCALE_DTYPES.values():
            raise ValueError(f"scale_dtype={self.scale_dtype}: expected torch.float16, torch.bfloat16, torch.float32 "
                             "or torch.uint8 (compact)")
        for name in ("sink_tokens", "recent_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: expected an integer >= 0")
        for name in ("demote_block", "history_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        for name in ("bits", "high_precision_bits"):
            if getattr(self, name) not in (2, 4):
                raise ValueError(f"{name}={getattr(self, name)!r}: OscarCache stores 2-bit or 4-bit codes")
        layers = self.high_precision_layers
        if isinstance(layers, int) or not all(isinstance(i, int) and i >= 0 for i in layers):
            raise ValueError(f"high_precision_layers={layers!r}: expected layer indices (integers >= 0)")
        object.__setattr__(self, "high_precision_layers", tuple(sorted(set(layers))))
        heads = self.high_precision_heads
        try:
            pairs = [(layer, head) for layer, head in heads]
        except (TypeError, ValueError):
            pairs = None
        if pairs is None or not all(isinstance(i, int) and i >= 0 for pair in pairs for i in pair):
            raise ValueError(f"high_precision_heads={heads!r}: expected (layer, KV head) pairs of integers >= 0")
        object.__setattr__(self, "high_precision_heads", tuple(sorted(set(pairs))))
        for name in ("key_clip_ratio", "value_clip_ratio"):
            ratio = getattr(self, name)
            if ratio is not None and not 0.0 < ratio <= 1.0:
                raise ValueError(f"{name}={ratio!r}: expected a ratio in (0, 1], or None to disable clipping")
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder={self.encoder!r}: expected one of {ENCODERS}")
        if self.scale_dtype == torch.uint8 and self.encoder == "lloyd":
            raise ValueError("encoder='lloyd' refines float (scale, zero) pairs; compact pairs take 'minmax' or "
                             "'sigma'")
        if self.method not in PRESETS:
            raise ValueError(f"method={self.method!r}: expected one of {sorted(PRESETS)}")

    @classmethod
    def from_method(cls, method: str, **overrides) -> "OscarConfig":
        """The preset `method` with `overrides` applied (any field of this class)."""
        if method not in PRESETS:
            raise ValueError(f"method={method!r}: expected one of {sorted(PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown OscarConfig option(s) {unknown}; valid options: {sorted(known)}")
        preset = {k: v for k, v in PRESETS[method].items() if k != "rotation"}
        if overrides.get("bits", cls.bits) != cls.bits:
            # the presets' clip ratios are a 2-bit trade (range for resolution): wider codes resolve the tails the
            # clip cuts, and retrieval reads them, so other widths do not clip unless asked to
            preset.update(key_clip_ratio=None, value_clip_ratio=None)
        return cls(method=method, **{**preset, **overrides})

    def for_layer(self, layer_idx: int) -> "OscarConfig":
        """The settings of one layer: these, with `high_precision_heads` narrowed to the layer's own, or the
        `high_precision` settings for a high-precision layer."""
        if layer_idx in self.high_precision_layers:
            return self.high_precision()
        own = tuple(pair for pair in self.high_precision_heads if pair[0] == layer_idx)
        return self if own == self.high_precision_heads else dataclasses.replace(self, high_precision_heads=own)

    def high_precision(self) -> "OscarConfig":
        """The settings of high-precision rows: `high_precision_bits`-bit min-max codes without clipping (a clip that
        suits 2-bit rows cuts tails that wider codes keep, and retrieval reads them; the sigma grid would saturate
        them too), with float16 (scale, zero) pairs where the others are compact: the GPU kernel of wide rows reads
        float16 pairs at a higher bandwidth than compact ones (`bench/RESULTS.md`), and a 4-bit row's pair is a
        small part of its bytes."""
        pairs = torch.float16 if self.scale_dtype == COMPACT else self.scale_dtype
        return dataclasses.replace(self, bits=self.high_precision_bits, key_clip_ratio=None, value_clip_ratio=None,
                                   encoder="minmax" if self.encoder == "sigma" else self.encoder, scale_dtype=pairs,
                                   high_precision_layers=(), high_precision_heads=())

    def high_precision_kv_heads(self, layer_idx: int) -> tuple[int, ...]:
        """The KV heads of layer `layer_idx` listed in `high_precision_heads` (empty for a high-precision layer,
        whose heads all are)."""
        if layer_idx in self.high_precision_layers:
            return ()
        return tuple(head for layer, head in self.high_precision_heads if layer == layer_idx)

    # ------------------------------------------------------------------------------------------ as data
    def to_dict(self) -> dict:
        """Every field as a JSON type: `scale_dtype` by its `SCALE_DTYPES` name, the layer and head lists as lists."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "scale_dtype": SCALE_DTYPE_NAMES[self.scale_dtype],
                "high_precision_layers": list(self.high_precision_layers),
                "high_precision_heads": [list(pair) for pair in self.high_precision_heads]}

    @classmethod
    def from_dict(cls, config_dict: dict) -> "OscarConfig":
        """The config `to_dict` gave; missing fields take their defaults, unknown ones raise ValueError."""
        if not isinstance(config_dict, dict):
            raise ValueError(f"an OscarConfig dict is expected, got {type(config_dict).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in config_dict if k not in known]
        if unknown:
            hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, known, n=1))
                     else repr(k) for k in unknown]
            raise ValueError(f"unknown OscarConfig field(s) {', '.join(hints)}; valid fields: {', '.join(known)}")
        return cls(**config_dict)

    def to_json_string(self) -> str:
        """`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        """Write `to_json_string` to `json_file_path`."""
        with open(json_file_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def from_json_file(cls, json_file_path: str | os.PathLike) -> "OscarConfig":
        """The config a `to_json_file` wrote."""
        with open(json_file_path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @property
    def code_widths(self) -> tuple[int, ...]:
        """The code widths some layer stores."""
        high = self.high_precision_layers or self.high_precision_heads
        return tuple(sorted({self.bits, self.high_precision_bits} if high else {self.bits}))

    @property
    def default_rotation(self) -> str:
        """Rotation source the preset uses when none is given: "hadamard", "identity" or "file"."""
        return PRESETS[self.method]["rotation"]
