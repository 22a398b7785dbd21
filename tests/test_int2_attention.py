"""The INT2 path against brute force (dequantize everything, eager attention), and the partials it is built from."""

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.config import OscarConfig
from oscar_hf.history import QuantizedHistory
from oscar_hf.kernels.reference.attention import dense_partial, history_partial, merge_partials
from oscar_hf.kernels.reference.backend import ReferenceBackend
from oscar_hf.rotations.math import hadamard_matrix, rotate

from conftest import VOCAB, forward, tiny_model

TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=2)


def eager_attention(query, key, value, mask, scaling):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ value


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["hadamard", "identity", pytest.param("quarot", marks=pytest.mark.quick)])
def test_int2_attention_equals_dequantize_everything_and_eager(family, method):
    """Same cache contents, two attention paths: the tiered 'oscar' path vs dense dequantized K/V + eager."""
    oscar_model = tiny_model(family)
    eager_model = tiny_model(family)
    eager_model.set_attn_implementation("eager")
    fast = OscarCache(oscar_model, method=method, **TIERS)
    brute = OscarCache(eager_model.config, method=method, **TIERS)  # eager attention: cache returns dense K/V
    assert fast.uses_oscar_attention and not brute.uses_oscar_attention
    ids = torch.randint(1, VOCAB, (2, 70), generator=torch.Generator().manual_seed(0))
    start = 0
    with torch.no_grad():
        for size in (30, 1, 1, 1, 16, 1, 1, 1, 1, 1, 1, 1, 1, 13):
            chunk = ids[:, start : start + size]
            out = forward(oscar_model, chunk, fast).logits
            ref = forward(eager_model, chunk, brute).logits
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
            start += size
    layer = fast.layers[0]
    assert layer.history_length > 40
    for a, b in zip(fast.layers, brute.layers):
        b.settle()  # the dense fallback demotes lazily, at the next update
        assert a.history_length == b.history_length
        assert torch.equal(a.history.key_codes[:, :, : a.history_length], b.history.key_codes[:, :, : b.history_length])


@pytest.mark.quick
def test_history_partial_chunking_does_not_change_the_result():
    cfg = OscarConfig.from_method("hadamard")
    history = QuantizedHistory(2, 2, 16, 16, cfg, torch.device("cpu"))
    r = hadamard_matrix(16, torch.float32)
    history.append(torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16), r, r, ReferenceBackend())
    query = torch.randn(2, 4, 3, 16)
    mask = torch.rand(2, 1, 3, 37) > 0.2
    whole = history_partial(query, history.kernel_view(), r, r, mask, 0.25, chunk=1000)
    pieces = history_partial(query, history.kernel_view(), r, r, mask, 0.25, chunk=5)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
    # and it equals eager attention over the dequantized, un-rotated history
    keys, values = history.dequantize(0, 37)
    keys, values = rotate(keys, r, transpose=True), rotate(values, r, transpose=True)
    expected = eager_attention(query, keys, values, mask, 0.25)
    torch.testing.assert_close(whole[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.quick
def test_merging_partials_equals_attention_over_the_union():
    query, key, value = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 8)
    mask = torch.rand(2, 1, 5, 30) > 0.3
    mask[..., 0] = True
    whole = dense_partial(query, key, value, mask, 0.3)
    split = [dense_partial(query, key[:, :, a:b], value[:, :, a:b], mask[..., a:b], 0.3) for a, b in ((0, 7), (7, 30))]
    torch.testing.assert_close(merge_partials(split), whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(whole[0], eager_attention(query, key, value, mask, 0.3), atol=1e-6, rtol=1e-5)


@pytest.mark.quick
def test_fully_masked_rows_give_zero_not_nan():
    query, key, value = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    mask[0, 0, 1] = False  # query row 1 sees nothing in this tier
    out, lse = dense_partial(query, key, value, mask, 0.3)
    assert torch.isneginf(lse[0, :, 1]).all() and (out[0, :, 1] == 0).all()
    empty = dense_partial(query, key, value, torch.zeros_like(mask), 0.3)
    merged_out, merged_lse = merge_partials([empty, (out, lse)])
    assert torch.isfinite(merged_out).all()
    torch.testing.assert_close(merged_out[0, :, 0], out[0, :, 0])


@pytest.mark.quick
def test_softcap_is_applied_before_the_log_sum_exp():
    query, key, value = torch.randn(1, 2, 2, 8) * 10, torch.randn(1, 2, 5, 8) * 10, torch.randn(1, 2, 5, 8)
    out, lse = dense_partial(query, key, value, None, 1.0, softcap=5.0)
    scores = torch.tanh((query @ key.transpose(-1, -2)) / 5.0) * 5.0
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ value)


@pytest.mark.parametrize("per_head", [False, pytest.param(True, marks=pytest.mark.quick)])
def test_folding_value_rotation_into_weights_changes_nothing_but_speed(per_head):
    from oscar_hf import Rotations
    from oscar_hf.rotations.math import compose_rotation

    model, folded_model = tiny_model("qwen2"), tiny_model("qwen2")  # qwen2 has a v_proj bias
    gen = torch.Generator().manual_seed(0)

    def rotation():
        shape = (2, 16, 16) if per_head else (16, 16)
        a = torch.randn(*shape, dtype=torch.float64, generator=gen)
        ev, u = torch.linalg.eigh(a @ a.transpose(-1, -2))
        return compose_rotation(u, ev).float()

    rot = Rotations({i: rotation() for i in (0, 1)}, {i: rotation() for i in (0, 1)})
    ids = torch.randint(1, VOCAB, (1, 40), generator=gen)
    plain = OscarCache(model, rotations=rot, method="none", **TIERS)
    folded = OscarCache(folded_model, rotations=rot, method="none", fold_value_rotation=True, **TIERS)
    assert folded.layers[0].value_rotation is None and plain.layers[0].value_rotation is not None
    with torch.no_grad():
        torch.testing.assert_close(forward(folded_model, ids, folded).logits, forward(model, ids, plain).logits,
                                   atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(forward(folded_model, ids[:, :1], folded).logits,
                                   forward(model, ids[:, :1], plain).logits, atol=2e-5, rtol=1e-5)
    # the stored history is the same rotated V either way
    torch.testing.assert_close(folded.layers[1].history.values[:, :, :10], plain.layers[1].history.values[:, :, :10],
                               atol=1e-5, rtol=1e-5)
    # the folded weights are the same function without an OscarCache too
    from transformers import DynamicCache

    with torch.no_grad():
        torch.testing.assert_close(forward(folded_model, ids, DynamicCache()).logits,
                                   forward(model, ids, DynamicCache()).logits, atol=2e-5, rtol=1e-5)
    OscarCache(folded_model, rotations=rot, method="hadamard", fold_value_rotation=True)  # same rotations: no-op
    with pytest.raises(ValueError, match="folded into its weights .* differ"):
        OscarCache(folded_model, method="hadamard")
