"""The attention-error probe and the clip search built on it."""

import pytest
import torch

from oscar_hf import OscarCache, Rotations
from oscar_hf.calibrate.attention_error import AttentionErrorProbe, Candidate
from oscar_hf.calibrate.capture import feed
from oscar_hf.calibrate.clip_search import apply_clip_ratios, clip_grid, clip_ratios_from_metadata, search_clip_ratios
from oscar_hf.kernels.reference.quantize import clip_index, fake_quantize

from conftest import forward, stored, tiny_model


@pytest.mark.quick
def test_clip_grid_covers_distinct_order_statistics():
    grid = clip_grid(64, lowest=0.9)
    assert grid[-1] is None
    assert [clip_index(r, 64) for r in grid[:-1]] == list(range(57, 63))


class Keep:
    def __call__(self, module, query, key, value, scaling, softcap=None):
        self.last = (module, query, key, value, scaling)


@pytest.mark.quick
def test_probe_matches_a_hand_computation():
    model = tiny_model("llama", seed=1)
    ids = torch.randint(1, 96, (1, 60))
    rotations = Rotations.hadamard([0, 1], 16)
    candidate = Candidate(rotations, key_clip=0.5, value_clip=None)
    probe = AttentionErrorProbe({"h": candidate}, [1], sink=4, recent=8)
    keep = Keep()

    def both(*args):
        probe(*args)
        if args[0].layer_idx == 1:
            keep(*args)

    feed(model, [ids], observer=both)
    module, q, k, v, scaling = keep.last
    h = rotations.key[1]
    k_hat = fake_quantize(k[0] @ h, 2, 0.5, torch.float16) @ h.T
    v_hat = fake_quantize(v[0] @ h, 2, None, torch.float16) @ h.T
    kl_sum, err_sum, ref_sum, queries = 0.0, 0.0, 0.0, 0
    for p in range(13, 60):  # queries that see at least one quantized key: p >= sink + recent + 1
        hist = torch.zeros(60, dtype=torch.bool)
        hist[4 : p - 8] = True
        outs, outs_hat = [], []
        for head in range(4):
            kv = head // 2
            keys = k[0, kv, : p + 1]
            keys_hat = torch.where(hist[: p + 1, None], k_hat[kv, : p + 1], keys)
            values_hat = torch.where(hist[: p + 1, None], v_hat[kv, : p + 1], v[0, kv, : p + 1])
            prob = torch.softmax(q[0, head, p] @ keys.T * scaling, -1)
            prob_hat = torch.softmax(q[0, head, p] @ keys_hat.T * scaling, -1)
            kl_sum += (prob * (prob.log() - prob_hat.log())).sum().item()
            outs.append(prob @ v[0, kv, : p + 1])
            outs_hat.append(prob_hat @ values_hat)
        o, o_hat = module.o_proj.weight @ torch.cat(outs), module.o_proj.weight @ torch.cat(outs_hat)
        err_sum += (o_hat - o).square().sum().item()
        ref_sum += o.square().sum().item()
        queries += 1
    error = probe.errors["h"][1]
    assert error.queries == queries == 47
    assert error.kl == pytest.approx(kl_sum / (queries * 4), rel=1e-3)  # float32 logs of a small KL
    assert error.rel_mse == pytest.approx(err_sum / ref_sum, rel=1e-4)
    assert error.rel_mse > 0


def test_probe_is_zero_without_quantization_and_ranks_naive_int2_worst():
    model = tiny_model("llama", seed=2)
    ids = torch.randint(1, 96, (1, 80))
    exact = Candidate(None, quantizer=lambda rows, bits, clip, dtype: rows)
    candidates = {"exact": exact, "naive": Candidate(None, None, None),
                  "hadamard": Candidate(Rotations.hadamard([0, 1], 16), 0.96, 0.92)}
    probe = AttentionErrorProbe(candidates, [0, 1], sink=4, recent=8)
    feed(model, [ids], observer=probe)
    summary = probe.summary()
    assert summary["exact"]["kl"] == pytest.approx(0, abs=1e-6)
    assert summary["exact"]["rel_mse"] == pytest.approx(0, abs=1e-10)
    assert summary["naive"]["rel_mse"] > 0 and summary["hadamard"]["rel_mse"] > 0


def test_search_picks_grid_ratios_per_layer_and_per_model():
    model = tiny_model("llama", seed=4)
    sequences = [torch.randint(1, 96, (1, 70))]
    rotations = Rotations.hadamard([0, 1], 16)
    grid = [0.8, 0.9, None]
    per_layer = search_clip_ratios(model, sequences, rotations, [0, 1], 16, per_layer=True, key_grid=grid,
                                   value_grid=grid, sink=4, recent=8)
    assert set(per_layer.key) == {0, 1} and set(per_layer.key.values()) <= set(grid)
    errors = per_layer.errors["key"]
    for layer, ratio in per_layer.key.items():
        assert errors[str(ratio)][layer] == min(errors[str(r)][layer] for r in grid)
    per_model = search_clip_ratios(model, sequences, rotations, [0, 1], 16, per_layer=False, key_grid=grid,
                                   value_grid=grid, sink=4, recent=8)
    assert per_model.key in grid and per_model.value in grid
    assert clip_ratios_from_metadata(per_model.metadata()) == (per_model.key, per_model.value)
    assert clip_ratios_from_metadata(per_layer.metadata()) == (per_layer.key, per_layer.value)
    with pytest.raises(ValueError, match="longer than sink \\+ recent \\+ 1"):
        search_clip_ratios(model, [torch.randint(1, 96, (1, 10))], rotations, [0, 1], 16, sink=4, recent=8)


def test_apply_clip_ratios_changes_what_each_layer_stores():
    model = tiny_model("llama", seed=5)
    ids = torch.randint(1, 96, (1, 40))
    plain = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8)
    clipped = apply_clip_ratios(OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=8),
                                {0: 0.5, 1: 0.96}, {0: 0.92, 1: 0.5})
    assert clipped.layers[0].config.key_clip_ratio == 0.5 and clipped.layers[1].config.value_clip_ratio == 0.5
    forward(model, ids, plain)
    forward(model, ids, clipped)
    assert torch.equal(stored(plain.layers[1], "key_codes"), stored(clipped.layers[1], "key_codes"))  # same 0.96
    assert not torch.equal(stored(plain.layers[0], "key_codes"), stored(clipped.layers[0], "key_codes"))
    with pytest.raises(ValueError, match="fresh cache"):
        apply_clip_ratios(clipped, 0.9, 0.9)


def _rotations_with_clips(tmp_path, key_clips, value_clips):
    """A saved-and-reloaded Hadamard rotations folder recording per-layer clip ratios (as the CLI writes them)."""
    import json

    rotations = Rotations.hadamard([0, 1], 16)
    rotations.metadata.update(key_clip_ratios=json.dumps({str(i): r for i, r in key_clips.items()}),
                              value_clip_ratios=json.dumps({str(i): r for i, r in value_clips.items()}))
    rotations.save_pretrained(tmp_path)
    return Rotations.from_pretrained(tmp_path)


@pytest.mark.quick
def test_cache_applies_the_clip_ratios_its_rotations_record(tmp_path):
    model = tiny_model("llama", seed=5)
    ids = torch.randint(1, 96, (1, 40))
    loaded = _rotations_with_clips(tmp_path, {0: 0.5, 1: None}, {0: 0.92, 1: 0.5})
    assert loaded.clip_ratios(0) == (0.5, 0.92) and loaded.clip_ratios(1) == (None, 0.5)
    layout = dict(sink_tokens=4, recent_tokens=8)
    automatic = OscarCache(model, rotations=str(tmp_path), **layout)
    by_hand = apply_clip_ratios(OscarCache(model, method="hadamard", **layout), {0: 0.5, 1: None}, {0: 0.92, 1: 0.5})
    explicit = OscarCache(model, rotations=loaded, key_clip_ratio=0.96, value_clip_ratio=0.92, **layout)
    assert [layer.config.key_clip_ratio for layer in explicit.layers] == [0.96, 0.96]
    for cache in (automatic, by_hand, explicit):
        forward(model, ids, cache)
    for i in (0, 1):
        assert torch.equal(stored(automatic.layers[i], "key_codes"), stored(by_hand.layers[i], "key_codes"))
        assert torch.equal(stored(automatic.layers[i], "value_codes"), stored(by_hand.layers[i], "value_codes"))
    # 0.5 vs 0.96
    assert not torch.equal(stored(automatic.layers[0], "key_codes"), stored(explicit.layers[0], "key_codes"))


def test_recorded_clip_ratios_apply_only_at_the_code_width_they_were_searched_for(tmp_path):
    model = tiny_model("llama", seed=5)
    loaded = _rotations_with_clips(tmp_path, {0: 0.5, 1: None}, {0: 0.92, 1: 0.5})  # no clip_bits: a 2-bit search
    assert loaded.clip_ratios(0, bits=2) == (0.5, 0.92) and loaded.clip_ratios(0, bits=4) is None
    four = OscarCache(model, rotations=loaded, bits=4, sink_tokens=4, recent_tokens=8)
    assert [(layer.config.key_clip_ratio, layer.config.value_clip_ratio) for layer in four.layers] == [(None, None)] * 2
    loaded.metadata["clip_bits"] = "4"
    assert loaded.clip_ratios(1, bits=4) == (None, 0.5) and loaded.clip_ratios(1, bits=2) is None
    two = OscarCache(model, rotations=loaded, sink_tokens=4, recent_tokens=8)
    assert [layer.config.key_clip_ratio for layer in two.layers] == [0.96, 0.96]
    choice = search_clip_ratios(model, [torch.randint(1, 96, (1, 40))], Rotations.hadamard([0, 1], 16), [0, 1], 16,
                                key_grid=[0.9], value_grid=[0.9], bits=4, sink=4, recent=8)
    assert choice.metadata()["clip_bits"] == "4"


def test_simulation_uses_each_layers_recorded_clip_ratios(tmp_path):
    from oscar_hf.eval.decode_equivalent import simulate_logits

    model = tiny_model("llama", seed=6)
    ids = torch.randint(1, 96, (1, 36))
    loaded = _rotations_with_clips(tmp_path, {0: 0.5, 1: 0.6}, {0: 0.55, 1: 0.5})
    layout = dict(sink_tokens=4, recent_tokens=8, demote_block=3)
    simulated = simulate_logits(model, ids, OscarCache(model.config, rotations=loaded, **layout), prefill=20)
    cache = OscarCache(model, rotations=loaded, **layout)
    pieces = [forward(model, ids[:, :20], cache).logits]
    pieces += [forward(model, ids[:, t:t + 1], cache).logits for t in range(20, ids.shape[1])]
    assert (simulated - torch.cat(pieces, 1)).abs().max().item() < 1e-5
    preset = simulate_logits(model, ids, OscarCache(model.config, method="hadamard", **layout), prefill=20)
    assert (simulated - preset).abs().max().item() > 1e-4


@pytest.mark.quick
def test_unreadable_recorded_clip_ratios_fail_clearly():
    from oscar_hf.rotations.rotations import RotationFileError

    rotations = Rotations.hadamard([0, 1], 16)
    rotations.metadata.update(key_clip_ratios='{"0": 0.9}', value_clip_ratios='{"0": 1.7}')
    with pytest.raises(RotationFileError, match="clip ratios are unreadable for layer 0"):
        rotations.clip_ratios(0)
    with pytest.raises(RotationFileError, match="unreadable for layer 0"):
        OscarCache(tiny_model("llama", seed=1), rotations=rotations)
    rotations.metadata.update(value_clip_ratios='{"0": 0.9}')  # layer 1 missing
    with pytest.raises(RotationFileError, match="unreadable for layer 1: KeyError"):
        OscarCache(tiny_model("llama", seed=1), rotations=rotations)
