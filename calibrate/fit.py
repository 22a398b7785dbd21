"""From second moments to rotations: `eigh` in float64, then `R = U · H · P_bitrev` (`oscar_hf.rotation`).

Shared rotations (RotationZoo format v1) eigendecompose the mean of the KV heads' moments, as the reference does;
per-head rotations (format v2) eigendecompose each head's own moment.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from oscar_hf.rotations.math import compose_rotation
from oscar_hf.rotations.rotations import Rotations


def eigenbasis(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvectors as columns, ascending eigenvalues) of a symmetric `[..., d, d]` matrix, float64."""
    m = moment.to(torch.float64)
    m = (m + m.transpose(-1, -2)) / 2
    if not torch.isfinite(m).all():
        raise ValueError("the second moment holds NaN or infinite values (did the model overflow in its dtype?)")
    eigenvalues, eigenvectors = torch.linalg.eigh(m)
    return eigenvectors, eigenvalues


def rotation_from_moment(moment: torch.Tensor, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, eigenvalues) from a KV-head stack of moments `[Hkv, d, d]`.

    Shared: `R` `[d, d]`, eigenvalues `[d]` of the head mean. Per head: `[Hkv, d, d]` and `[Hkv, d]`.
    """
    if moment.dim() != 3 or moment.shape[-1] != moment.shape[-2]:
        raise ValueError(f"expected moments of shape [kv_heads, d, d], got {tuple(moment.shape)}")
    target = moment if per_head else moment.mean(dim=0)
    vectors, values = eigenbasis(target)
    return compose_rotation(vectors, values), values


def hadamard_rotation(head_dim: int, kv_heads: int, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-free `R = I · H · P_bitrev` with unit eigenvalues (the reference's `hadamard` objective)."""
    values = torch.ones(head_dim, dtype=torch.float64)
    rotation = compose_rotation(torch.eye(head_dim, dtype=torch.float64), values)
    if per_head:
        return rotation.expand(kv_heads, -1, -1).clone(), values.expand(kv_heads, -1).clone()
    return rotation, values


def fit_rotations(
    key_moments: Mapping[int, torch.Tensor] | None,
    value_moments: Mapping[int, torch.Tensor] | None,
    layer_ids,
    head_dim: int,
    kv_heads: int,
    per_head: bool,
    metadata: Mapping[str, str] | None = None,
) -> Rotations:
    """`Rotations` for `layer_ids`; a `None` moment table means the data-free Hadamard for that side."""
    tables = {"key": {}, "value": {}, "key_eigenvalues": {}, "value_eigenvalues": {}}
    for side, moments in (("key", key_moments), ("value", value_moments)):
        for i in layer_ids:
            if moments is None:
                rotation, values = hadamard_rotation(head_dim, kv_heads, per_head)
            else:
                rotation, values = rotation_from_moment(moments[i], per_head)
            tables[side][i] = rotation.float()
            tables[f"{side}_eigenvalues"][i] = values.float()
    return Rotations(**tables, metadata=metadata)
