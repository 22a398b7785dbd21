"""The `Cache` contract for any caller (issue 23): `update()` outside a forward, a forward that fails part-way, an
all-or-nothing `crop`, folding refused while caches hold tokens, positive `crop` as the installed transformers
does it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.compat import positive_crop_refused

from conftest import forward, generate, tiny_model

TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=2)


def _kv_of(model, ids):
    """Per-layer K/V of a forward over `ids` (a DynamicCache's), to feed another cache through `update`."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        forward(model, ids, cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("method", ["none", pytest.param("hadamard", marks=pytest.mark.quick)])
def test_cache_filled_through_update_continues_like_one_filled_by_a_forward(method):
    model = tiny_model("llama", seed=2)
    ids = torch.randint(1, 96, (2, 30))
    filled = OscarCache(model, method=method, **TIERS)
    for i, (k, v) in enumerate(_kv_of(model, ids[:, :-1])):
        filled.update(k, v, i)  # prefix caching / KV transfer: no forward, no attention consumes it
    reference = OscarCache(model, method=method, **TIERS)
    with torch.no_grad():
        forward(model, ids[:, :-1], reference)
        a = forward(model, ids[:, -1:], filled).logits
        b = forward(model, ids[:, -1:], reference).logits
    assert [repr(x) for x in filled.layers] == [repr(x) for x in reference.layers]
    torch.testing.assert_close(a, b, rtol=0, atol=0 if method == "none" else 1e-5)
    if method == "none":
        dynamic = DynamicCache(config=model.config)
        with torch.no_grad():
            forward(model, ids[:, :-1], dynamic)
            # the tiers merge by log-sum-exp in float32: equal to SDPA over the same tokens up to rounding
            torch.testing.assert_close(a, forward(model, ids[:, -1:], dynamic).logits, rtol=0, atol=1e-5)


@pytest.mark.quick
def test_update_twice_outside_a_forward_settles_the_first():
    model = tiny_model("llama")
    cache = OscarCache(model, method="none", **TIERS)
    k = torch.randn(1, 2, 5, 16)
    cache.update(k, k, 0)
    cache.update(k, k, 0)
    assert cache.layers[0].get_seq_length() == 10


def test_updates_outside_a_forward_during_decode_settle_alike_after_a_read():
    """Single-token `update()`s after a prefill take the device-counted step path, whose demotion waits for the
    next update. Reading the cache in between (`dense_kv`, as an export does; host counts from there on) must keep
    that pending demotion: the next forward then sees the tiers the step path would give (found by
    tests/test_cache_properties.py)."""
    model = tiny_model("llama", seed=4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 96, (2, 25), generator=generator)
    steps = [torch.randn(2, 2, 1, 16, generator=generator) for _ in range(2)]
    logits, tiers = [], []
    for read in (False, True):
        cache = OscarCache(model, method="hadamard", **TIERS)
        with torch.no_grad():
            forward(model, ids, cache)
        for k in steps:
            for i in range(len(cache.layers)):
                cache.update(k, k, i)
        if read:
            for layer in cache.layers:
                layer.dense_kv()
        with torch.no_grad():
            logits.append(forward(model, ids[:, :1], cache).logits)
        tiers.append([repr(x) for x in cache.layers])
    assert tiers[0] == tiers[1]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


@pytest.mark.quick
def test_forward_that_fails_in_one_layer_is_named_and_appends_nothing_on_retry(monkeypatch):
    model = tiny_model("llama")
    cache = OscarCache(model, method="hadamard", **TIERS)
    ids = torch.randint(1, 96, (1, 20))
    with torch.no_grad():
        forward(model, ids, cache)
    before = [repr(x) for x in cache.layers]
    attention = model.model.layers[1].self_attn

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(attention, "forward", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
        forward(model, ids[:, :3], cache)
    monkeypatch.undo()
    for _ in range(2):  # a retry raises again and changes nothing
        with pytest.raises(RuntimeError, match=r"stopped part-way: layers \[0\] hold its tokens and layers \[1\]"), \
                torch.no_grad():
            forward(model, ids[:, :3], cache)
    assert [repr(x) for x in cache.layers][1] == before[1]
    cache.reset()
    with torch.no_grad():
        assert torch.isfinite(forward(model, ids, cache).logits).all()


@pytest.mark.parametrize("window", [64, 8])
def test_failed_crop_changes_no_layer(window):
    model = tiny_model("gemma2", sliding_window=window)  # sliding and full-attention layers
    cache = OscarCache(model, method="hadamard", **TIERS)
    with torch.no_grad():
        forward(model, torch.randint(1, 96, (1, 40)), cache)
    lengths = [layer.get_seq_length() for layer in cache.layers]
    if window == 64:  # the sliding layers could crop 30; the OSCAR layers refuse before any layer changes
        with pytest.raises(ValueError, match="only the newest"):
            cache.crop(-30)
    else:  # the OSCAR layers could crop 2; transformers' sliding layer refuses (past its window): nothing changes
        with pytest.raises(RuntimeError, match="sliding window size was already reached"):
            cache.crop(-2)
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    if window == 64:
        cache.crop(-2)
        assert [layer.get_seq_length() for layer in cache.layers] == [n - 2 for n in lengths]


def test_positive_crop_follows_the_installed_transformers():
    model = tiny_model("llama")
    cache = OscarCache(model, method="none", **TIERS)
    dynamic = DynamicCache(config=model.config)
    ids = torch.randint(1, 96, (1, 20))
    with torch.no_grad():
        forward(model, ids, cache)
        forward(model, ids, dynamic)
    if positive_crop_refused():
        with pytest.raises((ValueError, RuntimeError)):
            dynamic.crop(18)
        with pytest.raises(ValueError, match="positive value is not supported"):
            cache.crop(18)
        assert cache.get_seq_length() == 20
    else:
        dynamic.crop(18)
        cache.crop(18)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 18


def test_folding_is_refused_while_a_cache_on_the_model_holds_tokens():
    model = tiny_model("llama")
    live = OscarCache(model, method="hadamard", **TIERS)
    with torch.no_grad():
        forward(model, torch.randint(1, 96, (1, 20)), live)
    weights = model.model.layers[0].self_attn.v_proj.weight.clone()
    with pytest.raises(ValueError, match="1 OscarCache\\(s\\) built on it hold tokens"):
        OscarCache(model, method="hadamard", fold_value_rotation=True)
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, weights)
    live.reset()
    OscarCache(model, method="hadamard", fold_value_rotation=True)
    assert not torch.equal(model.model.layers[0].self_attn.v_proj.weight, weights)


@pytest.mark.quick
def test_a_fresh_cache_passed_to_another_model_gives_its_tokens(caplog):
    """A cache built for model A and passed, fresh, to model B of the same shape, still on SDPA: B's attention never
    reads the history through "oscar". Its prefill saw every token in the BF16 tiers, so the cache notices at the
    next forward and returns dequantized K/V from then on: DynamicCache's tokens (the logits were 0.64 apart)."""
    from conftest import VOCAB, generate

    a, b = tiny_model("llama"), tiny_model("llama")
    b.load_state_dict(a.state_dict())
    b.set_attn_implementation("sdpa")
    ids = torch.randint(1, VOCAB, (2, 60), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=12, output_scores=True, return_dict_in_generate=True)
    want = generate(b, ids, DynamicCache(config=b.config), **kw)
    cache = OscarCache(a, method="none", **TIERS)
    got = generate(b, ids, cache, **kw)
    assert cache.layers[0].history_length > 0
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-5, rtol=0)
    assert any("does not attend with 'oscar'" in r.getMessage() for r in caplog.records)


@pytest.mark.quick
@torch.no_grad()
def test_a_filled_cache_pickles_and_continues_as_the_original(tmp_path):
    """`torch.save` / pickle of a filled cache (history, left padding, counted decode running) round-trips, as a
    filled DynamicCache does: the loaded copy continues with the original's tokens and logits, and the original
    is unchanged (it failed on a weak reference before)."""
    import copy
    import pickle

    from conftest import VOCAB

    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    cache = OscarCache(model, method="hadamard", **TIERS)
    out = forward(model, ids, cache, attention_mask=mask)
    token = out.logits[:, -1:].argmax(-1)
    mask = torch.cat([mask, torch.ones_like(token)], 1)
    forward(model, token, cache, attention_mask=mask)  # a decode step: counted decode from here on
    assert cache.layers[0].history_length > 0 and cache.layers[0].counted is not None
    path = tmp_path / "cache.pt"
    torch.save(cache, path)
    copies = [torch.load(path, weights_only=False), pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)]
    assert cache.layers[0].counted is not None  # pickling left the original's counted decode running
    mask = torch.cat([mask, torch.ones_like(token)], 1)
    want = forward(model, token, cache, attention_mask=mask).logits
    for other in copies:
        torch.testing.assert_close(forward(model, token, other, attention_mask=mask).logits, want, atol=0, rtol=0)


def _length(keys):
    return None if keys is None else keys.shape[2]


@pytest.mark.quick
def test_a_model_that_reads_layer_keys_gets_every_token_and_changes_nothing():
    """transformers >= 5.24's Mllama reads `cache.layers[i].keys` in every forward. An OSCAR layer answers with every
    token's K/V in time order, history dequantized (unquantized here: DynamicCache's, up to the float rounding of one
    forward over the whole sequence against token-by-token steps), and the read, made
    before each layer's update while decode counts on the device, leaves the tokens as they were."""
    model = tiny_model("llama", seed=5)
    ids = torch.randint(1, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    runs, reads = [], []
    for read in (False, True):
        cache = OscarCache(model, method="none", **TIERS)
        hook = model.model.layers[1].register_forward_pre_hook(
            lambda module, args: reads.append(_length(cache.layers[1].keys)) if read else None)
        try:
            with torch.no_grad():
                runs.append(generate(model, ids, cache, max_new_tokens=12))
        finally:
            hook.remove()
    assert torch.equal(runs[0], runs[1])
    assert reads == [None] + list(range(30, 30 + 11))  # nothing before the prefill, then every cached token
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        forward(model, runs[1][:, :-1], dense)
    layer = cache.layers[1]
    assert layer.history_length > 0
    torch.testing.assert_close(layer.keys, dense.layers[1].keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(layer.values, dense.layers[1].values, rtol=0, atol=1e-6)
    with pytest.raises(AttributeError, match="read-only"):
        layer.keys = layer.keys


def _decoding_cache() -> tuple[OscarCache, torch.Generator]:
    """A cache of a tiny Llama after a prompt of 25 tokens in a batch of 2 (counted decode from the next step), and
    the generator that drew the prompt."""
    generator = torch.Generator().manual_seed(0)
    model = tiny_model("llama", seed=4)
    cache = OscarCache(model, method="hadamard", **TIERS)
    with torch.no_grad():
        forward(model, torch.randint(1, 96, (2, 25), generator=generator), cache)
    return cache, generator


def test_reading_a_layer_in_counted_decode_changes_nothing():
    """The device holds the counts during counted decode; `repr`, `history_length`, `nbytes`, `num_elements` and
    `counts` read them there and change nothing: neither the counting mode, nor its counts, nor the history's own
    count (issue 57: reading the layer changed it). What they say is what host counting holds once counted decode
    stops."""
    cache, generator = _decoding_cache()
    k = torch.randn(2, 2, 1, 16, generator=generator)
    for _ in range(6):
        for i in range(len(cache.layers)):
            cache.update(k, k, i)
    layer = cache.layers[0]
    assert layer.counted is not None
    counted, counts, stored = layer.counted, layer.counted.counts.clone(), layer.history.length
    read = (repr(layer), layer.history_length, layer.nbytes(), layer.num_elements(), layer.counts())
    assert layer.counted is counted and torch.equal(counted.counts, counts) and layer.history.length == stored
    layer.stop_counted_decode()
    assert layer.counted is None and layer.history.length != stored  # the steps demoted tokens
    assert (repr(layer), layer.history_length, layer.nbytes(), layer.num_elements(), layer.counts()) == read


def test_crop_problem_in_counted_decode_says_what_crop_will_do():
    """During counted decode, `crop_problem` reads the counts as host counting would hold them, a step that no
    attention closed (an `update` outside a forward) included, and changes nothing; the crop itself hands over to
    host counting first. So the largest crop it allows is the one `crop` takes, at every point of the demotion
    cycle."""
    cache, generator = _decoding_cache()
    layers = range(len(cache.layers))
    for _ in range(2 * TIERS["demote_block"] + 1):
        k = torch.randn(2, 2, 1, 16, generator=generator)
        for i in layers:
            cache.update(k, k, i)
        layer = cache.layers[0]
        counted = layer.counted
        host = copy.deepcopy(layer)
        host.stop_counted_decode()
        most = host.mode.croppable()
        assert layer.crop_problem(-most) is None and layer.crop_problem(-(most + 1)) is not None
        assert layer.counted is counted  # asking changed nothing
        cropped = copy.deepcopy(cache)
        cropped.crop(-most)
        assert cropped.get_seq_length() == layer.counts()[0] - most
        with pytest.raises(ValueError, match="already quantized"):
            copy.deepcopy(cache).crop(-(most + 1))


def test_both_counting_modes_answer_the_calls_the_layer_makes():
    """The layer asks whichever counting mode is current, without checking which (`layer`): a call one of them
    lacks would fail only on that mode's path."""
    from oscar_hf.counted_decode import CountedDecode
    from oscar_hf.host_counts import HostCounts

    calls = {"host_counts", "seq_length", "mask_sizes", "takes", "append", "settle", "close", "segment", "host_view",
             "to_host", "reorder_in_place", "counted"}
    for mode in (HostCounts, CountedDecode):
        assert all(callable(getattr(mode, name)) or name == "counted" for name in calls), mode
    assert HostCounts.counted is False and CountedDecode.counted is True
