"""Layers kept at higher precision (`OscarConfig.high_precision_layers`): what they store, what they cost, and that
the decode-equivalent simulation and the real cache still agree."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, Rotations
from oscar_hf.config import OscarConfig
from oscar_hf.eval.decode_equivalent import simulate_logits

from conftest import forward, tiny_model

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=3)


@pytest.mark.quick
def test_config_gives_each_layer_its_width_and_rejects_bad_layer_lists():
    config = OscarConfig(high_precision_layers=[3, 1, 1])
    assert config.high_precision_layers == (1, 3) and config.code_widths == (2, 4)
    wide, plain = config.for_layer(3), config.for_layer(0)
    assert (wide.bits, wide.key_clip_ratio, wide.value_clip_ratio) == (4, None, None)
    assert plain is config and OscarConfig().code_widths == (2,)
    for bad in (3, [-1], ["0"]):
        with pytest.raises(ValueError, match="high_precision_layers"):
            OscarConfig(high_precision_layers=bad)
    with pytest.raises(ValueError, match="high_precision_bits=5"):
        OscarConfig(high_precision_bits=5)
    with pytest.raises(ValueError, match=r"high_precision_layers \[7\] are not full-attention layers"):
        OscarCache(tiny_model("llama", seed=1), high_precision_layers=(7,))


@pytest.mark.quick
def test_presets_clip_only_2_bit_rows():
    assert (OscarConfig.from_method("hadamard").key_clip_ratio, OscarConfig.from_method("hadamard").bits) == (0.96, 2)
    four = OscarConfig.from_method("hadamard", bits=4)
    assert (four.key_clip_ratio, four.value_clip_ratio) == (None, None)
    asked = OscarConfig.from_method("oscar", bits=4, key_clip_ratio=0.9)
    assert (asked.key_clip_ratio, asked.value_clip_ratio) == (0.9, None)


def test_a_high_precision_layer_stores_4_bit_rows_and_the_simulation_still_equals_decoding(tmp_path):
    model = tiny_model("llama", seed=3)
    ids = torch.randint(1, 96, (1, 40))
    # a rotations file whose recorded 2-bit clips must not reach the 4-bit layer
    rotations = Rotations.hadamard([0, 1], 16)
    rotations.metadata.update(key_clip_ratio=json.dumps(0.5), value_clip_ratio=json.dumps(0.5))
    mixed = OscarCache(model, rotations=rotations, high_precision_layers=(1,), **LAYOUT)
    assert [(layer.config.bits, layer.config.key_clip_ratio) for layer in mixed.layers] == [(2, 0.5), (4, None)]
    plain = OscarCache(model, rotations=rotations, **LAYOUT)
    forward(model, ids[:, :30], mixed)
    forward(model, ids[:, :30], plain)
    history = mixed.layers[1].history
    assert history.key_codes.shape[-1] == 8 and mixed.layers[0].history.key_codes.shape[-1] == 4  # d=16
    assert mixed.nbytes() - plain.nbytes() == 2 * 2 * 18 * 4  # K and V, 2 heads, 18 rows, 4 more code bytes each

    exact = DynamicCache(config=model.config)
    forward(model, ids[:, :30], exact)

    def key_error(cache):
        return (cache.layers[1].dense_kv()[0] - exact.layers[1].keys).square().mean().item()

    assert key_error(mixed) < key_error(plain) / 10  # 4-bit unclipped rows against 2-bit rows clipped at 0.5

    simulated = simulate_logits(model, ids, OscarCache(model.config, rotations=rotations, high_precision_layers=(1,),
                                                       **LAYOUT), prefill=20)
    cache = OscarCache(model, rotations=rotations, high_precision_layers=(1,), **LAYOUT)
    pieces = [forward(model, ids[:, :20], cache).logits]
    pieces += [forward(model, ids[:, t:t + 1], cache).logits for t in range(20, ids.shape[1])]
    assert (simulated - torch.cat(pieces, 1)).abs().max().item() < 1e-5
    all_two = simulate_logits(model, ids, OscarCache(model.config, rotations=rotations, **LAYOUT), prefill=20)
    assert (simulated - all_two).abs().max().item() > 1e-4


def test_retrieval_ranking_is_recorded_and_oscar_hifi_keeps_its_top_layers_at_4_bits(tmp_path):
    import transformers

    from oscar_hf.calibrate.retrieval_layers import rank_retrieval_layers, record_retrieval_layers
    from oscar_hf.config import PRESETS

    from conftest import char_tokenizer, tiny_llama

    base = tiny_llama(layers=4)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base.config.to_dict() | {"vocab_size": 128}))
    tokenizer = char_tokenizer()
    rotations = Rotations.hadamard([0, 1, 2, 3], 32)
    template = OscarCache(model.config, rotations=rotations, method="hadamard", **LAYOUT)
    ranking = rank_retrieval_layers(model.eval(), tokenizer, template, lengths=[600], depths=[0.3, 0.7],
                                    kinds=["number"], progress=False)
    assert sorted(ranking) == [0, 1, 2, 3]
    assert ranking == rank_retrieval_layers(model, tokenizer, template, lengths=[600], depths=[0.3, 0.7],
                                            kinds=["number"], progress=False)
    with pytest.raises(ValueError, match="record no ranking of those layers"):
        OscarCache(model, rotations=rotations, method="oscar-hifi", **LAYOUT)
    record_retrieval_layers(rotations, ranking)
    rotations.save_pretrained(tmp_path)
    loaded = Rotations.from_pretrained(tmp_path)
    assert loaded.retrieval_layers() == ranking
    hifi = OscarCache(model, rotations=str(tmp_path), method="oscar-hifi", **LAYOUT)
    kept = ranking[:math.ceil(PRESETS['oscar-hifi'].high_precision_layer_share * 4)]
    assert hifi.oscar_config.high_precision_layers == tuple(sorted(kept))
    assert [layer.config.bits for layer in hifi.layers] == [4 if i in kept else 2 for i in range(4)]
    explicit = OscarCache(model, rotations=loaded, method="oscar-hifi", high_precision_layers=(0, 3), **LAYOUT)
    assert [layer.config.bits for layer in explicit.layers] == [4, 2, 2, 4]
    loaded.metadata["retrieval_layers"] = "[0, 9]"
    with pytest.raises(Exception, match="lack"):
        OscarCache(model, rotations=loaded, method="oscar-hifi", **LAYOUT)


@pytest.mark.quick
def test_ranked_rotations_default_to_oscar_mixed_unless_a_row_format_is_asked_for(tmp_path):
    """Rotations that record a layer ranking give `oscar-mixed` when no method is named: sigma rows with compact
    pairs, the top tenth of the ranked layers (at least one) at 4 bits; a named method, any row-format option, or
    rotations without a ranking keep `oscar`. The setup survives save_pretrained / from_pretrained."""
    from oscar_hf.calibrate.retrieval_layers import record_retrieval_layers
    from oscar_hf.kernels.reference.quantize import COMPACT

    from conftest import tiny_llama

    model = tiny_llama(layers=4)
    rotations = Rotations.hadamard([0, 1, 2, 3], 32)
    assert OscarCache(model, rotations=rotations, **LAYOUT).oscar_config.method == "oscar"
    record_retrieval_layers(rotations, [2, 0, 3, 1])
    cache = OscarCache(model, rotations=rotations, **LAYOUT)
    config = cache.oscar_config
    assert (config.method, config.encoder, config.scale_dtype, config.key_clip_ratio) == ("oscar-mixed", "sigma",
                                                                                          COMPACT, None)
    assert config.high_precision_layers == (2,)
    assert [(layer.config.bits, layer.config.scale_dtype) for layer in cache.layers] == [
        (2, COMPACT), (2, COMPACT), (4, torch.float16), (2, COMPACT)]
    for asked in (dict(method="oscar"), dict(bits=4), dict(encoder="minmax"), dict(key_clip_ratio=0.9),
                  dict(high_precision_layers=(1,))):
        assert OscarCache(model, rotations=rotations, **LAYOUT, **asked).oscar_config.method == "oscar", asked
    ids = torch.randint(1, 96, (1, 30))
    forward(model, ids, cache)
    cache.save_pretrained(tmp_path)
    rebuilt = OscarCache.from_pretrained(model, tmp_path)
    assert rebuilt.oscar_config == config
