"""The data-free profile (`oscar_hf.profile`): induction scores find the head that copies, the smoothing rule is
the calibrated one, and the rotations it builds are the same every time and rank the model's layers and heads."""

from __future__ import annotations

import types

import pytest
import torch

from oscar_hf.model_support import rotary_dim
from oscar_hf.profile import ChannelPower, InductionScores, data_free_rotations, profile_model

from conftest import tiny_model


@pytest.mark.quick
def test_induction_scores_find_the_head_that_attends_to_the_token_after_the_earlier_occurrence():
    n = 16
    positions = torch.arange(2 * n)
    query = torch.zeros(1, 2, 2 * n, n)  # two query heads, one per KV head
    key = torch.zeros(1, 2, 2 * n, n)
    # KV head 0 copies: the key at s encodes token s - 1, the query at t token t, so the one visible match of a
    # second-copy query is the key right after its token's first occurrence; KV head 1 attends to every key alike
    key[0, 0] = torch.nn.functional.one_hot((positions - 1) % n, n).float()
    query[0, 0] = torch.nn.functional.one_hot(positions % n, n).float() * 30.0
    observer = InductionScores(n)
    observer(types.SimpleNamespace(layer_idx=3), query, key, key, 1.0, None)
    scores = observer.scores[3]
    assert scores.shape == (2,)
    assert scores[0] > 0.9 and scores[1] < 0.2  # uniform over >= n keys


@pytest.mark.quick
def test_smoothing_scales_balance_key_and_query_channels_per_head():
    power = ChannelPower()
    query = torch.randn(1, 4, 64, 8)
    key = torch.randn(1, 2, 64, 8)
    key[..., 3] *= 16.0  # an outlier key channel
    power(types.SimpleNamespace(layer_idx=0), query, key, key, 1.0, None)
    scales = power.scales()[0]
    assert scales.shape == (2, 8)
    torch.testing.assert_close(scales.log().mean(-1), torch.zeros(2), atol=1e-5, rtol=0)  # geometric mean 1
    assert bool((scales.argmax(-1) == 3).all())  # the outlier channel is divided most


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """transformers' rotate_half RoPE of `x` `[B, H, L, d]` at `positions` `[L]`."""
    half = x.shape[-1] // 2
    angle = positions[:, None].float() * theta ** (-torch.arange(half).float() / half)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _scales_at(positions: torch.Tensor, rotary: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    channel_size = torch.rand(8, generator=generator) * 8 + 0.5  # unequal channels, as projections make them
    query = _rope(torch.randn(1, 4, len(positions), 8, generator=generator) * channel_size.flip(0), positions)
    key = _rope(torch.randn(1, 2, len(positions), 8, generator=generator) * channel_size, positions)
    power = ChannelPower(rotary)
    power(types.SimpleNamespace(layer_idx=0), query, key, key, 1.0, None)
    return power.scales()[0]


@pytest.mark.quick
def test_smoothing_scales_tied_per_rope_pair_do_not_depend_on_the_positions_measured():
    """RoPE moves a slow pair's energy between its two channels with the position; the pair's total stays. Tied
    scales from the first 256 positions match those from 4,096 positions later; per-channel ones do not."""
    early, late = torch.arange(256), torch.arange(4096, 4352)
    tied_early, tied_late = _scales_at(early, 8), _scales_at(late, 8)
    torch.testing.assert_close(tied_early[:, :4], tied_early[:, 4:])  # channel i and i + d/2 share a scale
    assert (tied_early / tied_late).log().abs().max() < 0.15
    single = (_scales_at(early, 0) / _scales_at(late, 0)).log().abs().max()
    assert single > 0.3  # the slowest pair's channels swapped roles between the two spans


@pytest.mark.quick
def test_the_rotary_dim_follows_the_models_rope():
    from transformers import BloomConfig, LlamaConfig, PhiConfig

    assert rotary_dim(LlamaConfig(head_dim=64), 64) == 64
    assert rotary_dim(PhiConfig(), 64) == 32  # partial_rotary_factor 0.5: the rest keep a scale each
    assert rotary_dim(BloomConfig(), 64) == 0  # ALiBi, no RoPE: nothing to tie


def test_data_free_rotations_are_deterministic_and_rank_every_layer_and_head():
    model = tiny_model("llama", seed=0)
    first = data_free_rotations(model)
    assert data_free_rotations(model) is first  # kept on the model
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert sorted(first.retrieval_layers()) == list(range(layers))
    assert len(first.retrieval_heads()) == layers * heads
    again = tiny_model("llama", seed=0)
    scales, induction = profile_model(again)
    assert set(scales) == set(range(layers)) and all(s.shape == (heads, model.config.head_dim)
                                                     for s in scales.values())
    rebuilt = data_free_rotations(again)
    assert rebuilt.retrieval_layers() == first.retrieval_layers()
    assert all(torch.equal(rebuilt.key_smoothing[i], scales[i]) for i in range(layers))  # the profile's scales
    assert data_free_rotations(again, smooth_keys=False).key_smoothing == {}  # the ranking alone, where asked


@pytest.mark.quick
def test_the_profile_fits_the_models_position_range_and_samples_its_induction_queries():
    from oscar_hf.profile import PROFILE_TOKENS, profile_length

    model = tiny_model("llama", seed=0)
    model.config.max_position_embeddings = 64
    assert profile_length(model) == 31  # 2 x 31 positions: RoBERTa-style ids start 2 further in
    model.config.max_position_embeddings = 1 << 20
    assert profile_length(model) == PROFILE_TOKENS
    n = 40
    key, query = torch.randn(1, 1, 2 * n, 8), torch.randn(1, 2, 2 * n, 8)
    every, sampled = InductionScores(n, queries=n), InductionScores(n, queries=8)
    for observer in (every, sampled):
        observer(types.SimpleNamespace(layer_idx=0), query, key, key, 1.0, None)
    # the sampled rows' mean, computed directly: every 4th second-copy query from position n
    rows = torch.arange(n, 2 * n - 1, (n - 1) // 8)
    logits = (query[0, :, rows] @ key[0, 0].T).masked_fill(torch.arange(2 * n)[None, :] > rows[:, None], -1e30)
    want = logits.softmax(-1)[:, torch.arange(len(rows)), rows - n + 1].mean()
    torch.testing.assert_close(sampled.scores[0][0], want)
    assert not torch.equal(every.scores[0], sampled.scores[0])


@pytest.mark.quick
def test_a_cache_given_no_rotations_stores_the_ranked_default_on_the_models_profile():
    from oscar_hf import OscarCache

    model = tiny_model("llama", seed=0)
    layout = dict(sink_tokens=4, recent_tokens=8)
    default = OscarCache(model, **layout)
    assert default.oscar_config.method == "oscar-next"
    assert default.rotations is data_free_rotations(model)  # the profile, run once per model
    assert default.oscar_config.high_precision_heads == tuple(default.rotations.retrieval_heads()[:1])
    assert OscarCache(model, rotations="hadamard", **layout).oscar_config.method == "oscar-next"
    mixed = OscarCache(model, method="oscar-mixed", **layout)  # a ranked preset given no file: the profile too
    assert mixed.oscar_config.high_precision_layers == (default.rotations.retrieval_layers()[0],)
    # the paper's uniform rows where asked for, where an option chooses a row format, and without the weights
    assert OscarCache(model, method="hadamard", **layout).rotations.key_smoothing == {}
    assert OscarCache(model, bits=4, **layout).oscar_config.method == "hadamard"
    assert OscarCache(model.config, **layout).oscar_config.method == "hadamard"
