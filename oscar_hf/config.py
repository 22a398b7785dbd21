"""`OscarConfig`: every knob of the cache in one validated dataclass, plus the method presets."""

from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
import os
from dataclasses import dataclass

import torch

from oscar_hf.kernels.format import RowFormat
from oscar_hf.kernels.reference.quantize import CODE_SLICES, COMPACT, ENCODERS

# The presets: complete `OscarConfig`s, named by their `method` field (built below the class as `PRESETS`)
PRESET_NAMES = ("oscar", "oscar-mixed", "oscar-hifi", "oscar-next", "hadamard", "quarot", "clip", "identity", "none")
# what a cache stores given no method and no format options on rotations that rank retrieval (a file's, or the
# model's data-free profile): `oscar-next` where they rank KV heads, `oscar-mixed` where they rank layers only;
# without a ranking, `oscar`'s uniform rows (`plan`)
RANKED_DEFAULT_METHOD = "oscar-next"
LAYER_RANKED_DEFAULT_METHOD = "oscar-mixed"
# the `OscarConfig` fields that choose a row format: with any of them given, the default stays `oscar`
FORMAT_FIELDS = ("quantize", "bits", "key_clip_ratio", "value_clip_ratio", "scale_dtype", "encoder",
                 "high_precision_layers", "high_precision_heads", "high_precision_bits", "high_precision_layer_share",
                 "high_precision_head_share")
ROTATION_SOURCES = ("hadamard", "identity", "file")

# "compact": one byte each for the scale and the zero point (`kernels.reference.quantize`, 7)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "compact": torch.uint8}
SCALE_DTYPE_NAMES = {dtype: name for name, dtype in SCALE_DTYPES.items()}

# the largest size in tokens a config or cache takes: a buffer sized beyond it overflows torch's size arithmetic or
# cannot be allocated, deep inside the first forward
MAX_TOKENS = 2**31


def read_json_file(path: str | os.PathLike, what: str):
    """The JSON value in the file at `path`, or ValueError naming the file when it does not hold JSON (cut short by
    an interrupted copy or download, say: json's own error names a line and column, not the file). `what` says what
    writes such a file, for the error's advice."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{os.fspath(path)} is not a readable JSON file ({error}): it is cut short or corrupt; "
                         f"write it again with {what}") from None


def checked_bool(name: str, value) -> bool:
    """`value` if it is a bool; ValueError otherwise (JSON's "false" is a string, and a non-empty string is true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected a bool (True or False; true or false in JSON), got "
                         f"{type(value).__name__}")
    return value


def checked_int(name: str, value, low: int, high: int = MAX_TOKENS) -> int:
    """`value` as an int if it is a whole number (not a bool, not a float) in [low, high]; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r}: expected an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r}: expected an int from {low} to {high}")
    return int(value)


def checked_ratio(name: str, value) -> float | None:
    """`value` as a float if it is a number (not a bool) in (0, 1], or None; ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r}: expected a float in (0, 1] or None, got {type(value).__name__}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name}={value!r}: expected a ratio in (0, 1], or None to disable clipping")
    return float(value)


def checked_str(name: str, value, choices) -> str:
    """`value` if it is one of the strings `choices`; ValueError otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {sorted(choices)}")
    return value


@dataclass(frozen=True)
class OscarConfig:
    """Layout and quantizer settings of an `OscarCache`.

    Token pool per layer: `sink_tokens` BF16 | quantized history | `recent_tokens` BF16. Once the recent window
    holds more than `recent_tokens + demote_block - 1` tokens after a forward, its oldest tokens are demoted so
    that exactly `recent_tokens` remain (a decode step demotes `demote_block` tokens at a time).

    Args:
        method: name of the preset the settings came from (`PRESETS`: `oscar`, `oscar-mixed`, `oscar-hifi`,
            `oscar-next`, `hadamard`, `quarot`, `clip`, `identity`, `none`); a label: the other fields say what is
            stored.
        sink_tokens: leading tokens kept in BF16 (attention sinks). Left padding is added on top, so every row
            keeps `sink_tokens` real tokens.
        recent_tokens: most recent tokens kept in BF16.
        demote_block: demotion granularity in tokens during decode.
        bits: code width of the history: 2 (4 codes per byte), 3 (bit-sliced: a 2-bit and a 1-bit plane) or 4
            (2 codes per byte). The stored format of a row is `row_format` (`kernels.format.RowFormat`).
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
        high_precision_bits: code width of those layers and heads, 2, 3 or 4 (`high_precision_format`).
        high_precision_layer_share / high_precision_head_share: without explicit `high_precision_layers` (or
            heads), this share of the full-attention layers (of their KV heads) is taken from the top of the
            rotations' retrieval ranking (at least one; rotations without a ranking are refused).
        rotation: the rotation source when the cache is given none: "hadamard" (data-free), "identity" (none) or
            "file" (calibrated rotations, which must then be given).

    Every field is checked for its type as well as its range (a bool is not an int, a float not a size, a string
    not a bool); sizes in tokens are at most `MAX_TOKENS`.
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
    high_precision_layer_share: float = 0.0
    high_precision_head_share: float = 0.0
    rotation: str = "hadamard"

    def __post_init__(self):
        # every field is checked for its type too: a JSON file or a loose argument must not turn "false" into a
        # truthy string, 2.0 into a float shape, or True into the integer 1
        checked_str("method", self.method, PRESET_NAMES)
        checked_str("rotation", self.rotation, ROTATION_SOURCES)
        for name in ("high_precision_layer_share", "high_precision_head_share"):
            object.__setattr__(self, name, _checked_share(name, getattr(self, name)))
        object.__setattr__(self, "scale_dtype", _checked_scale_dtype(self.scale_dtype))
        for name, low in (("sink_tokens", 0), ("recent_tokens", 0), ("demote_block", 1), ("history_chunk", 1)):
            object.__setattr__(self, name, checked_int(name, getattr(self, name), low))
        for name in ("bits", "high_precision_bits"):
            object.__setattr__(self, name, _checked_bits(name, getattr(self, name)))
        for name in ("key_clip_ratio", "value_clip_ratio"):
            object.__setattr__(self, name, checked_ratio(name, getattr(self, name)))
        checked_bool("quantize", self.quantize)
        checked_str("encoder", self.encoder, ENCODERS)
        self.row_format  # noqa: B018 -- the format checks that its fields make one (compact pairs and lloyd do not)
        object.__setattr__(self, "high_precision_layers", _checked_layers(self.high_precision_layers))
        object.__setattr__(self, "high_precision_heads", _checked_heads(self.high_precision_heads))

    @classmethod
    def from_method(cls, method: str, **overrides) -> "OscarConfig":
        """The preset `method` with `overrides` applied (any field of this class)."""
        checked_str("method", method, PRESET_NAMES)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown OscarConfig option(s) {unknown}; valid options: {sorted(known)}")
        preset = PRESETS[method]
        if overrides.get("bits", preset.bits) != preset.bits:
            # the presets' clip ratios are a 2-bit trade (range for resolution): wider codes resolve the tails the
            # clip cuts, and retrieval reads them, so other widths do not clip unless asked to
            overrides = dict(key_clip_ratio=None, value_clip_ratio=None) | overrides
        return dataclasses.replace(preset, **overrides)

    def for_layer(self, layer_idx: int) -> "OscarConfig":
        """The settings of one layer: these, with `high_precision_heads` narrowed to the layer's own, or the
        `high_precision` settings for a high-precision layer."""
        if layer_idx in self.high_precision_layers:
            return self.high_precision()
        own = tuple(pair for pair in self.high_precision_heads if pair[0] == layer_idx)
        return self if own == self.high_precision_heads else dataclasses.replace(self, high_precision_heads=own)

    @property
    def row_format(self) -> RowFormat:
        """How an ordinary history row is stored."""
        return RowFormat(self.bits, self.encoder, self.scale_dtype, self.key_clip_ratio, self.value_clip_ratio)

    @property
    def high_precision_format(self) -> RowFormat:
        """How a high-precision row is stored: `high_precision_bits`-bit min-max codes without clipping (a clip that
        suits 2-bit rows cuts tails that wider codes keep, and retrieval reads them; the sigma grid would saturate
        them too), with float16 (scale, zero) pairs where the others are compact: the GPU kernel of wide rows reads
        float16 pairs at a higher bandwidth than compact ones (`docs/performance.md`), and a 4-bit row's pair is a
        small part of its bytes."""
        pairs = torch.float16 if self.scale_dtype == COMPACT else self.scale_dtype
        return RowFormat(self.high_precision_bits, "minmax" if self.encoder == "sigma" else self.encoder, pairs)

    def with_format(self, row_format: RowFormat) -> "OscarConfig":
        """These settings with ordinary rows stored as `row_format`."""
        return dataclasses.replace(self, bits=row_format.bits, encoder=row_format.encoder,
                                   scale_dtype=row_format.pair_dtype, key_clip_ratio=row_format.key_clip_ratio,
                                   value_clip_ratio=row_format.value_clip_ratio)

    def high_precision(self) -> "OscarConfig":
        """The settings of high-precision rows: these, with `high_precision_format` for every row."""
        return dataclasses.replace(self.with_format(self.high_precision_format), high_precision_layers=(),
                                   high_precision_heads=())

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
        """The config `to_dict` gave; missing fields take those of its `method`'s preset (a file written before a
        field existed keeps meaning what it meant), unknown ones raise ValueError."""
        if not isinstance(config_dict, dict):
            raise ValueError(f"an OscarConfig dict is expected, got {type(config_dict).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in config_dict if k not in known]
        if unknown:
            hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, known, n=1))
                     else repr(k) for k in unknown]
            raise ValueError(f"unknown OscarConfig field(s) {', '.join(hints)}; valid fields: {', '.join(known)}")
        method = checked_str("method", config_dict.get("method", cls.method), PRESET_NAMES)
        return cls(**{**PRESETS[method].to_dict(), **config_dict})

    def to_json_string(self) -> str:
        """`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        """Write `to_json_string` to `json_file_path`."""
        with open(json_file_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def from_json_file(cls, json_file_path: str | os.PathLike) -> "OscarConfig":
        """The config a `to_json_file` wrote (ValueError naming the file when it is not JSON)."""
        return cls.from_dict(read_json_file(json_file_path, "OscarConfig.to_json_file"))

    @property
    def row_formats(self) -> tuple[RowFormat, ...]:
        """The row formats some layer stores: ordinary rows, and high-precision rows where layers or heads are."""
        high = self.high_precision_layers or self.high_precision_heads
        return (self.row_format, self.high_precision_format) if high else (self.row_format,)

    @property
    def code_widths(self) -> tuple[int, ...]:
        """The code widths some layer stores."""
        return tuple(sorted({row_format.bits for row_format in self.row_formats}))


def _checked_share(name: str, value) -> float:
    """`value` as a float if it is a number (not a bool) in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r}: expected a share of the full-attention layers or KV heads, a float "
                         "in [0, 1]")
    return float(value)


def _checked_scale_dtype(value) -> torch.dtype:
    """The `SCALE_DTYPES` dtype `value` names or is."""
    if isinstance(value, str):
        if value not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={value!r}: expected one of {sorted(SCALE_DTYPES)}")
        return SCALE_DTYPES[value]
    if not isinstance(value, torch.dtype) or value not in SCALE_DTYPES.values():
        raise ValueError(f"scale_dtype={value!r}: expected torch.float16, torch.bfloat16, torch.float32 or "
                         "torch.uint8 (compact), or one of their names " + str(sorted(SCALE_DTYPES)))
    return value


def _checked_bits(name: str, value) -> int:
    """`value` if it is one of the code widths OscarCache stores (`CODE_SLICES`: 2, 3 or 4)."""
    *most, last = sorted(CODE_SLICES)
    widths = f"{', '.join(map(str, most))} or {last}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r}: expected the int {widths}, got {type(value).__name__}")
    if value not in CODE_SLICES:
        raise ValueError(f"{name}={value!r}: OscarCache stores codes of {widths} bits")
    return int(value)


def _is_index(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _checked_layers(layers) -> tuple[int, ...]:
    """Sorted, distinct layer indices (ints >= 0)."""
    if isinstance(layers, (str, bytes)) or not _all_indices(layers):
        raise ValueError(f"high_precision_layers={layers!r}: expected a list of layer indices (ints >= 0)")
    return tuple(sorted({int(i) for i in layers}))


def _checked_heads(heads) -> tuple[tuple[int, int], ...]:
    """Sorted, distinct (layer, KV head) pairs of ints >= 0."""
    try:
        pairs = [(layer, head) for layer, head in heads]
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(_is_index(i) for pair in pairs for i in pair):
        raise ValueError(f"high_precision_heads={heads!r}: expected a list of (layer, KV head) pairs of ints >= 0")
    return tuple(sorted({(int(layer), int(head)) for layer, head in pairs}))


def _all_indices(values) -> bool:
    try:
        return all(_is_index(i) for i in values)
    except TypeError:  # not iterable
        return False


# The presets. A uniform 2-bit row clips at the ratios that suit min-max codes; `sigma` rows (the Gaussian-optimal
# grid, with one-byte (scale, zero) pairs) do not clip, and spend the bits their pairs free on retrieval: the top of
# the rotations' ranking at 4 bits, per layer (`oscar-mixed`: a layer of one width decodes at the bandwidth of a
# uniform one) or per KV head (`oscar-next`: retrieves more at equal bits, decodes slower; docs/retrieval.md).
_UNCLIPPED = dict(key_clip_ratio=None, value_clip_ratio=None)
_SIGMA = dict(_UNCLIPPED, encoder="sigma", scale_dtype=torch.uint8)
PRESETS: dict[str, OscarConfig] = {preset.method: preset for preset in (
    OscarConfig("oscar", rotation="file"),
    OscarConfig("oscar-mixed", rotation="file", high_precision_layer_share=0.1, **_SIGMA),
    OscarConfig("oscar-hifi", rotation="file", high_precision_layer_share=0.2),
    OscarConfig("oscar-next", rotation="file", high_precision_head_share=0.1, **_SIGMA),
    OscarConfig("hadamard"),
    OscarConfig("quarot", **_UNCLIPPED),
    OscarConfig("clip", rotation="identity"),
    OscarConfig("identity", rotation="identity", **_UNCLIPPED),
    OscarConfig("none", rotation="identity", quantize=False, **_UNCLIPPED),
)}
assert tuple(PRESETS) == PRESET_NAMES
