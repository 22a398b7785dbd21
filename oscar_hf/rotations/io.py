"""Rotation files on disk: this library's safetensors format and the OSCAR RotationZoo `.pt` schema.

RotationZoo schema (one file for keys, one for values)::

    {"format_version": 1 | 2, "objective": str, "source_grouping": "layer" | "kv_head",
     "layers": {layer_id: {"layer_id": int, "rotation": float32 [d, d] (v1) or [Hkv, d, d] (v2),
                           "eigenvalues": float32 [d] or [Hkv, d] (ascending)}}}

Our format: `oscar_rotations.safetensors` with tensors `key.<layer>`, `value.<layer>` (and optionally
`key_eigenvalues.<layer>`, `value_eigenvalues.<layer>`); provenance in the safetensors metadata.

Files are read into plain tables (`RotationTables`: tensors by layer, and string metadata) and written from them;
`rotations.Rotations` checks what they hold. `.pt` files are read with `torch.load(weights_only=True)`: tensors and
plain containers only, never arbitrary pickled code.
"""

from __future__ import annotations

import glob
import os
import pickle

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

SAFETENSORS_NAME = "oscar_rotations.safetensors"
FORMAT_TAG = "oscar-hf-rotations"
ZOO_KEY_PATTERN = "k_rotation*.pt"
ZOO_VALUE_PATTERN = "v_rotation*.pt"
TABLES = ("key", "value", "key_eigenvalues", "value_eigenvalues")

# {"key": {layer: tensor}, "value": ..., "key_eigenvalues": ..., "value_eigenvalues": ..., "metadata": {str: str}}
RotationTables = dict


class RotationFileError(ValueError):
    """A rotation file or folder is missing, corrupt, unsafe, or does not fit the model."""


def load_rotation_path(path: str | os.PathLike) -> RotationTables:
    """Read rotations from a folder (either format) or from a single `.safetensors` file."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return load_safetensors(path)
        raise RotationFileError(
            f"{path} is a single file; a RotationZoo set is two files (k_rotation*.pt and v_rotation*.pt): "
            "pass the folder that holds both"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no rotation file or folder at {path}")
    ours = os.path.join(path, SAFETENSORS_NAME)
    if os.path.isfile(ours):
        return load_safetensors(ours)
    keys = sorted(glob.glob(os.path.join(path, ZOO_KEY_PATTERN)))
    values = sorted(glob.glob(os.path.join(path, ZOO_VALUE_PATTERN)))
    if len(keys) == 1 and len(values) == 1:
        return load_zoo(keys[0], values[0])
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


def load_safetensors(path: str) -> RotationTables:
    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise RotationFileError(f"{path} is not a readable safetensors file: {e}") from e
    if metadata.get("format") != FORMAT_TAG:
        raise RotationFileError(f"{path} is a safetensors file but not an oscar-hf rotation file (no '{FORMAT_TAG}' tag)")
    tables: dict[str, dict[int, torch.Tensor]] = {name: {} for name in TABLES}
    for name, t in tensors.items():
        prefix, _, layer = name.rpartition(".")
        if prefix not in tables or not layer.isdigit():
            raise RotationFileError(f"{path}: unexpected tensor name {name!r}")
        tables[prefix][int(layer)] = t
    metadata.pop("format", None)
    metadata.pop("format_version", None)
    return {**tables, "metadata": metadata}


# ------------------------------------------------------------------------------------------- RotationZoo
def safe_torch_load(path: str):
    """`torch.load(weights_only=True)`: tensors and plain containers only, never arbitrary pickled code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line), "")
        raise RotationFileError(
            f"{path} could not be loaded safely: it is not a torch file of tensors and plain containers, and "
            f"arbitrary pickled objects are never unpickled (torch.load weights_only=True). {detail}"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise RotationFileError(f"{path} is not a readable torch file: {e}") from e


def load_zoo_file(path: str) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], str]:
    """(rotations by layer, eigenvalues by layer, objective) from one RotationZoo `.pt` file."""
    state = safe_torch_load(path)
    if not isinstance(state, dict) or "layers" not in state:
        raise RotationFileError(f"{path} is not a RotationZoo file: expected a dict with a 'layers' entry")
    version = state.get("format_version")
    if version not in (1, 2):
        raise RotationFileError(f"{path}: unsupported format_version {version!r} (expected 1 or 2)")
    rotations, eigenvalues = {}, {}
    for key, entry in state["layers"].items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise RotationFileError(f"{path}: layer key {key!r} is not an integer") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("rotation"), torch.Tensor):
            raise RotationFileError(f"{path}: layer {key!r} has no 'rotation' tensor")
        rotation = entry["rotation"]
        if version == 1 and rotation.dim() != 2:
            raise RotationFileError(
                f"{path}: format_version 1 stores one [d, d] rotation per layer, layer {layer} has {tuple(rotation.shape)}"
            )
        rotations[layer] = rotation
        if isinstance(entry.get("eigenvalues"), torch.Tensor):
            eigenvalues[layer] = entry["eigenvalues"]
    return rotations, eigenvalues, str(state.get("objective", "unknown"))


def load_zoo(key_file: str, value_file: str) -> RotationTables:
    """The tables of a RotationZoo pair of files."""
    key, key_ev, key_objective = load_zoo_file(key_file)
    value, value_ev, value_objective = load_zoo_file(value_file)
    metadata = {"objective": f"key={key_objective},value={value_objective}", "source": "rotationzoo"}
    return {"key": key, "value": value, "key_eigenvalues": key_ev, "value_eigenvalues": value_ev,
            "metadata": metadata}


def zoo_state(rotations: dict[int, torch.Tensor], eigenvalues: dict[int, torch.Tensor], objective: str) -> dict:
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
    return {
        "format_version": 2 if per_head else 1,
        "objective": objective,
        "source_grouping": "kv_head" if per_head else "layer",
        "layers": layers,
    }


def save_zoo(tables: RotationTables, folder: str | os.PathLike, key_objective: str,
             value_objective: str) -> tuple[str, str]:
    """Write RotationZoo-format `k_rotation_<obj>.pt` / `v_rotation_<obj>.pt`; returns both paths."""
    os.makedirs(folder, exist_ok=True)
    key_path = os.path.join(folder, f"k_rotation_{key_objective}.pt")
    value_path = os.path.join(folder, f"v_rotation_{value_objective}.pt")
    torch.save(zoo_state(tables["key"], tables.get("key_eigenvalues", {}), key_objective), key_path)
    torch.save(zoo_state(tables["value"], tables.get("value_eigenvalues", {}), value_objective), value_path)
    return key_path, value_path
