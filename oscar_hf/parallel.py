"""Tensor parallelism: which KV heads this rank holds, so per-head rotations can be sliced to them.

transformers' `tp_plan="auto"` shards k_proj/v_proj column-wise, so rank r of a TP group of size W holds the
contiguous KV heads [r * Hkv / W, (r + 1) * Hkv / W); shared `[d, d]` rotations need no slicing.
"""

from __future__ import annotations

import dataclasses

import torch

from oscar_hf.config import OscarConfig


def tensor_parallel_position(model) -> tuple[int, int]:
    """(rank, size) of this process in the model's tensor-parallel group; (0, 1) without TP."""
    size = getattr(model, "_tp_size", None) or 1
    mesh = getattr(model, "_device_mesh", None)
    if size <= 1 or mesh is None:
        return 0, 1
    names = mesh.mesh_dim_names or ()
    group = mesh["tp"] if "tp" in names else mesh
    return group.get_local_rank(), group.size()


def local_heads(rotation: torch.Tensor | None, rank: int, size: int) -> torch.Tensor | None:
    """The slice of a per-KV-head rotation `[Hkv, d, d]` held by `rank`; shared rotations pass through."""
    if rotation is None or rotation.dim() == 2 or size == 1:
        return rotation
    heads = rotation.shape[0]
    if heads % size:
        raise ValueError(f"{heads} per-head rotations cannot be split over {size} tensor-parallel ranks")
    per_rank = heads // size
    return rotation[rank * per_rank : (rank + 1) * per_rank]


def local_head_config(config: OscarConfig, rank: int, size: int, num_kv_heads: int) -> OscarConfig:
    """`config` (one layer's) with its `high_precision_heads` renumbered to the KV heads `rank` holds; the heads of
    other ranks are left out."""
    if size == 1 or not config.high_precision_heads:
        return config
    per_rank = num_kv_heads // size
    first = rank * per_rank
    local = tuple((layer, head - first) for layer, head in config.high_precision_heads
                  if first <= head < first + per_rank)
    return dataclasses.replace(config, high_precision_heads=local)
