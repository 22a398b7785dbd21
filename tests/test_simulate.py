"""The decode-equivalent simulation equals real prefill + token-by-token decoding through OscarCache."""

from __future__ import annotations

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name
from oscar_hf.demotion import history_lengths
from oscar_hf.eval.decode_equivalent import simulate_logits

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=3)


@torch.no_grad()
def cached_logits(model, ids, cache, prefill, chunk):
    """Logits of a prefill of `prefill` tokens followed by `chunk`-token forwards through `cache`."""
    name = cache_argument_name(model)
    pieces = [model(input_ids=ids[:, :prefill], use_cache=True, **{name: cache}).logits]
    for start in range(prefill, ids.shape[1], chunk):
        pieces.append(model(input_ids=ids[:, start:start + chunk], use_cache=True, **{name: cache}).logits)
    return torch.cat(pieces, dim=1)


@pytest.mark.quick
def test_history_lengths_follow_the_demotion_schedule():
    # S=4, R=8, b=3: the recent window may reach R + b - 1 = 10 tokens; the 11th triggers demotion back to 8.
    n = history_lengths(30, prefill=5, sink=4, recent=8, block=3)
    # query t is computed after t tokens are cached; window = t - 4 - N
    assert n[:15].tolist() == [0] * 15  # after 14 tokens the window holds 10: no demotion yet
    assert n[15].item() == 3  # after 15 tokens the window held 11 -> 3 demoted, 8 remain
    assert n[16:18].tolist() == [3, 3]
    assert n[18].item() == 6
    # a long prefill demotes at once down to R, then in blocks of b
    n = history_lengths(40, prefill=30, sink=4, recent=8, block=3)
    assert n[:30].tolist() == [0] * 30 and n[30].item() == 18 and n[32].item() == 18 and n[33].item() == 21
    # a multi-token forward trims the window to R at once, a single-token one only past R + b - 1
    n = history_lengths(30, prefill=14, sink=4, recent=8, block=3)
    assert n[13].item() == 0 and n[14].item() == 2 and n[16].item() == 2 and n[17].item() == 5
    # chunked forwards: every query of a chunk sees the history left by the forwards before it
    n = history_lengths(40, prefill=16, sink=4, recent=8, block=3, chunk=6)
    assert n[16:22].tolist() == [4] * 6 and n[22:28].tolist() == [10] * 6


@pytest.mark.parametrize("method", ["hadamard", "identity", "quarot", "none"])
@pytest.mark.parametrize("prefill", [6, 14, pytest.param(21, marks=pytest.mark.quick)])
def test_simulation_equals_token_by_token_decoding(tiny_llama_model, method, prefill):
    torch.manual_seed(1)
    ids = torch.randint(0, tiny_llama_model.config.vocab_size, (1, 48))
    template = OscarCache(tiny_llama_model.config, method=method, **LAYOUT)
    simulated = simulate_logits(tiny_llama_model, ids, template, prefill=prefill)
    decoded = cached_logits(tiny_llama_model, ids, OscarCache(tiny_llama_model, method=method, **LAYOUT), prefill, 1)
    assert (simulated - decoded).abs().max().item() < 1e-5
    if method != "none":
        reference = tiny_llama_model(ids).logits
        assert (decoded - reference).abs().max().item() > 1e-3  # the quantized history really matters here


def test_simulation_equals_chunked_forwards(tiny_llama_model):
    torch.manual_seed(2)
    ids = torch.randint(0, tiny_llama_model.config.vocab_size, (1, 50))
    template = OscarCache(tiny_llama_model.config, method="hadamard", **LAYOUT)
    simulated = simulate_logits(tiny_llama_model, ids, template, prefill=17, chunk=5)
    chunked = cached_logits(tiny_llama_model, ids, OscarCache(tiny_llama_model, method="hadamard", **LAYOUT), 17, 5)
    assert (simulated - chunked).abs().max().item() < 1e-5
    # and a different schedule gives measurably different logits (the schedule is what is being tested)
    decoded_schedule = simulate_logits(tiny_llama_model, ids, template, prefill=17, chunk=1)
    assert (decoded_schedule - chunked).abs().max().item() > 1e-4


def test_simulation_batches_rows_with_their_own_prefill(tiny_llama_model):
    torch.manual_seed(3)
    ids = torch.randint(0, tiny_llama_model.config.vocab_size, (2, 40))
    template = OscarCache(tiny_llama_model.config, method="hadamard", **LAYOUT)
    batched = simulate_logits(tiny_llama_model, ids, template, prefill=[5, 19])
    for row, prefill in enumerate([5, 19]):
        alone = simulate_logits(tiny_llama_model, ids[row:row + 1], template, prefill=prefill)
        assert (batched[row] - alone[0]).abs().max().item() < 1e-5


@pytest.mark.quick
def test_simulation_restores_the_attention_implementation(tiny_llama_model):
    template = OscarCache(tiny_llama_model.config, method="hadamard", **LAYOUT)
    simulate_logits(tiny_llama_model, torch.zeros(1, 8, dtype=torch.long), template, prefill=2)
    assert tiny_llama_model.config._attn_implementation == "sdpa"
