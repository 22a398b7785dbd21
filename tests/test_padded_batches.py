"""Left-padded batches of mixed lengths: each row keeps its own first real tokens as its sink, its pads go into the
quantized history, and the batch stores about what its rows would alone (issue 23, defect 1).

Quantized methods are compared with each row run alone: the rows' real tokens sit in the same tiers and are
quantized row by row, so a padded row attends to what its solo cache holds.
"""

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache

from conftest import VOCAB, forward, generate, tiny_model

TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=2)


def _left_padded(lengths, seed=0):
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
        ids[row, : width - length] = 0
    return ids, mask


def _prefill(model, cache, ids, mask):
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return forward(model, ids, cache, attention_mask=mask, position_ids=positions).logits


def _bf16_token_bytes(model, cache):
    layer = cache.layers[0]
    return layer.keys_buffer.shape[1] * (layer.keys_buffer.shape[3] + layer.values_buffer.shape[3]) * 2


@pytest.mark.parametrize("method", [pytest.param("hadamard", marks=pytest.mark.quick), "none"])
def test_mixed_lengths_store_about_their_solo_caches(method):
    """The issue's batch: a 2,000-token and a 100-token prompt (default tiers). Before, the sink grew to 1,964
    tokens and the batch stored what DynamicCache stores; now both rows share a 1,680-token history and the batch
    stores at most the rows' solo caches plus the padding's history codes and one BF16 window of pads."""
    model = tiny_model("llama").to(torch.bfloat16)
    ids, mask = _left_padded([2000, 100])
    batch = OscarCache(model, rotations="hadamard", method=method)
    _prefill(model, batch, ids, mask)
    layer = batch.layers[0]
    assert (layer.sink_length, layer.history_length) == (64, 2000 - 64 - 256)
    solos = []
    for row in range(2):
        solo = OscarCache(model, rotations="hadamard", method=method)
        real = mask[row].bool()
        _prefill(model, solo, ids[row : row + 1, real], mask[row : row + 1, real])
        solos.append(solo.nbytes())
    pad_rows = layer.history_length  # the short row's history is all padding
    history_token = layer.history.token_bytes() * layer.keys_buffer.shape[1] * len(batch.layers)
    window = (64 + 256) * _bf16_token_bytes(model, batch) * len(batch.layers)
    assert batch.nbytes() <= sum(solos) + pad_rows * history_token + window
    if method != "none":
        dynamic = 2 * 2000 * _bf16_token_bytes(model, batch) * len(batch.layers)
        assert batch.nbytes() < 0.4 * dynamic


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_rows_decode_like_their_solo_runs(family):
    """Greedy decoding of a left-padded batch through a quantized cache gives each row the tokens and logits of its
    own run: row 1's padding (20) is longer than sink + recent, so its pads reach the history, and row 2's short
    prompt demotes its first real tokens out of the padding during decode. (The rows share one demotion cycle: a
    padding that is not a multiple of `demote_block` shifts a row's demotions by up to `demote_block - 1` steps
    from its solo run's, so these paddings are even.)"""
    model = tiny_model(family)
    lengths = [40, 20, 8]
    ids, mask = _left_padded(lengths, seed=3)
    kw = dict(max_new_tokens=16, output_scores=True, return_dict_in_generate=True)
    cache = OscarCache(model, rotations="hadamard", method="hadamard", **TIERS)
    out = generate(model, ids, cache, attention_mask=mask, **kw)
    layer = cache.layers[0]
    assert layer.row_start.tolist() == [0, 20, 32] and layer.history_length > 0
    width = ids.shape[1]
    for row, length in enumerate(lengths):
        solo_cache = OscarCache(model, rotations="hadamard", method="hadamard", **TIERS)
        solo = generate(model, ids[row : row + 1, width - length :], solo_cache, **kw)
        assert torch.equal(out.sequences[row, width:], solo.sequences[0, length:]), f"row {row}"
        torch.testing.assert_close(torch.stack(out.scores)[:, row], torch.stack(solo.scores)[:, 0], atol=2e-5,
                                   rtol=0)


@pytest.mark.quick
def test_an_all_padding_row_does_not_keep_the_batch_in_bf16():
    """A row that is padding only (an empty prompt in a batch) leaves the other rows' layout alone: the history
    holds the long row's tokens, and the long row's logits are its solo ones."""
    model = tiny_model("llama")
    ids, mask = _left_padded([30, 1], seed=5)
    mask[1] = 0
    cache = OscarCache(model, rotations="hadamard", method="hadamard", **TIERS)
    logits = _prefill(model, cache, ids, mask)
    layer = cache.layers[0]
    assert (layer.sink_length, layer.history_length) == (4, 30 - 4 - 8)
    assert torch.isfinite(logits[0]).all()
    solo = OscarCache(model, rotations="hadamard", method="hadamard", **TIERS)
    ref = _prefill(model, solo, ids[:1], mask[:1])
    torch.testing.assert_close(logits[0], ref[0], atol=2e-5, rtol=0)


def test_chunked_prefill_of_padded_rows_matches_dynamic_cache():
    """A left-padded prompt fed in chunks (each chunk's mask covers every cached column): the second chunk
    attends to the padded rows' sink and history in the cache's layout, and method none stays at DynamicCache."""
    model = tiny_model("qwen2")
    ids, mask = _left_padded([36, 17, 30], seed=7)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    caches = [OscarCache(model, rotations="identity", method="none", **TIERS), DynamicCache(config=model.config)]
    outputs = []
    for cache in caches:
        with torch.no_grad():
            chunks = [forward(model, ids[:, a:b], cache, attention_mask=mask[:, :b], position_ids=positions[:, a:b])
                      .logits for a, b in ((0, 18), (18, 30), (30, 36))]
        outputs.append(torch.cat(chunks, dim=1))
    assert caches[0].layers[0].history_length > 0 and caches[0].layers[0].row_start.tolist() == [0, 19, 6]
    real = mask.bool()
    torch.testing.assert_close(outputs[0][real], outputs[1][real], atol=1e-5, rtol=0)


@pytest.mark.quick
def test_a_row_cropped_back_into_its_padding_continues_like_dynamic_cache():
    """A row whose real tokens are all cropped away is padding only; the tokens after the crop are real (found
    by tests/test_cache_properties.py: the row kept its old padding count, and decode steps, which read each row's
    padding instead of the mask, hid the first token after the crop)."""
    model = tiny_model("llama", seed=4)
    ids, mask = _left_padded([4, 1, 4], seed=6)
    caches = OscarCache(model, method="none", **TIERS), DynamicCache(config=model.config)
    steps = torch.randint(1, VOCAB, (3, 2), generator=torch.Generator().manual_seed(7))
    logits = []
    for cache in caches:
        step_mask = mask[:, :2]
        with torch.no_grad():
            forward(model, ids, cache, attention_mask=mask)
            cache.crop(-2)
            for t in range(2):
                step_mask = torch.cat([step_mask, torch.ones(3, 1, dtype=torch.long)], 1)
                out = forward(model, steps[:, t:t + 1], cache, attention_mask=step_mask).logits
        logits.append(out)
    assert caches[0].layers[0].row_start.tolist() == [0, 2, 0]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
