"""Rotation math: Sylvester Hadamard, bit-reversal permutation, `R = U · H · P`, and applying R to rows.

Convention (as in the OSCAR reference): rows are right-multiplied, `x_rot = x @ R`, and un-rotated with `@ R.T`.
"""

from __future__ import annotations

import torch


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalized Sylvester Hadamard `[n, n]`: entries ±1/sqrt(n), symmetric and orthogonal."""
    if not is_power_of_two(n):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got head_dim={n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / h.shape[0] ** 0.5).to(dtype)


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """`br[i]` = i with its log2(d) bits reversed, e.g. d=8 -> [0, 4, 2, 6, 1, 5, 3, 7]."""
    if not is_power_of_two(d):
        raise ValueError(f"bit reversal needs a power-of-two size, got {d}")
    bits = d.bit_length() - 1
    return torch.tensor([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(d)])


def bit_reversal_permutation_matrix(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Column permutation P placing the i-th largest eigen-direction at column `br[i]` (float64 `[d, d]`)."""
    d = eigenvalues.shape[-1]
    order = torch.argsort(eigenvalues.to(torch.float64), descending=True, stable=True)
    perm = torch.empty(d, dtype=torch.long)
    perm[bit_reversal_permutation(d)] = order
    return torch.eye(d, dtype=torch.float64)[:, perm]


def compose_rotation(eigenvectors: torch.Tensor, eigenvalues: torch.Tensor) -> torch.Tensor:
    """`R = U · H · P_bitrev` in float64, from `torch.linalg.eigh` output (columns of U, ascending eigenvalues).

    Works on one `[d, d]` basis or a stack `[..., d, d]` (per KV head).
    """
    if eigenvectors.dim() > 2:
        return torch.stack([compose_rotation(u, ev) for u, ev in zip(eigenvectors, eigenvalues)])
    u = eigenvectors.to(torch.float64)
    return u @ hadamard_matrix(u.shape[-1]) @ bit_reversal_permutation_matrix(eigenvalues)


def rotate(x: torch.Tensor, rotation: torch.Tensor | None, transpose: bool = False) -> torch.Tensor:
    """`x @ R` (or `x @ R.T`) in float32 for `x` `[B, H, T, d]`.

    `rotation` is `[d, d]` (shared by all heads), `[H, d, d]` (one per head), or None (identity: returns
    `x` as float32).
    """
    x = x.float()
    if rotation is None:
        return x
    r = rotation.float()
    if transpose:
        r = r.transpose(-1, -2)
    if r.dim() == 2:
        return x @ r
    return torch.einsum("bhtd,hde->bhte", x, r)


def smoothed_key_transforms(rotation: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and query matrices of key rotation `rotation` (`[d, d]` or `[H, d, d]`) with per-channel key
    smoothing `scales` `[H, d]` (positive): keys are stored as `(k / s) @ R`, queries rotated as `(q * s) @ R`, so
    every score `q . k` is unchanged before quantization, and `rotate(x, query_matrix, transpose=True)` takes stored
    rows back to keys. Both `[H, d, d]` float32."""
    r = rotation.float()
    if r.dim() == 2:
        r = r.expand(scales.shape[0], -1, -1)
    s = scales.to(r.device, torch.float32)[:, :, None]
    return (r / s).contiguous(), (r * s).contiguous()


def expand_heads(rotation: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """Per-KV-head rotations `[Hkv, d, d]` repeated for the `groups` query heads of each group."""
    if rotation is None or rotation.dim() == 2 or groups == 1:
        return rotation
    return rotation.repeat_interleave(groups, dim=0)


def orthogonality_error(rotation: torch.Tensor) -> float:
    """max |RᵀR − I| over a `[d, d]` or `[H, d, d]` rotation."""
    r = rotation.to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return (r.transpose(-1, -2) @ r - eye).abs().max().item()
