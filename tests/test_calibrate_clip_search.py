"""The attention-error probe and the clip search built on it."""

import pytest
import torch

from calibrate.attention_error import AttentionErrorProbe, Candidate, reference_fake_quantize
from calibrate.capture import capturing, feed
from calibrate.clip_search import apply_clip_ratios, clip_grid, clip_ratios_from_metadata, search_clip_ratios
from oscar_hf import OscarCache, Rotations
from oscar_hf.quantize import clip_index

from conftest import forward, tiny_model


def test_clip_grid_covers_distinct_order_statistics():
    grid = clip_grid(64, lowest=0.9)
    assert grid[-1] is None
    assert [clip_index(r, 64) for r in grid[:-1]] == list(range(57, 63))


class Keep:
    def __call__(self, module, query, key, value, scaling, softcap=None):
        self.last = (module, query, key, value, scaling)


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

    with capturing(model, both):
        feed(model, [ids])
    module, q, k, v, scaling = keep.last
    h = rotations.key[1]
    k_hat = reference_fake_quantize(k[0] @ h, 2, 0.5, torch.float16) @ h.T
    v_hat = reference_fake_quantize(v[0] @ h, 2, None, torch.float16) @ h.T
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
    with capturing(model, probe):
        feed(model, [ids])
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
    assert torch.equal(plain.layers[1].history.key_codes, clipped.layers[1].history.key_codes)  # same 0.96
    assert not torch.equal(plain.layers[0].history.key_codes, clipped.layers[0].history.key_codes)
    with pytest.raises(ValueError, match="fresh cache"):
        apply_clip_ratios(clipped, 0.9, 0.9)
