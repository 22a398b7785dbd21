"""With quantization off (method `none`) OscarCache must reproduce DynamicCache: same tokens, logits within 1e-5.

Small tiers (sink 4, recent 8, block 2) make every test demote tokens into the history, so the separate
history attention and the log-sum-exp merge are exercised, not bypassed.
"""

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache

from conftest import VOCAB, forward, generate, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=2)
ATOL = 1e-5


def oscar(model, rotations="identity", **kw):
    return OscarCache(model, rotations=rotations, method="none", **{**TIERS, **kw})


def scores_of(out):
    return torch.stack(out.scores, dim=1)  # [B, steps, vocab]


def assert_history_used(cache):
    assert any(getattr(layer, "history_length", 0) > 0 for layer in cache.layers)


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.quick) if f == "qwen3" else f for f in FAMILIES])
@pytest.mark.parametrize("rotations", ["identity", "hadamard"])
def test_greedy_generation_matches_dynamic_cache(family, rotations):
    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=24, output_scores=True, return_dict_in_generate=True)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = oscar(model, rotations)
    out = generate(model, ids, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(scores_of(out), scores_of(ref), atol=ATOL, rtol=0)
    assert_history_used(cache)
    assert cache.get_seq_length() == ids.shape[1] + 24 - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_matches_dynamic_cache(family):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (3, 26), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in ((0, 10), (1, 0), (2, 3)):  # row 0's padding is longer than the sink
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    kw = dict(attention_mask=mask, max_new_tokens=20, output_scores=True, return_dict_in_generate=True)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = oscar(model)
    out = generate(model, ids, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(scores_of(out), scores_of(ref), atol=ATOL, rtol=0)
    layer = cache.layers[0]
    assert layer.sink_size == TIERS["sink_tokens"] and layer.row_start.tolist() == [10, 0, 3]
    assert_history_used(cache)
    # each row's sink slots hold its own first real tokens; in time order the tiers are DynamicCache's
    seen = out.sequences[:, :-1]
    real = (torch.arange(seen.shape[1])[None] >= torch.tensor([10, 0, 3])[:, None]).long()
    dense = DynamicCache(config=model.config)
    forward(model, seen, dense, attention_mask=real, position_ids=(real.cumsum(-1) - 1).clamp_min(0))
    keys, _ = layer.dense_kv()
    for row, pad in enumerate((10, 0, 3)):  # pads' keys depend on the release's pad positions: compare real ones
        expected = dense.layers[0].keys[row, :, pad:]
        torch.testing.assert_close(keys[row, :, pad:], expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.keys_buffer[row, :, :4], expected[:, :4], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_beam_search_matches_dynamic_cache(family):
    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (2, 18), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=16, num_beams=3, num_return_sequences=2)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = oscar(model, "hadamard")
    out = generate(model, ids, cache, **kw)
    assert torch.equal(out, ref)
    assert_history_used(cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_dynamic_cache(family):
    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (2, 60), generator=torch.Generator().manual_seed(4))
    ref_cache, cache = DynamicCache(config=model.config), oscar(model, "hadamard")
    start = 0
    with torch.no_grad():
        for size in (5, 13, 1, 20, 1, 1, 19):
            chunk = ids[:, start : start + size]
            ref = forward(model, chunk, ref_cache).logits
            out = forward(model, chunk, cache).logits
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
            start += size
    assert start == ids.shape[1] and cache.get_seq_length() == 60
    assert_history_used(cache)


@pytest.mark.quick
def test_prefill_chunk_size_of_generate_matches_dynamic_cache():
    model = tiny_model("qwen3")
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    ref = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    out = generate(model, ids, oscar(model), max_new_tokens=10, prefill_chunk_size=16)
    assert torch.equal(out, ref)
