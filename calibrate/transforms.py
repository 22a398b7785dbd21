"""Experimental: non-orthogonal key transforms balanced between the query and key statistics.

Scores are invariant under `q · k = (q A⁻ᵀ) · (k A)` for any invertible `A`, so the cache may store `Q(k A)` and
attend with `q A⁻ᵀ`. With a per-row uniform quantizer after an equalizing rotation, the key error `ε` of `y = k A`
is roughly isotropic with `E‖ε‖² ∝ tr(Aᵀ Σ_K A)`, and the score error is

    E[(q A⁻ᵀ · ε)²] ≈ E‖ε‖²/d · tr(A⁻¹ Σ_Q A⁻ᵀ)  ∝  tr(M Σ_K) · tr(M⁻¹ Σ_Q),   M = A Aᵀ.

An orthogonal `A` (any rotation, `M = I`) gives `tr Σ_K · tr Σ_Q`. The minimum over `M ≻ 0` is
`(tr (Σ_K^½ Σ_Q Σ_K^½)^½)²`, at `M* = Σ_K^-½ (Σ_K^½ Σ_Q Σ_K^½)^½ Σ_K^-½` (the geometric mean of `Σ_K⁻¹` and `Σ_Q`).
`balanced_key_transform` returns `A = M*^½ · U' · H` (U' the eigenbasis of the transformed key covariance, so the
coordinates of `y` also get equal variance, as `U · H` does for a rotation) and the query-side `A⁻ᵀ`.

`OscarCache` applies orthogonal rotations only (`x @ R`, queries `q @ R`, `Rᵀ` to undo): using these transforms
in the cache needs a core change (a separate query transform). The probe (`attention_error.Candidate`) can
measure them as they are.
"""

from __future__ import annotations

import torch

from oscar_hf.rotations.math import hadamard_matrix


def _sym_power(matrix: torch.Tensor, power: float, floor: float = 1e-12) -> torch.Tensor:
    values, vectors = torch.linalg.eigh((matrix + matrix.transpose(-1, -2)) / 2)
    values = values.clamp_min(floor * values.abs().max())
    return vectors @ torch.diag_embed(values**power) @ vectors.transpose(-1, -2)


def balanced_metric(query_moment: torch.Tensor, key_moment: torch.Tensor) -> torch.Tensor:
    """`M* = Σ_K^-½ (Σ_K^½ Σ_Q Σ_K^½)^½ Σ_K^-½` in float64 (`[..., d, d]` stacks allowed)."""
    sq, sk = query_moment.to(torch.float64), key_moment.to(torch.float64)
    root, inverse_root = _sym_power(sk, 0.5), _sym_power(sk, -0.5)
    return inverse_root @ _sym_power(root @ sq @ root, 0.5) @ inverse_root


def predicted_gain(query_moment: torch.Tensor, key_moment: torch.Tensor) -> torch.Tensor:
    """Predicted score-error ratio (balanced transform / any rotation): `(tr (Σ_K^½ Σ_Q Σ_K^½)^½)² / (tr Σ_K tr Σ_Q)`."""
    sq, sk = query_moment.to(torch.float64), key_moment.to(torch.float64)
    root = _sym_power(sk, 0.5)
    inner = _sym_power(root @ sq @ root, 0.5)
    trace = torch.diagonal(inner, dim1=-2, dim2=-1).sum(-1)
    return trace**2 / (torch.diagonal(sk, dim1=-2, dim2=-1).sum(-1) * torch.diagonal(sq, dim1=-2, dim2=-1).sum(-1))


def balanced_key_transform(query_moment: torch.Tensor, key_moment: torch.Tensor, strength: float = 1.0):
    """(A, A⁻ᵀ) float32 for `[d, d]` or `[Hkv, d, d]` moments; keys are stored as `k A`, queries use `q A⁻ᵀ`.

    `strength` in [0, 1] interpolates `M = M*^strength` (0: a plain `U_K · H` rotation of the keys).
    """
    metric = balanced_metric(query_moment, key_moment)
    metric = metric / torch.diagonal(metric, dim1=-2, dim2=-1).mean(-1)[..., None, None]  # scale-free
    half = _sym_power(metric, 0.5 * strength)
    inverse_half = _sym_power(metric, -0.5 * strength)
    transformed_keys = half @ key_moment.to(torch.float64) @ half
    _, vectors = torch.linalg.eigh((transformed_keys + transformed_keys.transpose(-1, -2)) / 2)
    hadamard = hadamard_matrix(key_moment.shape[-1])
    forward = half @ vectors @ hadamard
    query_side = inverse_half @ vectors @ hadamard  # (M^½ U H)⁻ᵀ = M^-½ U H
    return forward.float(), query_side.float()
