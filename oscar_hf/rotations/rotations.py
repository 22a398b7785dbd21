"""`Rotations`: the per-layer key and value rotations an `OscarCache` applies to its quantized history."""

from __future__ import annotations

import json
import operator
import os
import tempfile
from collections.abc import Mapping

import torch

from oscar_hf.rotations.hub import check_push_target, resolve_rotation_folder
from oscar_hf.rotations.io import (
    RotationFileError,
    RotationTables,
    load_rotation_path,
    load_zoo,
    save_safetensors,
    save_zoo,
)
from oscar_hf.rotations.math import hadamard_matrix, is_power_of_two, orthogonality_error, smoothed_key_transforms

ORTHOGONALITY_TOLERANCE = 1e-3


DEFAULT_CLIP_BITS = 2
RETRIEVAL_LAYERS_KEY = "retrieval_layers"  # metadata: JSON list of layer indices, most retrieval-sensitive first
RETRIEVAL_RANKING_KEY = "retrieval_ranking"  # metadata: how the recorded rankings were made
RETRIEVAL_HEADS_KEY = "retrieval_heads"  # metadata: JSON list of [layer, KV head] pairs, most sensitive first
KEY_SMOOTHING_KEY = "key_smoothing"  # metadata: how the key smoothing scales were computed


class Rotations:
    """Key and value rotations per global layer index, float32.

    Each rotation is `[d, d]` (shared by the KV heads of the layer; RotationZoo format v1) or `[Hkv, d, d]` (one
    per KV head; format v2), used as `x_rot = x @ R`. Eigenvalues (ascending, as `eigh` returns them) and a
    string metadata dict (provenance) are optional. So is `key_smoothing`: per layer, positive per-(KV head,
    channel) scales `s` `[Hkv, d]`; the history then stores keys as `(k / s) @ R` and the query is rotated by
    `(q * s) @ R` (`key_transforms`), which leaves every score unchanged before quantization and spreads the
    rounding error where the query weighs it least (`oscar_hf.calibrate.smoothing`). RotationZoo files cannot hold
    it.

    `from_pretrained` / `save_pretrained` / `push_to_hub` follow `huggingface_hub.ModelHubMixin`: the same
    arguments and return values, a model card (`README.md`) written beside the file unless one exists, pushes
    that save to a temporary folder and upload it in one commit. The class does not inherit the mixin: its
    `save_pretrained` deletes any `config.json` in the folder (rotations are often saved beside a model), and its
    `from_pretrained` asks the Hub for a `config.json` before looking at a relative local path; both also lack
    the `subfolder` that one repo of rotations for several models needs.
    """

    def __init__(
        self,
        key: Mapping[int, torch.Tensor],
        value: Mapping[int, torch.Tensor],
        key_eigenvalues: Mapping[int, torch.Tensor] | None = None,
        value_eigenvalues: Mapping[int, torch.Tensor] | None = None,
        metadata: Mapping[str, str] | None = None,
        key_smoothing: Mapping[int, torch.Tensor] | None = None,
    ):
        self.key = _float_table("key rotation", key)
        self.value = _float_table("value rotation", value)
        self.key_eigenvalues = _float_table("key eigenvalues", _or_empty(key_eigenvalues))
        self.value_eigenvalues = _float_table("value eigenvalues", _or_empty(value_eigenvalues))
        self.key_smoothing = _float_table("key smoothing", _or_empty(key_smoothing))
        metadata = _or_empty(metadata)
        if not isinstance(metadata, Mapping):
            raise RotationFileError(
                f"rotations metadata is of type {type(metadata).__name__}; expected a dict {{str: str}}"
            )
        self.metadata = {str(k): str(v) for k, v in metadata.items()}
        self._check_consistent()
        self._check_eigenvalues()
        self._check_smoothing()
        self._check_metadata()

    # ----------------------------------------------------------------------------------------- constructors
    @classmethod
    def hadamard(cls, layer_ids, head_dim: int) -> "Rotations":
        """Data-free rotations: the normalized Sylvester Hadamard for every layer (one shared tensor)."""
        if not is_power_of_two(head_dim):
            raise ValueError(
                f"Hadamard rotations need head_dim to be a power of two; this model has head_dim={head_dim}. "
                "Use rotations='identity' (naive INT2) or calibrated rotations instead."
            )
        h = hadamard_matrix(head_dim, torch.float32)
        ids = list(layer_ids)
        return cls({i: h for i in ids}, {i: h for i in ids}, metadata={"objective": "hadamard"})

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        subfolder: str | None = None,
        force_download: bool = False,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        revision: str | None = None,
    ) -> "Rotations":
        """Load from a local folder or file, or from a Hugging Face Hub repo (downloaded and cached).

        A folder holds `oscar_rotations.safetensors` (this library's format) or one `k_rotation*.pt` and one
        `v_rotation*.pt` (OSCAR RotationZoo format). `.pt` files are read with `torch.load(weights_only=True)`.
        A local path is tried first; a missing one is reported as "no such local folder" before any Hub error.
        """
        local = resolve_rotation_folder(
            pretrained_model_name_or_path, subfolder, revision=revision,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir), token=token,
            local_files_only=local_files_only, force_download=force_download,
        )
        return cls._from_tables(load_rotation_path(local), local)

    @classmethod
    def from_zoo(cls, key_file: str | os.PathLike, value_file: str | os.PathLike) -> "Rotations":
        """Load a RotationZoo pair of files (`k_rotation_<objective>.pt`, `v_rotation_<objective>.pt`)."""
        key_file, value_file = os.fspath(key_file), os.fspath(value_file)
        return cls._from_tables(load_zoo(key_file, value_file), f"{key_file}, {value_file}")

    @classmethod
    def _from_tables(cls, tables: RotationTables, source: str) -> "Rotations":
        """`cls(**tables)`; a check that fails names the files the tables came from, since `Rotations` itself
        does not know them."""
        try:
            return cls(**tables)
        except RotationFileError as error:
            raise RotationFileError(f"{source}: {error}") from error

    # ------------------------------------------------------------------------------------------- access
    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.key)

    @property
    def head_dim(self) -> int:
        return next(iter(self.key.values())).shape[-1]

    @property
    def per_head(self) -> bool:
        return any(r.dim() == 3 for r in self.key.values()) or any(r.dim() == 3 for r in self.value.values())

    def for_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key rotation, value rotation) of a global layer index."""
        if layer_idx not in self.key:
            raise RotationFileError(f"no rotation for layer {layer_idx}; these rotations cover layers {self.layer_ids}")
        return self.key[layer_idx], self.value[layer_idx]

    def key_transforms(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(what keys are multiplied by when stored, what the query is multiplied by) for a global layer index:
        the key rotation twice, or with key smoothing `(R / s, R * s)` per KV head (`[Hkv, d, d]`)."""
        rotation = self.for_layer(layer_idx)[0]
        if layer_idx not in self.key_smoothing:
            return rotation, rotation
        return smoothed_key_transforms(rotation, self.key_smoothing[layer_idx])

    def with_key_smoothing(self, scales: Mapping[int, torch.Tensor], description: str) -> "Rotations":
        """These rotations with per-channel key smoothing `scales` (`{layer: [Hkv, d]}`), `description` recorded
        in the metadata (`key_smoothing`). Retrieval rankings recorded without the smoothing are dropped: they
        rank what the unsmoothed history loses, and the smoothed one loses it elsewhere (rank again:
        `oscar_hf.calibrate.retrieval_layers`)."""
        dropped = (RETRIEVAL_LAYERS_KEY, RETRIEVAL_HEADS_KEY, RETRIEVAL_RANKING_KEY)
        metadata = {k: v for k, v in self.metadata.items() if k not in dropped}
        return Rotations(self.key, self.value, self.key_eigenvalues, self.value_eigenvalues,
                         {**metadata, KEY_SMOOTHING_KEY: description}, key_smoothing=scales)

    def clip_ratios(self, layer_idx: int, bits: int | None = None) -> tuple[float | None, float | None] | None:
        """(key, value) clip ratios recorded for `layer_idx` by a clip search (None in a pair: no clipping), or None
        when the metadata records none (`recorded_clip_ratios`), or when `bits` is given and differs from the code
        width the ratios were chosen for (`clip_bits`): a clip that is best for 2-bit rows cuts tails that 4-bit
        rows would have kept, and costs them retrieval."""
        try:
            recorded = recorded_clip_ratios(self.metadata)
            if recorded is None or (bits is not None and bits != recorded_clip_bits(self.metadata)):
                return None
            return tuple(r[layer_idx] if isinstance(r, dict) else r for r in recorded)
        except (KeyError, ValueError, TypeError) as error:
            raise RotationFileError(f"the rotations' recorded clip ratios are unreadable for layer {layer_idx}: "
                                    f"{error!r}") from error

    def retrieval_layers(self) -> list[int] | None:
        """The layers ranked by retrieval sensitivity (`oscar_hf.calibrate.retrieval_layers`), most sensitive first,
        or None when the metadata records no ranking."""
        if RETRIEVAL_LAYERS_KEY not in self.metadata:
            return None
        try:
            ranking = _layer_ranking(json.loads(self.metadata[RETRIEVAL_LAYERS_KEY]))
        except ValueError as error:  # json.JSONDecodeError is a ValueError
            raise RotationFileError(f"the rotations' recorded {RETRIEVAL_LAYERS_KEY} are unreadable: "
                                    f"{error!r}") from error
        unknown = sorted(set(ranking) - set(self.key))
        if unknown:
            raise RotationFileError(f"the recorded {RETRIEVAL_LAYERS_KEY} name layers {unknown} these rotations lack")
        return ranking

    def retrieval_heads(self) -> list[tuple[int, int]] | None:
        """The (layer, KV head) pairs ranked by retrieval sensitivity (`oscar_hf.calibrate.retrieval_layers`), most
        sensitive first, or None when the metadata records no such ranking."""
        if RETRIEVAL_HEADS_KEY not in self.metadata:
            return None
        try:
            ranking = _head_ranking(json.loads(self.metadata[RETRIEVAL_HEADS_KEY]))
        except ValueError as error:
            raise RotationFileError(f"the rotations' recorded {RETRIEVAL_HEADS_KEY} are unreadable: "
                                    f"{error!r}") from error
        unknown = sorted({layer for layer, _ in ranking} - set(self.key))
        if unknown:
            raise RotationFileError(f"the recorded {RETRIEVAL_HEADS_KEY} name layers {unknown} these rotations lack")
        return ranking

    def tables(self) -> RotationTables:
        """The rotations as plain tables (what `rotations.io` reads and writes)."""
        return {"key": self.key, "value": self.value, "key_eigenvalues": self.key_eigenvalues,
                "value_eigenvalues": self.value_eigenvalues, "key_smoothing": self.key_smoothing,
                "metadata": self.metadata}

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        repo_id: str | None = None,
        push_to_hub: bool = False,
        model_card_kwargs: dict | None = None,
        **push_to_hub_kwargs,
    ) -> str | None:
        """Write `save_directory/oscar_rotations.safetensors`, and a model card (`README.md`) unless the folder
        has one. With `push_to_hub=True`, also upload to `repo_id` (default: the folder's name) and return the
        commit URL; else return None (as `ModelHubMixin.save_pretrained`)."""
        save_safetensors(self.tables(), save_directory)
        card = os.path.join(save_directory, "README.md")
        if not os.path.exists(card):
            self.generate_model_card(**{"local_folder": save_directory, **(model_card_kwargs or {})}).save(card)
        if push_to_hub:
            repo_id = repo_id or os.path.basename(os.path.normpath(os.fspath(save_directory)))
            return self.push_to_hub(repo_id, model_card_kwargs=model_card_kwargs, **push_to_hub_kwargs)
        return None

    def push_to_hub(
        self,
        repo_id: str,
        *,
        subfolder: str | None = None,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | None = None,
        branch: str | None = None,
        create_pr: bool | None = None,
        allow_patterns: list[str] | str | None = None,
        ignore_patterns: list[str] | str | None = None,
        delete_patterns: list[str] | str | None = None,
        model_card_kwargs: dict | None = None,
    ) -> str:
        """Upload the rotations and a model card to `repo_id` (created if missing), in `subfolder` when given, in
        one commit; returns the commit URL (`huggingface_hub.CommitInfo`, a str).

        The repo id and the token are checked before anything is sent (`check_push_target`).
        """
        from huggingface_hub import HfApi

        token = check_push_target(repo_id, token)
        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id=repo_id, private=private, exist_ok=True).repo_id
        card = {"repo_id": repo_id, "subfolder": subfolder, **(model_card_kwargs or {})}
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, model_card_kwargs=card)
            return api.upload_folder(
                repo_id=repo_id, repo_type="model", folder_path=folder, path_in_repo=subfolder or "",
                commit_message=commit_message or f"OSCAR rotations for {self.metadata.get('model', 'a model')}",
                revision=branch, create_pr=create_pr, allow_patterns=allow_patterns,
                ignore_patterns=ignore_patterns, delete_patterns=delete_patterns,
            )

    def generate_model_card(self, repo_id: str | None = None, subfolder: str | None = None,
                            local_folder: str | os.PathLike | None = None):
        """The `huggingface_hub.ModelCard` of these rotations (`oscar_hf.rotations.card.model_card`)."""
        from oscar_hf.rotations.card import model_card

        return model_card(self.metadata, repo_id, subfolder, local_folder)

    def save_zoo(self, folder: str | os.PathLike, key_objective: str | None = None,
                 value_objective: str | None = None) -> tuple[str, str]:
        """Write RotationZoo-format `k_rotation_<obj>.pt` / `v_rotation_<obj>.pt` (v1 shared, v2 per head).

        The objectives default to the recorded ones (`qqt` -> `qqt_r_h_pbr`, `hadamard`; `io.zoo_objectives`).
        Both files carry the metadata, so the clip ratios a search recorded load back with them; the reference
        loader reads only the rotations and takes its clip ratios from its environment.
        """
        if self.key_smoothing:
            raise RotationFileError("these rotations smooth their keys (key_smoothing), which RotationZoo files "
                                    "cannot hold; save_pretrained writes them (oscar-hf's safetensors format)")
        return save_zoo(self.tables(), folder, key_objective, value_objective)

    # ------------------------------------------------------------------------------------------- checks
    def _check_consistent(self) -> None:
        if not self.key or not self.value:
            raise RotationFileError("rotations need at least one key and one value rotation")
        if set(self.key) != set(self.value):
            raise RotationFileError(
                f"key rotations cover layers {sorted(self.key)} but value rotations cover {sorted(self.value)}"
            )
        for kind, table in (("key", self.key), ("value", self.value)):
            for i, r in table.items():
                if r.dim() not in (2, 3) or r.shape[-1] != r.shape[-2] or r.numel() == 0:
                    raise RotationFileError(
                        f"{kind} rotation of layer {i} has shape {tuple(r.shape)}; expected [d, d] or [kv_heads, d, d] "
                        "with d and kv_heads at least 1"
                    )
        dims = {r.shape[-1] for r in list(self.key.values()) + list(self.value.values())}
        if len(dims) != 1:
            raise RotationFileError(f"rotations of different sizes {sorted(dims)} in one set")
        for kind, table in (("key", self.key), ("value", self.value)):
            for i, r in table.items():
                if not torch.isfinite(r).all():
                    raise RotationFileError(f"{kind} rotation of layer {i} holds NaN or infinite values")
                err = orthogonality_error(r)
                if err > ORTHOGONALITY_TOLERANCE:
                    raise RotationFileError(
                        f"{kind} rotation of layer {i} is not orthogonal (max |RᵀR - I| = {err:.2e} > "
                        f"{ORTHOGONALITY_TOLERANCE:g}); the file is corrupt or not a rotation"
                    )

    def _check_eigenvalues(self) -> None:
        """Eigenvalues are optional, but those present belong to a rotation: one per column of each matrix."""
        for kind, eigenvalues, rotations in (("key", self.key_eigenvalues, self.key),
                                             ("value", self.value_eigenvalues, self.value)):
            orphans = sorted(set(eigenvalues) - set(rotations))
            if orphans:
                raise RotationFileError(f"{kind} eigenvalues for layers {orphans}, which have no {kind} rotation")
            for i, ev in eigenvalues.items():
                expected = tuple(rotations[i].shape[:-1])
                if tuple(ev.shape) != expected:
                    raise RotationFileError(
                        f"{kind} eigenvalues of layer {i} have shape {tuple(ev.shape)}; its rotation "
                        f"{tuple(rotations[i].shape)} has {expected}"
                    )
                if not torch.isfinite(ev).all():
                    raise RotationFileError(f"{kind} eigenvalues of layer {i} hold NaN or infinite values")

    def _check_smoothing(self) -> None:
        """Key smoothing scales belong to a key rotation: `[Hkv, d]` (Hkv the rotation's heads when it has its
        own per head), finite and positive."""
        orphans = sorted(set(self.key_smoothing) - set(self.key))
        if orphans:
            raise RotationFileError(f"key smoothing for layers {orphans}, which have no key rotation")
        for i, scales in self.key_smoothing.items():
            rotation = self.key[i]
            heads_ok = rotation.dim() == 2 or scales.shape[0] == rotation.shape[0]
            if scales.dim() != 2 or scales.shape[-1] != rotation.shape[-1] or not heads_ok or not scales.numel():
                raise RotationFileError(
                    f"key smoothing of layer {i} has shape {tuple(scales.shape)}; expected [kv_heads, "
                    f"{rotation.shape[-1]}] for its key rotation {tuple(rotation.shape)}"
                )
            if not (torch.isfinite(scales).all() and (scales > 0).all()):
                raise RotationFileError(f"key smoothing of layer {i} holds values that are not finite and positive")

    def _check_metadata(self) -> None:
        """The metadata that changes what a cache does (clip ratios, their code width, the retrieval ranking) must
        parse, so that a malformed file fails when it is loaded, not when a cache first asks for it."""
        try:
            recorded_clip_ratios(self.metadata)
        except (KeyError, ValueError, TypeError) as error:
            raise RotationFileError(f"the rotations' recorded clip ratios are unreadable: {error!r}") from error
        try:
            recorded_clip_bits(self.metadata)
        except ValueError as error:
            raise RotationFileError(f"the rotations' recorded clip_bits are unreadable: {error!r}") from error
        self.retrieval_layers()
        self.retrieval_heads()

    def check_model(self, layer_ids: list[int], head_dim: int, num_kv_heads: int) -> None:
        """Raise `RotationFileError` unless the rotations cover exactly the model's full-attention layers `layer_ids`
        (no more: a deeper model's file would give each layer another layer's rotation), with its `head_dim`, and its
        KV-head count wherever they hold one matrix (or smoothing scale) per KV head. The error says which shape
        the rotations have and which the model has."""
        problem = self._model_mismatch(layer_ids, head_dim, num_kv_heads)
        if problem is not None:
            raise RotationFileError(
                f"{problem}: they were made for another model (rotations: {self._shape_text()}; model: full-attention "
                f"layers {_ranges(layer_ids)}, head_dim {head_dim}, {num_kv_heads} KV heads)"
            )

    def _model_mismatch(self, layer_ids: list[int], head_dim: int, num_kv_heads: int) -> str | None:
        """What does not fit the model's shape (see `check_model`), or None."""
        missing = sorted(set(layer_ids) - set(self.key))
        extra = sorted(set(self.key) - set(layer_ids))
        if missing or extra:
            details = ([f"missing {_ranges(missing)}"] if missing else []) + (
                [f"{_ranges(extra)} not among them"] if extra else [])
            return (f"the rotations cover layers {_ranges(self.layer_ids)} but the model's full-attention layers are "
                    f"{_ranges(layer_ids)} ({', '.join(details)})")
        if self.head_dim != head_dim:
            return f"the rotations are {self.head_dim}x{self.head_dim} but the model's head_dim is {head_dim}"
        for kind, table in (("key", self.key), ("value", self.value)):
            for i in layer_ids:
                if table[i].dim() == 3 and table[i].shape[0] != num_kv_heads:
                    return (f"{kind} rotation of layer {i} has {table[i].shape[0]} per-head matrices but the model "
                            f"has {num_kv_heads} KV heads")
        wrong = sorted(i for i, s in self.key_smoothing.items() if i in layer_ids and s.shape[0] != num_kv_heads)
        if wrong:
            return (f"key smoothing of layers {wrong} has scales for another number of KV heads than this model's "
                    f"{num_kv_heads}")
        return None

    def _shape_text(self) -> str:
        """The model shape the rotations were made for, as far as they tell: layers, head_dim, KV heads."""
        per_head = [r for r in (*self.key.values(), *self.value.values()) if r.dim() == 3]
        heads = f"{per_head[0].shape[0]} KV heads" if per_head else "one matrix per layer for every KV head"
        return f"{len(self.key)} layers {_ranges(self.layer_ids)}, head_dim {self.head_dim}, {heads}"

    def __repr__(self) -> str:
        kind = "per KV head" if self.per_head else "shared per layer"
        objective = self.metadata.get("objective", "?")
        smoothed = f", keys smoothed in {len(self.key_smoothing)} layers" if self.key_smoothing else ""
        return f"Rotations({len(self.key)} layers, head_dim={self.head_dim}, {kind}, objective={objective}{smoothed})"


def recorded_clip_ratios(metadata: Mapping[str, str]):
    """(key, value) clip ratios a clip search recorded in rotations metadata, or None when there are none.

    Each side is one ratio for every layer (`key_clip_ratio` / `value_clip_ratio`: a JSON number or null) or a
    `{layer: ratio}` dict (`key_clip_ratios` / `value_clip_ratios`: JSON objects). Raises ValueError (or
    KeyError / TypeError) on malformed entries or ratios outside (0, 1].
    """
    if "key_clip_ratios" in metadata:
        return tuple(_ratio_table(json.loads(metadata[f"{side}_clip_ratios"])) for side in ("key", "value"))
    if "key_clip_ratio" in metadata:
        return tuple(_ratio(json.loads(metadata[f"{side}_clip_ratio"])) for side in ("key", "value"))
    return None


def recorded_clip_bits(metadata: Mapping[str, str]) -> int:
    """The code width recorded clip ratios were chosen for: `clip_bits`, or 2 for files written before it was
    recorded (every clip search then ran at 2 bits)."""
    bits = int(metadata.get("clip_bits", DEFAULT_CLIP_BITS))
    if bits < 1:
        raise ValueError(f"clip_bits {bits} is not a code width")
    return bits


def _ratio_table(table) -> dict[int, float | None]:
    if not isinstance(table, dict):
        raise ValueError(f"per-layer clip ratios are {table!r:.80}; expected a JSON object {{layer: ratio}}")
    return {int(i): _ratio(r) for i, r in table.items()}


def _ratio(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"clip ratio {value!r:.80} is not a number")
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"clip ratio {value} outside (0, 1]")
    return value


def _layer_ranking(ranking) -> list[int]:
    """A recorded retrieval ranking: distinct layer indices (a JSON string or number would iterate or fail)."""
    if not isinstance(ranking, list) or not all(type(i) is int for i in ranking):
        raise ValueError(f"expected a JSON list of layer indices, got {ranking!r:.80}")
    if len(set(ranking)) != len(ranking):
        raise ValueError(f"layers listed more than once in {ranking}")
    return ranking


def _head_ranking(ranking) -> list[tuple[int, int]]:
    """A recorded per-head ranking: distinct [layer, KV head] pairs of integers >= 0."""
    if not isinstance(ranking, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(i) is int and i >= 0 for i in p) for p in ranking):
        raise ValueError(f"expected a JSON list of [layer, KV head] pairs, got {ranking!r:.80}")
    pairs = [(layer, head) for layer, head in ranking]
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"heads listed more than once in {ranking!r:.80}")
    return pairs


def _float_table(what: str, table) -> dict[int, torch.Tensor]:
    """`{layer: float32 tensor}`. Only floating-point tensors are taken: `.float()` would turn integer, boolean or
    complex data (the last dropping its imaginary part) into something that passes for a rotation."""
    if not isinstance(table, Mapping):
        raise RotationFileError(
            f"the {what} table is of type {type(table).__name__}; expected a dict {{layer: tensor}}"
        )
    floats = {}
    for key, t in table.items():
        layer = _layer_index(what, key)
        if not isinstance(t, torch.Tensor):
            raise RotationFileError(f"{what} of layer {layer} is of type {type(t).__name__}; expected a tensor")
        if not t.is_floating_point():
            raise RotationFileError(f"{what} of layer {layer} has dtype {t.dtype}; expected floating point (float32)")
        if layer in floats:
            raise RotationFileError(f"the {what} table names layer {layer} twice")
        floats[layer] = t.float()
    return floats


def _or_empty(table):
    """`{}` for None; not `table or {}`, which asks a tensor passed by mistake for its truth value."""
    return {} if table is None else table


def _layer_index(what: str, key) -> int:
    """A non-negative layer index from an int-like key (or a string of digits); not bool, float or a tensor of
    several values."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    try:
        layer = None if isinstance(key, bool) else operator.index(key)
    except TypeError:
        layer = None
    if layer is None or layer < 0:
        raise RotationFileError(f"the {what} table has layer key {key!r:.80}; expected a non-negative integer")
    return layer


def _ranges(ids: list[int]) -> str:
    """Compact text for a list of layer ids, e.g. [0, 1, 2, 5] -> '0-2, 5'."""
    ids = sorted(ids)
    parts, start = [], None
    for k, i in enumerate(ids):
        if start is None:
            start = i
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            parts.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(parts) if parts else "none"
