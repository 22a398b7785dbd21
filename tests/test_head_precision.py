"""Precision per KV head (`OscarConfig.high_precision_heads`, `head_groups`): a layer's history kept as runs of
KV heads of different code widths. What it stores, that splitting alone changes nothing, that the simulation
still equals decoding, the `oscar-next` preset's ranked heads, and the ranking itself."""

from __future__ import annotations

import json
import math

import pytest
import torch

from oscar_hf import OscarCache, Rotations
from oscar_hf.compat import cache_argument_name
from oscar_hf.config import OscarConfig
from oscar_hf.eval.decode_equivalent import simulate_logits
from oscar_hf.head_groups import head_runs
from oscar_hf.history import HeadSplitHistory, QuantizedHistory
from oscar_hf.kernels.reference.quantize import COMPACT
from oscar_hf.rotations.rotations import RETRIEVAL_HEADS_KEY, RotationFileError

from conftest import forward, tiny_model

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=3)
# no clip and min-max rows: the settings a high-precision run takes, so that at `high_precision_bits=2` a split
# layer stores exactly what an unsplit one does
PLAIN = dict(key_clip_ratio=None, value_clip_ratio=None, **LAYOUT)


def three_head_model(seed: int = 0):
    """GQA 6:3, so that one high-precision head in the middle leaves runs [0], [1], [2]."""
    return tiny_model("llama", seed=seed, num_attention_heads=6, num_key_value_heads=3)


def per_head_rotations(layers=(0, 1), heads: int = 3, dim: int = 16, seed: int = 0) -> Rotations:
    """A different random orthogonal rotation per KV head (a run that took another head's rotation would show)."""
    g = torch.Generator().manual_seed(seed)
    tables = [{i: torch.linalg.qr(torch.randn(heads, dim, dim, generator=g))[0] for i in layers} for _ in "kv"]
    return Rotations(*tables)


@pytest.mark.quick
def test_config_takes_head_pairs_and_narrows_them_per_layer():
    config = OscarConfig(high_precision_heads=[(3, 1), [1, 0], (3, 1)])
    assert config.high_precision_heads == ((1, 0), (3, 1)) and config.code_widths == (2, 4)
    assert config.for_layer(3).high_precision_heads == ((3, 1),) and config.for_layer(0).high_precision_heads == ()
    assert config.high_precision_kv_heads(3) == (1,)
    assert OscarConfig(high_precision_layers=[3], high_precision_heads=[(3, 1)]).high_precision_kv_heads(3) == ()
    assert OscarConfig.from_dict(config.to_dict()) == config and config.to_dict()["high_precision_heads"] == [[1, 0],
                                                                                                             [3, 1]]
    for bad in ([1, 2], [(1, -1)], [(1, 2, 3)], "ab", [(0.5, 1)]):
        with pytest.raises(ValueError, match="high_precision_heads"):
            OscarConfig(high_precision_heads=bad)
    with pytest.raises(ValueError, match=r"high_precision_heads \[\(0, 3\)\] are not KV heads"):
        OscarCache(three_head_model(), high_precision_heads=[(0, 3)])
    with pytest.raises(ValueError, match=r"\(5, 0\)"):
        OscarCache(three_head_model(), high_precision_heads=[(5, 0)])


@pytest.mark.quick
def test_head_runs_are_maximal_runs_of_one_precision():
    assert head_runs(3, [1]) == [(0, 1, False), (1, 2, True), (2, 3, False)]
    assert head_runs(4, [2, 3]) == [(0, 2, False), (2, 4, True)]
    assert head_runs(2, []) == [(0, 2, False)]
    with pytest.raises(ValueError, match="do not exist"):
        head_runs(2, [2])


@pytest.mark.parametrize("batch_kwargs",
                         [pytest.param(dict(), marks=pytest.mark.quick), dict(num_beams=2), dict(padded=True)],
                         ids=["greedy", "beams", "padded"])
def test_a_split_layer_at_the_same_width_generates_what_an_unsplit_one_does(batch_kwargs):
    """Splitting a layer into runs of heads (here [0], [1], [2], each with its own rotation) and attending run by
    run, through prefill, counted decode, beam reorders and left padding, must not change a single token."""
    model = three_head_model(seed=2)
    rotations = per_head_rotations()
    ids = torch.randint(1, 96, (2, 40))
    mask = None
    if batch_kwargs.pop("padded", False):
        mask = torch.ones_like(ids)
        mask[1, :7] = 0
        ids[1, :7] = 0
    outputs, caches = [], []
    for heads in ((), ((0, 1), (1, 0), (1, 2))):
        cache = OscarCache(model, rotations=rotations, method="oscar", high_precision_heads=heads,
                           high_precision_bits=2, **PLAIN)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             return_dict_in_generate=True, output_scores=True, **{cache_argument_name(model): cache}, **batch_kwargs)
        outputs.append(out)
        caches.append(cache)
    plain, split = outputs
    assert isinstance(caches[1].layers[0].history, HeadSplitHistory)
    assert isinstance(caches[0].layers[0].history, QuantizedHistory) and caches[1].layers[0].history_length > 0
    assert torch.equal(plain.sequences, split.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(plain.scores, split.scores)) < 1e-4
    assert caches[0].nbytes() == caches[1].nbytes()
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.dense_kv(), b.dense_kv()))


def test_a_4_bit_head_stores_its_rows_at_4_bits_and_the_simulation_still_equals_decoding():
    model = three_head_model(seed=3)
    rotations = per_head_rotations(seed=1)
    ids = torch.randint(1, 96, (1, 40))
    heads = ((0, 1), (1, 0), (1, 1))
    mixed = OscarCache(model, rotations=rotations, method="oscar", high_precision_heads=heads, **LAYOUT)
    plain = OscarCache(model, rotations=rotations, method="oscar", **LAYOUT)
    forward(model, ids[:, :30], mixed)
    forward(model, ids[:, :30], plain)
    widths = [[(start, stop, h.config.bits, h.config.key_clip_ratio) for start, stop, h in layer.history.parts]
              for layer in mixed.layers]
    assert widths == [[(0, 1, 2, 0.96), (1, 2, 4, None), (2, 3, 2, 0.96)], [(0, 2, 4, None), (2, 3, 2, 0.96)]]
    rows = mixed.layers[0].history_length
    assert mixed.nbytes() - plain.nbytes() == 3 * 2 * rows * 4  # 3 heads at 4 bits, K and V, 4 more code bytes

    exact = OscarCache(model, rotations=rotations, method="none", **LAYOUT)
    forward(model, ids[:, :30], exact)
    error = [(cache.layers[0].dense_kv()[0] - exact.layers[0].dense_kv()[0]).square().mean(dim=(0, 2, 3))
             for cache in (mixed, plain)]
    assert error[0][1] < error[1][1] / 10 and torch.allclose(error[0][[0, 2]], error[1][[0, 2]])

    template = OscarCache(model.config, rotations=rotations, method="oscar", high_precision_heads=heads, **LAYOUT)
    simulated = simulate_logits(model, ids, template, prefill=20)
    cache = OscarCache(model, rotations=rotations, method="oscar", high_precision_heads=heads, **LAYOUT)
    pieces = [forward(model, ids[:, :20], cache).logits]
    pieces += [forward(model, ids[:, t:t + 1], cache).logits for t in range(20, ids.shape[1])]
    assert (simulated - torch.cat(pieces, 1)).abs().max().item() < 1e-5
    uniform = simulate_logits(model, ids, OscarCache(model.config, rotations=rotations, method="oscar", **LAYOUT),
                              prefill=20)
    assert (simulated - uniform).abs().max().item() > 1e-4


def test_oscar_next_keeps_the_top_tenth_of_the_ranked_heads_at_4_bits_under_2_5_bits(tmp_path):
    model = tiny_model("llama", seed=3, num_hidden_layers=10, head_dim=64, hidden_size=256)
    rotations = Rotations.hadamard(list(range(10)), 64)
    with pytest.raises(ValueError, match="record no ranking of those KV heads"):
        OscarCache(model, rotations=rotations, method="oscar-next")
    ranking = [[7, 1], [3, 0]] + [[layer, head] for layer in range(10) for head in range(2)
                                  if [layer, head] not in ([7, 1], [3, 0])]
    rotations.metadata[RETRIEVAL_HEADS_KEY] = json.dumps(ranking)
    cache = OscarCache(model, rotations=rotations, method="oscar-next")
    config = cache.oscar_config
    assert config.high_precision_heads == ((3, 0), (7, 1)) and config.high_precision_layers == ()
    assert config.encoder == "sigma" and config.scale_dtype == COMPACT
    ids = torch.randint(1, 96, (1, 2400))
    forward(model, ids, cache)
    parts = {(start, stop): (h.config.bits, h.config.encoder, h.config.scale_dtype)
             for start, stop, h in cache.layers[7].history.parts}
    # the 4-bit run keeps float16 pairs, which the GPU kernel reads faster than compact ones
    assert parts == {(0, 1): (2, "sigma", COMPACT), (1, 2): (4, "minmax", torch.float16)}
    history_bits = 8 * sum(layer.history.nbytes() for layer in cache.layers) / sum(
        layer.history_length * 2 * 2 * 64 for layer in cache.layers)
    assert math.isclose(history_bits, (18 * 2.25 + 2 * 4.5) / 20, rel_tol=1e-9) and history_bits <= 2.5
    cache.save_pretrained(tmp_path)
    again = OscarCache.from_pretrained(model, tmp_path)
    assert again.oscar_config == config
    explicit = OscarCache(model, rotations=rotations, method="oscar-next", high_precision_heads=[(0, 0)])
    assert explicit.oscar_config.high_precision_heads == ((0, 0),)


@pytest.mark.quick
def test_a_malformed_head_ranking_is_refused_when_the_rotations_load(tmp_path):
    rotations = Rotations.hadamard([0, 1], 16)
    for bad, match in (("[[0, 1], [0, 1]]", "more than once"), ("[[0, -1]]", "pairs"), ("[0, 1]", "pairs"),
                       ("[[4, 0]]", "lack")):
        rotations.metadata[RETRIEVAL_HEADS_KEY] = bad
        with pytest.raises(RotationFileError, match=match):
            rotations.retrieval_heads()


def test_heads_are_ranked_recorded_and_reloaded(tmp_path):
    import transformers

    from oscar_hf.calibrate.retrieval_layers import rank_retrieval_heads, record_retrieval_heads

    from conftest import char_tokenizer, tiny_llama

    base = tiny_llama(layers=2)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base.config.to_dict() | {"vocab_size": 128}))
    tokenizer = char_tokenizer()
    rotations = Rotations.hadamard([0, 1], 32)
    template = OscarCache(model.config, rotations=rotations, method="hadamard", **LAYOUT)
    ranking = rank_retrieval_heads(model.eval(), tokenizer, template, lengths=[600], depths=[0.3, 0.7],
                                   kinds=["number"], progress=False)
    assert sorted(ranking) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    record_retrieval_heads(rotations, ranking)
    rotations.save_pretrained(tmp_path)
    assert Rotations.from_pretrained(tmp_path).retrieval_heads() == ranking
    cache = OscarCache(model, rotations=str(tmp_path), method="oscar-next", **LAYOUT)
    assert cache.oscar_config.high_precision_heads == (ranking[0],)  # a tenth of 4 heads, rounded up
