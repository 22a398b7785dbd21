import pytest
import torch

from oscar_hf.rotations.math import (
    bit_reversal_permutation,
    bit_reversal_permutation_matrix,
    compose_rotation,
    hadamard_matrix,
    orthogonality_error,
    rotate,
)

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 256])
def test_hadamard_is_orthogonal_symmetric_with_equal_magnitudes(n):
    h = hadamard_matrix(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two.*96"):
        hadamard_matrix(96)


def test_bit_reversal_matches_reference_order():
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert bit_reversal_permutation(128)[:8].tolist() == [0, 64, 32, 96, 16, 80, 48, 112]


def test_permutation_puts_top_eigen_directions_at_bit_reversed_columns():
    ev = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])  # ascending, like eigh
    p = bit_reversal_permutation_matrix(ev)
    x = torch.arange(8, dtype=torch.float64)[None]  # column c of x holds value c
    moved = (x @ p)[0].tolist()
    # the largest eigenvalue (index 7) lands at column 0, the 2nd (6) at column 4, the 3rd (5) at column 2...
    assert moved == [7, 3, 5, 1, 6, 2, 4, 0]


def test_composed_rotation_is_orthogonal_and_equals_u_h_p():
    a = torch.randn(16, 16, dtype=torch.float64)
    ev, u = torch.linalg.eigh(a @ a.T)
    r = compose_rotation(u, ev)
    assert orthogonality_error(r) < 1e-12
    assert torch.allclose(r, u @ hadamard_matrix(16) @ bit_reversal_permutation_matrix(ev))
    per_head = compose_rotation(torch.stack([u, u]), torch.stack([ev, ev]))
    assert per_head.shape == (2, 16, 16) and torch.allclose(per_head[1], r)


def test_rotate_shared_and_per_head_and_inverse():
    x = torch.randn(2, 3, 5, 8)
    r = torch.linalg.qr(torch.randn(8, 8))[0]
    assert torch.allclose(rotate(x, r), x @ r, atol=1e-6)
    heads = torch.stack([torch.linalg.qr(torch.randn(8, 8))[0] for _ in range(3)])
    y = rotate(x, heads)
    for h in range(3):
        assert torch.allclose(y[:, h], x[:, h] @ heads[h], atol=1e-6)
    assert torch.allclose(rotate(y, heads, transpose=True), x, atol=1e-5)
    assert torch.equal(rotate(x, None), x)
