"""Rotation files on disk: this library's safetensors format and the OSCAR RotationZoo `.pt` schema.

RotationZoo schema (one file for keys, one for values)::

    {"format_version": 1 | 2, "objective": str, "source_grouping": "layer" | "kv_head",
     "layers": {layer_id: {"layer_id": int, "rotation": float32 [d, d] (v1) or [Hkv, d, d] (v2),
                           "eigenvalues": float32 [d] or [Hkv, d] (ascending)}},
     "metadata": {str: str}}  # optional, written by oscar-hf

Files are named `k_rotation_<objective>.pt` / `v_rotation_<objective>.pt`, the objective being
`<hessian>_<composition>` (`qqt_r_h_pbr`, `sst_r_h_pbr`, ...) or `hadamard`. `metadata` is oscar-hf's extension:
the provenance and clip ratios that our safetensors metadata holds, in both files of a pair. The reference loader
(SGLang's `load_oscar_rotations`) reads only `layers[i]["rotation"]`, so it loads these files unchanged; it takes
one clip pair from its environment (`SGLANG_OSCAR_K_CLIP_RATIO` / `SGLANG_OSCAR_V_CLIP_RATIO`), never from the file.

Our format: `oscar_rotations.safetensors` with tensors `key.<layer>`, `value.<layer>` (and optionally
`key_eigenvalues.<layer>`, `value_eigenvalues.<layer>`, and `key_smoothing.<layer>`: per-channel key scales
`[kv_heads, d]`, which RotationZoo files cannot hold); provenance in the safetensors metadata.

Files are read into plain tables (`RotationTables`: tensors by layer, and string metadata) and written from them;
`rotations.Rotations` checks what they hold. `.pt` files are read with `torch.load(weights_only=True)`: tensors and
plain containers only, never arbitrary pickled code.
"""

from __future__ import annotations

import glob
import os
import pickle
import re

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers.utils import logging

logger = logging.get_logger(__name__)

SAFETENSORS_NAME = "oscar_rotations.safetensors"
CONFIG_NAME = "oscar_config.json"  # what `OscarCache.save_pretrained` writes beside the rotations
FORMAT_TAG = "oscar-hf-rotations"
ZOO_KEY_PATTERN = "k_rotation*.pt"
ZOO_VALUE_PATTERN = "v_rotation*.pt"
TABLES = ("key", "value", "key_eigenvalues", "value_eigenvalues", "key_smoothing")
ZOO_GROUPINGS = ("layer", "kv_head")
ZOO_COMPOSITION = "r_h_pbr"  # R = U · H · P_bitrev, the only composition this library fits
ZOO_METADATA = "metadata"
_CLIP_FIELDS = {"key": ("key_clip_ratio", "key_clip_ratios"), "value": ("value_clip_ratio", "value_clip_ratios")}
_LAYER_INDEX = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() also accepts '²', which int() refuses

# {"key": {layer: tensor}, "value": ..., "key_eigenvalues": ..., "value_eigenvalues": ..., "metadata": {str: str}}
RotationTables = dict


class RotationFileError(ValueError):
    """A rotation file or folder is missing, corrupt, unsafe, or does not fit the model."""


def load_rotation_path(path: str | os.PathLike) -> RotationTables:
    """Read rotations from a folder (either format) or from a single `.safetensors` file."""
    files = _rotation_files(path)
    return load_safetensors(files[0]) if len(files) == 1 else load_zoo(*files)


def rotation_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The provenance `load_rotation_path(path)` would return, without reading an oscar-hf file's tensors (its
    safetensors header holds it; a RotationZoo pair is read whole)."""
    files = _rotation_files(path)
    if len(files) == 2:
        return load_zoo(*files)["metadata"]
    return _safetensors_metadata(files[0])


def _rotation_files(path: str | os.PathLike) -> tuple[str] | tuple[str, str]:
    """The one `.safetensors` file, or the (key, value) RotationZoo pair, that `path` names."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return (path,)
        raise RotationFileError(
            f"{path} is a single file; a RotationZoo set is two files (k_rotation*.pt and v_rotation*.pt): "
            "pass the folder that holds both"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no rotation file or folder at {path}")
    ours = os.path.join(path, SAFETENSORS_NAME)
    if os.path.isfile(ours):
        return (ours,)
    keys = sorted(glob.glob(os.path.join(path, ZOO_KEY_PATTERN)))
    values = sorted(glob.glob(os.path.join(path, ZOO_VALUE_PATTERN)))
    if len(keys) == 1 and len(values) == 1:
        return keys[0], values[0]
    if not keys and not values:
        raise RotationFileError(
            f"{path} holds no rotations: expected {SAFETENSORS_NAME} or a RotationZoo pair "
            f"({ZOO_KEY_PATTERN} and {ZOO_VALUE_PATTERN})"
        )
    raise RotationFileError(
        f"{path} does not hold exactly one RotationZoo pair: key files {[os.path.basename(k) for k in keys]}, "
        f"value files {[os.path.basename(v) for v in values]}; use load_zoo(key_file, value_file)"
    )


# ------------------------------------------------------------------------------------------- safetensors
def save_safetensors(tables: RotationTables, folder: str | os.PathLike) -> str:
    """Write `folder/oscar_rotations.safetensors`; returns its path."""
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for prefix in TABLES:
        for i, t in tables.get(prefix, {}).items():
            tensors[f"{prefix}.{i}"] = t.detach().to("cpu", torch.float32).contiguous().clone()
    metadata = {**tables.get("metadata", {}), "format": FORMAT_TAG, "format_version": "1"}
    path = os.path.join(folder, SAFETENSORS_NAME)
    save_file(tensors, path, metadata=metadata)
    return path


def _safetensors_metadata(path: str) -> dict[str, str]:
    """An oscar-hf rotation file's metadata from its header, the format tag and version checked and dropped."""
    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise RotationFileError(f"{path} is not a readable safetensors file: {e}") from e
    if metadata.get("format") != FORMAT_TAG:
        raise RotationFileError(
            f"{path} is a safetensors file but not an oscar-hf rotation file (no '{FORMAT_TAG}' tag)"
        )
    if metadata.get("format_version", "1") != "1":
        raise RotationFileError(
            f"{path}: unsupported format_version {metadata['format_version']!r} (this library reads version '1'); "
            "it was written by a newer oscar-hf"
        )
    metadata.pop("format", None)
    metadata.pop("format_version", None)
    return metadata


def load_safetensors(path: str) -> RotationTables:
    metadata = _safetensors_metadata(path)
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise RotationFileError(f"{path} is not a readable safetensors file: {e}") from e
    tables: dict[str, dict[int, torch.Tensor]] = {name: {} for name in TABLES}
    for name, t in tensors.items():
        prefix, _, layer = name.rpartition(".")
        if prefix not in tables or not _LAYER_INDEX.fullmatch(layer):
            raise RotationFileError(f"{path}: unexpected tensor name {name!r} (expected <table>.<layer>, table one of "
                                    f"{', '.join(TABLES)})")
        if int(layer) in tables[prefix]:
            raise RotationFileError(f"{path}: two tensors name {prefix} layer {int(layer)} (tensor {name!r})")
        tables[prefix][int(layer)] = t
    return {**tables, "metadata": metadata}


# ------------------------------------------------------------------------------------------- RotationZoo
def safe_torch_load(path: str):
    """`torch.load(weights_only=True)`: tensors and plain containers only, never arbitrary pickled code.

    A corrupt file makes torch's unpickler fail with whatever it trips on (struct.error, UnicodeDecodeError,
    IndexError, KeyError, AssertionError, EOFError, ...), so every failure is reported as an unreadable file.
    """
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise RotationFileError(f"{path} is empty (0 bytes): not a rotation file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line), "")
        raise RotationFileError(
            f"{path} could not be loaded safely: it is not a torch file of tensors and plain containers, and "
            f"arbitrary pickled objects are never unpickled (torch.load weights_only=True). {detail}"
        ) from e
    except Exception as e:
        raise RotationFileError(f"{path} is not a readable torch file: {_reason(e)}") from e


def _reason(error: Exception) -> str:
    """The error's type and message; some (EOFError from a truncated file) have a blank message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else f"{type(error).__name__} (truncated, or not a torch file)"


def load_zoo_file(path: str) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], str, dict[str, str]]:
    """(rotations by layer, eigenvalues by layer, objective, metadata) from one RotationZoo `.pt` file (metadata
    `{}` for the reference's files, which have none).

    The file's structure is checked here (what the schema says each field is); the tensors' shapes, dtypes and
    orthogonality are checked by `Rotations`.
    """
    state = safe_torch_load(path)
    if not isinstance(state, dict) or "layers" not in state:
        raise RotationFileError(f"{path} is not a RotationZoo file: expected a dict with a 'layers' entry")
    version = _zoo_version(path, state)
    objective = _zoo_text(path, state, "objective")
    grouping = _zoo_text(path, state, "source_grouping")
    metadata = _zoo_metadata(path, state)
    if grouping is not None and grouping not in ZOO_GROUPINGS:
        raise RotationFileError(f"{path}: source_grouping {grouping!r} is not one of {ZOO_GROUPINGS}")
    layers = state["layers"]
    if not isinstance(layers, dict):
        raise RotationFileError(
            f"{path}: 'layers' is of type {type(layers).__name__}; expected a dict {{layer: entry}}"
        )
    if not layers:
        raise RotationFileError(f"{path}: 'layers' is empty; a rotation file holds at least one layer")
    rotations, eigenvalues, keys = {}, {}, {}
    for key, entry in layers.items():
        layer = _zoo_layer(path, key, entry)
        if layer in keys:
            raise RotationFileError(
                f"{path}: layer {layer} appears twice in 'layers' (keys {keys[layer]!r} and {key!r})"
            )
        keys[layer] = key
        rotation = entry["rotation"]
        if version == 1 and rotation.dim() != 2:
            raise RotationFileError(
                f"{path}: format_version 1 stores one [d, d] rotation per layer, layer {layer} has "
                f"{tuple(rotation.shape)}"
            )
        rotations[layer] = rotation
        if entry.get("eigenvalues") is not None:
            eigenvalues[layer] = entry["eigenvalues"]
    return rotations, eigenvalues, "unknown" if objective is None else objective, metadata


def _zoo_metadata(path: str, state: dict) -> dict[str, str]:
    metadata = state.get(ZOO_METADATA)
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise RotationFileError(f"{path}: {ZOO_METADATA} is {metadata!r:.80}; expected a dict {{str: str}}")
    return dict(metadata)


def _zoo_version(path: str, state: dict) -> int:
    version = state.get("format_version")
    if type(version) is not int or version not in (1, 2):  # not bool (True == 1), float or tensor
        raise RotationFileError(f"{path}: unsupported format_version {version!r} (expected 1 or 2)")
    return version


def _zoo_text(path: str, state: dict, field: str) -> str | None:
    value = state.get(field)
    if value is not None and not isinstance(value, str):
        raise RotationFileError(f"{path}: {field} is {value!r:.80} (of type {type(value).__name__}); expected a string")
    return value


def _zoo_layer(path: str, key, entry) -> int:
    """The layer index of a `layers` entry, after checking the entry holds what the schema says."""
    if isinstance(key, str) and _LAYER_INDEX.fullmatch(key):
        layer = int(key)
    elif type(key) is int and key >= 0:  # not bool, float (1.5 would truncate) or tensor
        layer = key
    else:
        raise RotationFileError(f"{path}: layer key {key!r:.80} is not a non-negative integer")
    if not isinstance(entry, dict) or not isinstance(entry.get("rotation"), torch.Tensor):
        raise RotationFileError(f"{path}: layer {key!r} has no 'rotation' tensor")
    layer_id = entry.get("layer_id", layer)
    if type(layer_id) is not int or layer_id != layer:
        raise RotationFileError(f"{path}: layer {key!r} says its layer_id is {layer_id!r:.80}")
    eigenvalues = entry.get("eigenvalues")
    if eigenvalues is not None and not isinstance(eigenvalues, torch.Tensor):
        raise RotationFileError(
            f"{path}: the eigenvalues of layer {key!r} are of type {type(eigenvalues).__name__}; expected a tensor"
        )
    return layer


def load_zoo(key_file: str, value_file: str) -> RotationTables:
    """The tables of a RotationZoo pair of files."""
    key, key_ev, key_objective, key_metadata = load_zoo_file(key_file)
    value, value_ev, value_objective, value_metadata = load_zoo_file(value_file)
    metadata = pair_metadata(key_metadata, value_metadata, key_objective, value_objective, f"{key_file}, {value_file}")
    return {"key": key, "value": value, "key_eigenvalues": key_ev, "value_eigenvalues": value_ev,
            "metadata": metadata}


def pair_metadata(key_metadata: dict[str, str], value_metadata: dict[str, str], key_objective: str,
                  value_objective: str, source: str) -> dict[str, str]:
    """The metadata of a key file and a value file read as one set.

    The files' own `objective` fields say what they hold (`objective`: `key=<k>,value=<v>`); a recorded calibration
    objective (`key_objective`, `value_objective`) that names another one is dropped. A pair written together
    carries the same metadata in both files, and that is the set's. A pair mixed from two calibrations keeps the
    key file's provenance; clip ratios are kept only when both files record them in the same form for the same
    code width, and dropped with a warning otherwise (the cache then applies its preset's ratios).
    """
    own = {"key": (key_metadata, key_objective), "value": (value_metadata, value_objective)}
    if key_metadata == value_metadata:
        merged = dict(key_metadata)
    else:
        clip_fields = {name for names in _CLIP_FIELDS.values() for name in names} | {"clip_bits"}
        merged = {k: v for k, v in {**value_metadata, **key_metadata}.items() if k not in clip_fields}
        for side, (metadata, _) in own.items():
            merged.pop(f"{side}_objective", None)
            if f"{side}_objective" in metadata:
                merged[f"{side}_objective"] = metadata[f"{side}_objective"]
        merged.update(_pair_clip_ratios(key_metadata, value_metadata, source))
    for side, (_, objective) in own.items():
        if f"{side}_objective" in merged and zoo_objective(merged[f"{side}_objective"]) != objective:
            del merged[f"{side}_objective"]
    return {**merged, "objective": f"key={key_objective},value={value_objective}", "source": "rotationzoo"}


def _pair_clip_ratios(key_metadata: dict[str, str], value_metadata: dict[str, str], source: str) -> dict[str, str]:
    """The clip-ratio entries of a mixed pair: the key side's from the key file, the value side's from the value
    file, when they make one pair; none (with a warning) when they do not."""
    key_clip = [name for name in _CLIP_FIELDS["key"] if name in key_metadata]
    value_clip = [name for name in _CLIP_FIELDS["value"] if name in value_metadata]
    same_form = [n.replace("key_", "", 1) for n in key_clip] == [n.replace("value_", "", 1) for n in value_clip]
    if key_clip and same_form and key_metadata.get("clip_bits") == value_metadata.get("clip_bits"):
        ratios = {name: key_metadata[name] for name in key_clip}
        ratios.update({name: value_metadata[name] for name in value_clip})
        if "clip_bits" in key_metadata:
            ratios["clip_bits"] = key_metadata["clip_bits"]
        return ratios
    if key_clip or value_clip:
        logger.warning(
            f"{source}: the key file records clip ratios {key_clip or 'none'} (clip_bits "
            f"{key_metadata.get('clip_bits', 'unset')}), the value file {value_clip or 'none'} (clip_bits "
            f"{value_metadata.get('clip_bits', 'unset')}); they do not make one pair, so none are kept and the "
            "cache applies its preset's clip ratios"
        )
    return {}


def zoo_state(rotations: dict[int, torch.Tensor], eigenvalues: dict[int, torch.Tensor], objective: str,
              metadata: dict[str, str] | None = None) -> dict:
    """One RotationZoo file's contents (format v1 for shared rotations, v2 per KV head), with `metadata` when given."""
    per_head = any(r.dim() == 3 for r in rotations.values())
    layers = {}
    for i, r in sorted(rotations.items()):
        ev = eigenvalues.get(i)
        if ev is None:
            ev = torch.ones(r.shape[:-1], dtype=torch.float32)
        layers[i] = {
            "layer_id": i,
            "rotation": r.detach().to("cpu", torch.float32).contiguous().clone(),
            "eigenvalues": ev.detach().to("cpu", torch.float32).contiguous().clone(),
        }
    state = {
        "format_version": 2 if per_head else 1,
        "objective": objective,
        "source_grouping": "kv_head" if per_head else "layer",
        "layers": layers,
    }
    if metadata:
        state[ZOO_METADATA] = {str(k): str(v) for k, v in metadata.items()}
    return state


def zoo_objective(name: str) -> str:
    """The RotationZoo objective of a calibration objective: `<name>_r_h_pbr` (`qqt` -> `qqt_r_h_pbr`), or the
    name itself for `hadamard` and for names that already carry the composition."""
    if name == "hadamard" or name.endswith(f"_{ZOO_COMPOSITION}"):
        return name
    return f"{name}_{ZOO_COMPOSITION}"


def zoo_objectives(metadata: dict[str, str]) -> tuple[str, str]:
    """(key objective, value objective) of the RotationZoo files for rotations with this metadata.

    From the calibration objectives (`key_objective` / `value_objective`) when recorded, else from `objective`
    (`key=<k>,value=<v>` as a loaded pair records it, or one name for both sides, e.g. `hadamard`), else "unknown".
    """
    if "key_objective" in metadata and "value_objective" in metadata:
        return zoo_objective(metadata["key_objective"]), zoo_objective(metadata["value_objective"])
    objective = metadata.get("objective", "")
    pair = re.fullmatch(r"key=(.+),value=(.+)", objective)
    if pair:
        return pair.group(1), pair.group(2)
    return (objective, objective) if objective else ("unknown", "unknown")


def save_zoo(tables: RotationTables, folder: str | os.PathLike, key_objective: str | None = None,
             value_objective: str | None = None) -> tuple[str, str]:
    """Write RotationZoo-format `k_rotation_<obj>.pt` / `v_rotation_<obj>.pt`; returns both paths.

    The objectives default to what the metadata records (`zoo_objectives`); both files carry the metadata.
    """
    recorded = zoo_objectives(tables.get("metadata", {}))
    key_objective = recorded[0] if key_objective is None else key_objective
    value_objective = recorded[1] if value_objective is None else value_objective
    metadata = tables.get("metadata", {})
    os.makedirs(folder, exist_ok=True)
    key_path = os.path.join(folder, f"k_rotation_{_file_name(key_objective)}.pt")
    value_path = os.path.join(folder, f"v_rotation_{_file_name(value_objective)}.pt")
    torch.save(zoo_state(tables["key"], tables.get("key_eigenvalues", {}), key_objective, metadata), key_path)
    torch.save(zoo_state(tables["value"], tables.get("value_eigenvalues", {}), value_objective, metadata), value_path)
    return key_path, value_path


def _file_name(objective: str) -> str:
    """An objective as a file-name part: characters other than letters, digits, `_`, `.` and `-` become `-`."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", objective).strip("-.") or "unknown"
