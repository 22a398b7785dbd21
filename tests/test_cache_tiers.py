"""Tier layout, demotion schedule, cache operations and memory accounting."""

import copy
import re

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarConfig

from conftest import VOCAB, forward, generate, tiny_model


def ids_of(batch, length, seed=0):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def layout(cache):
    layer = cache.layers[0]
    return layer.sink_length, layer.history_length, layer.counts()[1] - layer.sink_length


@pytest.mark.parametrize("length, expected", [
    (100, (0, 0, 100)),      # short prompts stay BF16 (sink/recent not split yet)
    (320, (0, 0, 320)),      # <= sink + recent: all BF16
    pytest.param(321, (64, 1, 256), marks=pytest.mark.quick),  # prefill quantizes the middle at once
    (1000, (64, 680, 256)),
])
def test_prefill_layout(length, expected):
    model = tiny_model("llama")
    cache = OscarCache(model, method="hadamard")
    with torch.no_grad():
        forward(model, ids_of(1, length), cache)
    assert layout(cache) == expected
    assert cache.get_seq_length() == length


def test_decode_demotes_eight_tokens_once_recent_exceeds_263():
    model = tiny_model("qwen3")
    cache = OscarCache(model, method="hadamard")
    ids = ids_of(1, 1000 + 16)
    with torch.no_grad():
        forward(model, ids[:, :1000], cache)
        history = []
        for t in range(1000, 1016):
            forward(model, ids[:, t : t + 1], cache)
            history.append(layout(cache)[1])
    # recent grows 257..263 for 7 steps, the 8th step reaches 264 and demotes 8 -> back to 256
    assert history[:7] == [680] * 7 and history[7] == 688 and history[8:15] == [688] * 7 and history[15] == 696
    assert cache.get_seq_length() == 1016


@pytest.mark.quick
def test_crop_within_recent_and_refusal_beyond():
    model = tiny_model("llama")
    cache = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8, demote_block=2)
    with torch.no_grad():
        forward(model, ids_of(1, 40), cache)
    cache.crop(-3)
    assert cache.get_seq_length() == 37 and layout(cache) == (4, 28, 5)
    cache.crop(0)
    assert cache.get_seq_length() == 37
    with pytest.raises(ValueError, match="only the newest 5 are still in BF16"):
        cache.crop(-6)


def test_cropped_cache_continues_like_an_uncropped_one():
    model = tiny_model("llama")
    tiers = dict(method="none", sink_tokens=4, recent_tokens=8, demote_block=2)
    ids = ids_of(1, 30)
    a, b = OscarCache(model, **tiers), OscarCache(model, **tiers)
    with torch.no_grad():
        forward(model, ids[:, :20], a)
        forward(model, torch.cat([ids[:, 20:22], ids_of(1, 3, seed=9)], 1), a)
        a.crop(-3)
        forward(model, ids[:, :22], b)
        torch.testing.assert_close(forward(model, ids[:, 22:], a).logits, forward(model, ids[:, 22:], b).logits)


@pytest.mark.quick
def test_reorder_cache_permutes_every_tier():
    model = tiny_model("llama")
    cache = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8, demote_block=2)
    with torch.no_grad():
        forward(model, ids_of(3, 40), cache)
    before = [layer.dense_kv() for layer in cache.layers]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for (k, v), layer in zip(before, cache.layers):
        k2, v2 = layer.dense_kv()
        assert torch.equal(k2, k[beam_idx]) and torch.equal(v2, v[beam_idx])
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[0].batch_size == 1
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].batch_size == 2 and cache.layers[0].history.key_codes.shape[0] == 2


def test_deepcopy_reuses_a_prefilled_prompt_across_requests():
    model = tiny_model("qwen3")
    prompt = ids_of(1, 50)
    tiers = dict(method="hadamard", sink_tokens=4, recent_tokens=8, demote_block=2)

    def prefill(cache):
        with torch.no_grad():
            forward(model, prompt[:, :-1], cache)
        return cache

    prefilled = prefill(OscarCache(model, **tiers))
    snapshot = [layer.dense_kv() for layer in prefilled.layers]
    for seed in (1, 2):
        follow = torch.cat([prompt, ids_of(1, 5, seed)], dim=1)
        # generate continues a cache: only the tokens beyond get_seq_length() are forwarded
        expected = generate(model, follow, prefill(OscarCache(model, **tiers)), max_new_tokens=12)
        reused = generate(model, follow, copy.deepcopy(prefilled), max_new_tokens=12)
        assert torch.equal(reused, expected)
    assert prefilled.get_seq_length() == 49  # the original is untouched
    for (k, v), layer in zip(snapshot, prefilled.layers):
        assert torch.equal(layer.dense_kv()[0], k) and torch.equal(layer.dense_kv()[1], v)
    assert copy.deepcopy(prefilled).rotations is prefilled.rotations


@pytest.mark.quick
def test_reset_empties_every_layer():
    model = tiny_model("llama")
    cache = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8)
    with torch.no_grad():
        forward(model, ids_of(2, 40), cache)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.nbytes() == 0
        forward(model, ids_of(3, 10), cache)  # a new batch size after reset is fine
    assert cache.get_seq_length() == 10


@pytest.mark.quick
def test_nbytes_counts_what_is_stored():
    model = tiny_model("llama").to(torch.bfloat16)
    cache = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8, demote_block=2)
    with torch.no_grad():
        forward(model, ids_of(2, 100), cache)
    batch, heads, d, layers = 2, 2, 16, 2
    bf16 = 12 * batch * heads * 2 * d * 2  # 12 tokens, K and V, 2 bytes
    history = 88 * batch * heads * 2 * (d // 4 + 2 * 2)  # codes + fp16 (scale, zero), K and V
    assert cache.nbytes() == layers * (bf16 + history)
    elements = layers * 100 * batch * heads * 2 * d
    assert cache.bits_per_element() == pytest.approx(8 * cache.nbytes() / elements)
    # 12 BF16 tokens at 16 bits, 88 history tokens at 2 bits + 32 bits of (scale, zero) per 16 elements
    assert cache.bits_per_element() == pytest.approx((12 * 16 + 88 * (2 + 32 / 16)) / 100)


def test_scale_dtype_float32_costs_more_bits():
    model = tiny_model("llama").to(torch.bfloat16)
    sizes = {}
    for dtype in ("float16", "float32"):
        cache = OscarCache(model, method="hadamard", sink_tokens=0, recent_tokens=0, demote_block=1, scale_dtype=dtype)
        with torch.no_grad():
            forward(model, ids_of(1, 64), cache)
        sizes[dtype] = cache.bits_per_element()
    assert sizes == {"float16": pytest.approx(2 + 32 / 16), "float32": pytest.approx(2 + 64 / 16)}


@pytest.mark.quick
def test_batch_size_change_without_reset_fails_clearly():
    model = tiny_model("llama")
    cache = OscarCache(model, method="hadamard")
    with torch.no_grad():
        forward(model, ids_of(2, 10), cache)
        with pytest.raises(ValueError, match="holds a batch of 2 but received 3"):
            forward(model, ids_of(3, 1), cache)


def test_switching_attention_back_falls_back_to_dense_and_stays_correct():
    model = tiny_model("llama")
    ids = ids_of(1, 60)
    cache = OscarCache(model, method="none", sink_tokens=4, recent_tokens=8, demote_block=2)
    model.set_attn_implementation("sdpa")
    out = generate(model, ids, cache, max_new_tokens=10)
    ref = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    assert torch.equal(out, ref)
    assert cache.layers[0].history_length > 0



@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("method", ["none", "hadamard"])
def test_switching_attention_after_a_forward_gets_every_cached_token(method, attention):
    """After an "oscar" prefill the layers decode device-counted, with a mask of their fixed capacity; another
    attention reads the dequantized K/V of every token, and its mask must span them all."""
    ids, step = ids_of(1, 60), ids_of(1, 1, seed=1)
    model = tiny_model("llama")
    cache = OscarCache(model, method=method, sink_tokens=4, recent_tokens=8, demote_block=2)
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        forward(model, ids, cache)
        model.set_attn_implementation(attention)
        forward(model, ids, reference)
        logits = forward(model, step, cache).logits
        expected = forward(model, step, reference).logits
    assert cache.layers[0].history_length > 0
    if method == "none":  # an unquantized history: the same K/V as DynamicCache's
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["none", "hadamard"])
def test_generate_after_switching_attention_continues_the_cache(method):
    ids = ids_of(1, 60)
    model = tiny_model("llama")
    cache = OscarCache(model, method=method, sink_tokens=4, recent_tokens=8, demote_block=2)
    first = generate(model, ids, cache, max_new_tokens=10)
    model.set_attn_implementation("sdpa")
    out = generate(model, first, cache, max_new_tokens=10)
    assert out.shape == (1, 80)
    if method == "none":
        reference = DynamicCache(config=model.config)
        expected = generate(model, generate(model, ids, reference, max_new_tokens=10), reference, max_new_tokens=10)
        assert torch.equal(out, expected)


@pytest.mark.quick
def test_config_validation_messages():
    with pytest.raises(ValueError, match="bits=5"):
        OscarConfig(bits=5)
    with pytest.raises(ValueError, match="recent_tokens=-1"):
        OscarConfig(recent_tokens=-1)
    with pytest.raises(ValueError, match="key_clip_ratio=1.5"):
        OscarConfig(key_clip_ratio=1.5)
    with pytest.raises(ValueError, match="scale_dtype='int8'"):
        OscarConfig(scale_dtype="int8")
    with pytest.raises(TypeError, match=r"unknown OscarConfig option\(s\) \['recent'\]"):
        OscarConfig.from_method("hadamard", recent=3)
    with pytest.raises(ValueError, match="method='fast'"):
        OscarConfig.from_method("fast")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="method='oscar' needs calibrated rotations"):
        OscarCache(model, method="oscar")


@pytest.mark.parametrize("option, expected", [
    (dict(sink_tokens=True), "sink_tokens=True: expected an int, got bool"),
    (dict(high_precision_layers=[True]), "high_precision_layers=[True]: expected a list of layer indices"),
    (dict(key_clip_ratio=True), "key_clip_ratio=True: expected a float in (0, 1] or None, got bool"),
    (dict(quantize="false"), "quantize='false': expected a bool"),
    (dict(fold_value_rotation="false"), "fold_value_rotation='false': expected a bool"),
    (dict(recorded_clip_ratios="no"), "recorded_clip_ratios='no': expected a bool"),
])
def test_an_option_of_another_type_is_refused_with_the_type_expected(option, expected):
    """A bool is an int to Python, and a non-empty string is true: neither may pass for a count or a flag."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        OscarCache(tiny_model("llama"), method="hadamard", **option)


@pytest.mark.parametrize("option, expected", [
    (dict(bits=2.0), "bits=2.0: expected the int 2, 3 or 4, got float"),
    (dict(max_cache_len=50.5), "max_cache_len=50.5: expected an int, got float"),
    (dict(max_cache_len=1e30), "max_cache_len=1e+30: expected an int, got float"),
    (dict(max_cache_len=10**18), f"max_cache_len={10**18}: expected an int from 1 to 2147483648"),
    (dict(recent_tokens=10**18), f"recent_tokens={10**18}: expected an int from 0 to 2147483648"),
    (dict(sink_tokens=10**18), f"sink_tokens={10**18}: expected an int from 0 to 2147483648"),
])
def test_a_float_or_absurd_size_is_refused_at_construction(option, expected):
    """Accepted, these failed in the first forward, deep inside torch ("type must be tuple of ints", "Storage size
    calculation overflowed", "can't allocate memory")."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        OscarCache(tiny_model("llama"), method="hadamard", **option)
