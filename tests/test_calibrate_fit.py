"""Rotations from moments: a planted covariance yields its eigenbasis, composed as R = U · H · P_bitrev."""

import pytest
import torch

from oscar_hf.calibrate.fit import fit_rotations, hadamard_rotation, rotation_from_moment
from oscar_hf.rotations.math import hadamard_matrix

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second


def planted(d=16, seed=0):
    """(covariance, orthogonal U with columns in ascending-eigenvalue order, ascending eigenvalues)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    eigenvalues = torch.linspace(0.5, 40.0, d, dtype=torch.float64) ** 2
    return u @ torch.diag(eigenvalues) @ u.T, u, eigenvalues


def reference_bitrev_matrix(eigenvalues):
    """The reference's make_br_perm_matrix, written out: column br[i] holds the i-th largest direction."""
    d = eigenvalues.numel()
    bits = d.bit_length() - 1
    br = [int(bin(i)[2:].zfill(bits)[::-1], 2) for i in range(d)]
    order = torch.argsort(eigenvalues, descending=True)
    perm = torch.zeros(d, dtype=torch.long)
    for i in range(d):
        perm[br[i]] = order[i]
    return torch.eye(d, dtype=torch.float64)[:, perm]


def test_planted_covariance_gives_its_eigenbasis():
    cov, u, eigenvalues = planted()
    rotation, found = rotation_from_moment(cov[None], per_head=False)
    torch.testing.assert_close(found, eigenvalues, rtol=1e-10, atol=1e-9)
    # R = U·H·P  =>  U = R·Pᵀ·Hᵀ, equal to the planted U up to the sign of each column.
    recovered = rotation @ reference_bitrev_matrix(found).T @ hadamard_matrix(16).T
    signs = torch.sign((recovered * u).sum(0))
    torch.testing.assert_close(recovered * signs, u, rtol=1e-8, atol=1e-8)
    # The point of U·H: in the rotated basis every coordinate carries the same share tr(Σ)/d of the energy.
    rotated = rotation.T @ cov @ rotation
    torch.testing.assert_close(torch.diagonal(rotated), torch.full((16,), cov.trace().item() / 16, dtype=torch.float64))


def test_rotation_matches_reference_composition():
    cov, _, _ = planted(seed=1)
    rotation, _ = rotation_from_moment(cov[None], per_head=False)
    values, vectors = torch.linalg.eigh(cov)
    expected = vectors @ hadamard_matrix(16) @ reference_bitrev_matrix(values)
    torch.testing.assert_close(rotation, expected, rtol=0, atol=1e-12)


def test_shared_rotation_uses_mean_of_heads_and_per_head_each_head():
    a, _, _ = planted(seed=2)
    b, u_b, ev_b = planted(seed=3)
    stack = torch.stack([a, b])
    shared, shared_ev = rotation_from_moment(stack, per_head=False)
    expected_shared, _ = rotation_from_moment(((a + b) / 2)[None], per_head=False)
    torch.testing.assert_close(shared, expected_shared, rtol=0, atol=0)
    assert shared.shape == (16, 16) and shared_ev.shape == (16,)
    per_head, per_head_ev = rotation_from_moment(stack, per_head=True)
    assert per_head.shape == (2, 16, 16) and per_head_ev.shape == (2, 16)
    torch.testing.assert_close(per_head[1], rotation_from_moment(b[None], per_head=False)[0], rtol=0, atol=0)
    assert not torch.allclose(per_head[0], per_head[1])


def test_hadamard_objective_is_data_free():
    rotation, values = hadamard_rotation(16, 3, per_head=False)
    torch.testing.assert_close(values, torch.ones(16, dtype=torch.float64))
    torch.testing.assert_close(rotation, hadamard_matrix(16) @ reference_bitrev_matrix(values), rtol=0, atol=0)
    stacked, _ = hadamard_rotation(16, 3, per_head=True)
    assert stacked.shape == (3, 16, 16)


def test_fit_rotations_builds_checked_rotations():
    cov, _, _ = planted()
    moments = {0: torch.stack([cov, cov]), 3: torch.stack([cov, 2 * cov])}
    rotations = fit_rotations(moments, None, [0, 3], 16, 2, per_head=True, metadata={"model": "x"})
    assert rotations.layer_ids == [0, 3] and rotations.per_head and rotations.metadata["model"] == "x"
    assert rotations.key[3].dtype == torch.float32 and rotations.key[3].shape == (2, 16, 16)
    torch.testing.assert_close(rotations.value[0][0], hadamard_rotation(16, 2, False)[0].float())


def test_non_finite_moment_fails_clearly():
    bad = torch.full((1, 4, 4), float("nan"), dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN or infinite"):
        rotation_from_moment(bad, per_head=False)


def test_balanced_key_transform_keeps_scores_and_predicts_its_gain():
    from oscar_hf.calibrate.transforms import balanced_key_transform, predicted_gain

    sk, _, _ = planted(seed=5)
    sq = torch.linalg.inv(sk) * 7.0  # anti-aligned statistics: the case a rotation cannot help
    forward, query_side = balanced_key_transform(sq, sk)
    torch.testing.assert_close(query_side.T.double() @ forward.double(), torch.eye(16, dtype=torch.float64),
                               atol=1e-5, rtol=0)  # (q A⁻ᵀ)·(k A) = q·k
    expected = 16**2 / (sk.trace() * torch.linalg.inv(sk).trace())
    torch.testing.assert_close(predicted_gain(sq, sk), expected, rtol=1e-8, atol=0)
    assert predicted_gain(sk, sk).item() == pytest.approx(1.0)  # aligned statistics: nothing to gain
    # The transformed keys have equal variance in every coordinate (the U·H equalization after M*^½).
    covariance = forward.double().T @ sk @ forward.double()
    diagonal = torch.diagonal(covariance)
    torch.testing.assert_close(diagonal, diagonal.mean().expand(16), rtol=1e-6, atol=0)
