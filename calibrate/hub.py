"""Model card and Hub upload for a folder of calibrated rotations (`huggingface_hub` upload APIs)."""

from __future__ import annotations

import os
from collections.abc import Mapping

CARD_NAME = "README.md"

_PROVENANCE_ROWS = (
    ("model", "Model"),
    ("model_revision", "Model revision"),
    ("model_source", "Model source"),
    ("data", "Calibration data"),
    ("tokens", "Calibration tokens"),
    ("sequences", "Sequences"),
    ("context", "Context per sequence (tokens)"),
    ("chat_template", "Chat template"),
    ("key_objective", "Key objective"),
    ("value_objective", "Value objective"),
    ("grouping", "Grouping (layer = format v1, kv_head = format v2)"),
    ("tiers", "Counted tokens"),
    ("skip_tokens", "Skipped warm-up tokens per sequence"),
    ("key_clip_ratio", "Key clip ratio"),
    ("value_clip_ratio", "Value clip ratio"),
    ("key_clip_ratios", "Key clip ratios per layer"),
    ("value_clip_ratios", "Value clip ratios per layer"),
    ("encoder", "Row encoder (OscarConfig.encoder)"),
    ("library", "Library"),
    ("seconds", "Calibration time (s)"),
    ("device", "Device"),
)


def model_card(metadata: Mapping[str, str], repo_id: str | None = None, subfolder: str | None = None) -> str:
    """A README.md recording the provenance of the rotations (every metadata entry appears)."""
    model = metadata.get("model", "unknown")
    lines = ["---", "library_name: oscar-hf", "tags:", "- oscar", "- kv-cache-quantization", "- rotations"]
    if "/" in model and not os.path.exists(model):
        lines.append(f"base_model: {model}")
    lines += ["---", "", f"# OSCAR KV-cache rotations for {model}", ""]
    lines += [
        "Attention-aware rotations for 2-bit KV-cache quantization with "
        "[oscar-hf](https://github.com/) (`R = U · H · P_bitrev`, one per layer or per KV head). Load them with:",
        "",
        "```python",
        "from oscar_hf import OscarCache",
        f"cache = OscarCache(model, rotations={repo_id or 'path/to/this/folder'!r}"
        + (f", subfolder={subfolder!r}" if subfolder else "") + ")",
        "```",
        "",
        "## Provenance",
        "",
        "| | |",
        "|---|---|",
    ]
    known = set()
    for key, label in _PROVENANCE_ROWS:
        if key in metadata:
            lines.append(f"| {label} | `{metadata[key]}` |")
            known.add(key)
    for key in sorted(set(metadata) - known):
        lines.append(f"| {key} | `{metadata[key]}` |")
    lines.append("")
    return "\n".join(lines)


def write_model_card(folder: str | os.PathLike, metadata: Mapping[str, str], repo_id: str | None = None,
                     subfolder: str | None = None) -> str:
    path = os.path.join(folder, CARD_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(model_card(metadata, repo_id, subfolder))
    return path


def push_to_hub(folder: str | os.PathLike, repo_id: str, metadata: Mapping[str, str], subfolder: str | None = None,
                private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                commit_message: str | None = None, api=None) -> str:
    """Upload `folder` (rotation files + model card) to `repo_id` (created if missing); returns the commit URL.

    The card goes to the repo root when `subfolder` is None, else into the subfolder next to the files.
    """
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    write_model_card(folder, metadata, repo_id, subfolder)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id, folder_path=os.fspath(folder), path_in_repo=subfolder or "", revision=revision,
        commit_message=commit_message or f"OSCAR rotations for {metadata.get('model', 'a model')}",
        repo_type="model",
    )
    return str(getattr(info, "commit_url", info))
