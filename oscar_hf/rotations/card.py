"""The model card of a rotations folder: `huggingface_hub.ModelCard` with `ModelCardData` (library, tags,
`base_model`), a usage snippet and a provenance table of every metadata entry."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from oscar_hf.rotations.hub import looks_like_repo_id

LIBRARY_NAME = "oscar-hf"
TAGS = ["oscar", "kv-cache-quantization", "rotations"]
REFERENCE_URL = "https://github.com/FutureMLS-Lab/OSCAR"

# metadata entry -> provenance row label, in table order; other entries follow under their own names
PROVENANCE_ROWS = (
    ("model", "Model"),
    ("model_revision", "Model revision"),
    ("model_source", "Model source"),
    ("model_type", "Model type"),
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
    ("key_smoothing", "Key smoothing"),
    ("retrieval_ranking", "Retrieval ranking made by"),  # rotations.RETRIEVAL_RANKING_KEY
    ("library", "Library"),
    ("seconds", "Calibration time (s)"),
    ("device", "Device"),
)


def hub_model_id(model: str | None) -> str | None:
    """`model` when it names a Hub repo (`owner/name`, not a local path that exists), else None."""
    if not model or os.path.exists(model) or not looks_like_repo_id(model):
        return None
    return model


def model_card(metadata: Mapping[str, str], repo_id: str | None = None, subfolder: str | None = None,
               local_folder: str | os.PathLike | None = None):
    """A `huggingface_hub.ModelCard` for rotations with this `metadata`.

    `base_model` is the calibrated model's Hub id (absent for a local model, whose path stays out of the title);
    the usage snippet loads from `repo_id` (and `subfolder`) when given, else from `local_folder`. Every non-empty
    metadata entry appears in the provenance table.
    """
    from huggingface_hub import ModelCard, ModelCardData

    base_model = hub_model_id(metadata.get("model"))
    data = ModelCardData(library_name=LIBRARY_NAME, tags=list(TAGS), base_model=base_model)
    if base_model:
        subject = base_model
    else:
        subject = f"a local {metadata['model_type']} model" if metadata.get("model_type") else "a local model"
    source = repo_id or (os.fspath(local_folder) if local_folder is not None else None)
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# OSCAR KV-cache rotations for {subject}", "",
        "Attention-aware rotations (`R = U · H · P_bitrev`, one per layer or per KV head) for 2-bit KV-cache "
        f"quantization with the `{LIBRARY_NAME}` library's `OscarCache`, after OSCAR ([reference implementation]"
        f"({REFERENCE_URL})).",
        "",
    ]
    if source is not None:
        lines += [
            "```python",
            "from oscar_hf import OscarCache",
            f"cache = OscarCache(model, rotations={source!r}" + (f", subfolder={subfolder!r}" if subfolder and repo_id
                                                                 else "") + ")",
            "```",
            "",
        ]
    lines += ["## Recipe", "", _recipe(metadata), ""]
    lines += ["## Provenance", "", "| | |", "|---|---|"]
    shown = {key for key, _ in PROVENANCE_ROWS}
    rows = [(label, metadata.get(key)) for key, label in PROVENANCE_ROWS]
    rows += [(key, metadata[key]) for key in sorted(set(metadata) - shown)]
    lines += [f"| {label} | `{_cell(value)}` |" for label, value in rows if value not in (None, "")]
    lines.append("")
    return ModelCard("\n".join(lines))


def _recipe(metadata: Mapping[str, str]) -> str:
    """One sentence on what the cache gets from these rotations beyond the rotation itself."""
    smoothed = _smoothing(metadata.get("key_smoothing"))
    if metadata.get("retrieval_layers") or metadata.get("retrieval_heads"):
        how = metadata.get("retrieval_ranking", "needle probes")
        ranked = (f"layers and KV heads are ranked by retrieval ({how}), so `OscarCache` stores its ranked 2-bit "
                  "default, `oscar-next` (`oscar-mixed` where only layers are ranked), which keeps the top of the "
                  "ranking at 4 bits")
    else:
        ranked = "no retrieval ranking is recorded, so `OscarCache` stores uniform 2-bit rows (`oscar`)"
    return f"{smoothed}; {ranked}."


def _cell(value: str) -> str:
    """A metadata value as a table cell: pipes escaped, newlines flattened."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _smoothing(described: str | None) -> str:
    """How the keys are smoothed, from the rule the smoothing's metadata records (files made before the rule was
    recorded say only that they are)."""
    if not described:
        return "Keys are not smoothed"
    try:
        rule = json.loads(described).get("rule")
    except (ValueError, AttributeError):
        rule = None
    return f"Keys are smoothed: {rule}" if rule else "Keys are smoothed"
