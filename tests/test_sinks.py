"""Learned attention-sink logits (gpt-oss): every row's softmax also holds `exp(sink_h)` in its denominator, a key
with no value. The reference applies it after the log-sum-exp merge (`add_sinks`); the Triton merge kernel adds it as
one more term; a tiny gpt-oss through `OscarCache(method="none")` equals DynamicCache."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

from transformers import DynamicCache  # noqa: E402

from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.kernels.interface import DecodeCall  # noqa: E402
from oscar_hf.kernels.reference.attention import causal_mask  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402

from conftest import VOCAB, generate, tiny_model  # noqa: E402
from test_kernels_attention import DEVICE, SINK, _assert_close, _kernel_backend, _tiered_case  # noqa: E402


def _softmax_with_sinks(query, keys, values, mask, scaling, sinks):
    """gpt-oss's eager attention, written out: scores, then the sink column, softmax, the sink column dropped."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1).float(), values.repeat_interleave(groups, 1).float()
    scores = query.float() @ keys.transpose(-1, -2) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return (probs @ values).transpose(1, 2)


@pytest.mark.quick
def test_reference_tiers_with_sinks_equal_a_softmax_with_a_sink_column():
    """No history, so the tiers are the whole attention: the reference equals the written-out softmax."""
    torch.manual_seed(0)
    query, keys, values = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    sinks = torch.randn(4) * 2
    mask = causal_mask(3, 9, query.device)
    got = ReferenceBackend().tiered_attention(query, keys, values, mask, None, 0, None, None, 0.25, sinks=sinks)
    want = _softmax_with_sinks(query, keys, values, mask, 0.25, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain = ReferenceBackend().tiered_attention(query, keys, values, mask, None, 0, None, None, 0.25)
    assert not torch.allclose(got, plain)  # the sinks took probability away


@pytest.mark.parametrize("q_len", [pytest.param(1, marks=pytest.mark.quick), 5])
def test_kernels_apply_sinks_as_the_reference_does(q_len):
    """Tiers and history through the Triton kernels (the interpreter on a CPU), sinks in the merge: the reference's
    output, for a decode step and a chunk of queries."""
    rotations, history, query, keys, values = _tiered_case(64, 2, q_len, torch.float32, "shared")
    sinks = torch.randn(query.shape[1], device=DEVICE) + 6.0  # about the log-sum-exp of these scores
    scaling = query.shape[-1] ** -0.5
    mask = None if q_len == 1 else causal_mask(q_len, history.length + keys.shape[2], DEVICE)
    args = (query, keys, values, mask, history, SINK, *rotations, scaling)
    got = _kernel_backend().tiered_attention(*args, sinks=sinks)
    want = ReferenceBackend().tiered_attention(*args, sinks=sinks)
    _assert_close(got, want, 2e-5, "tiers and history with sinks")
    assert not torch.allclose(got, _kernel_backend().tiered_attention(*args), atol=1e-3)


def test_a_decode_call_carries_its_sinks_to_the_kernels():
    rotations, history, query, keys, values = _tiered_case(64, 2, 1, torch.float32, None)
    sinks = torch.randn(query.shape[1], device=DEVICE) + 6.0  # about the log-sum-exp of these scores
    dense = torch.tensor([keys.shape[2]], dtype=torch.int32, device=DEVICE)
    length = torch.tensor([history.length], dtype=torch.int32, device=DEVICE)
    from dataclasses import replace

    call = DecodeCall(query, keys, values, dense, replace(history, length_ptr=length), *rotations,
                      query.shape[-1] ** -0.5, sinks=sinks)
    got = _kernel_backend().decode_attention(call)
    want = ReferenceBackend().decode_attention(call)
    _assert_close(got, want, 2e-5, "counted decode step with sinks")


@pytest.mark.quick
def test_a_tiny_gpt_oss_with_the_unquantized_cache_generates_as_dynamic_cache():
    """Sliding layers kept as transformers keeps them, full layers in OSCAR tiers with a history: sinks in every
    one of them."""
    model = tiny_model("gpt_oss")
    ids = torch.randint(1, VOCAB, (2, 120), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=10, output_logits=True, return_dict_in_generate=True)
    want = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = OscarCache(model, method="none", sink_tokens=4, recent_tokens=16, demote_block=4)
    got = generate(model, ids, cache, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-5)
    assert cache.layers[1].history_length > 0
