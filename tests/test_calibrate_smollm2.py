"""Real model: calibrating SmolLM2-135M on offline text, and the shipped SmolLM2 rotations, beat data-free Hadamard
on held-out text (attention-error proxy; the perplexity tables are in docs/calibration.md)."""

import os

import pytest

from oscar_hf import OscarCache, Rotations
from oscar_hf.calibrate import CalibrationSettings, calibrate, load_documents, token_sequences
from oscar_hf.calibrate.attention_error import AttentionErrorProbe, Candidate
from oscar_hf.calibrate.capture import feed
from oscar_hf.calibrate.clip_search import clip_ratios_from_metadata
from oscar_hf.eval.assets import play_tokens

pytestmark = pytest.mark.slow

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "rotations", "smollm2-135m")


def proxy(model, ids, candidates):
    probe = AttentionErrorProbe(candidates, range(30), sink=64, recent=256, query_stride=4)
    feed(model, [ids], observer=probe)
    return probe.summary()


def test_calibration_on_offline_text_beats_hadamard_on_held_out_text(smollm2):
    model, tokenizer = smollm2
    sequences = token_sequences(tokenizer, load_documents("shakespeare"), tokens=4096, context=2048)
    rotations = calibrate(model, sequences, CalibrationSettings(key_objective="ktk", value_objective="vtv",
                                                                per_head=True))
    assert rotations.per_head and rotations.layer_ids == list(range(30))
    ids = play_tokens(tokenizer, "lear_gut.txt", 1024)
    errors = proxy(model, ids, {"calibrated": Candidate(rotations),
                                "hadamard": Candidate(Rotations.hadamard(range(30), 64)),
                                "identity": Candidate(None, None, None)})
    print(errors)
    assert errors["calibrated"]["kl"] < 0.95 * errors["hadamard"]["kl"]
    assert errors["calibrated"]["rel_mse"] < errors["hadamard"]["rel_mse"]
    assert errors["hadamard"]["kl"] < errors["identity"]["kl"] / 2


@pytest.mark.quick
@pytest.mark.skipif(not os.path.isdir(SHIPPED), reason="no shipped SmolLM2 rotations in this checkout")
def test_the_shipped_smollm2_rotations_fit_the_model_with_their_searched_clip_ratios(smollm2):
    model, _ = smollm2
    cache = OscarCache(model, rotations=SHIPPED, method="oscar")  # checks layers, head_dim, KV heads
    key_clips, _ = clip_ratios_from_metadata(cache.rotations.metadata)
    assert cache.rotations.per_head and key_clips is not None
    assert [layer.config.key_clip_ratio for layer in cache.layers[:2]] == [key_clips[0], key_clips[1]]


@pytest.mark.skipif(not os.path.isdir(SHIPPED), reason="no shipped SmolLM2 rotations in this checkout")
def test_shipped_smollm2_rotations_load_and_beat_hadamard(smollm2):
    model, tokenizer = smollm2
    rotations = Rotations.from_pretrained(SHIPPED)
    key_clips, value_clips = clip_ratios_from_metadata(rotations.metadata)
    assert key_clips is not None
    OscarCache(model, rotations=SHIPPED)  # fits the model (layers, head_dim, KV heads)
    ids = play_tokens(tokenizer, "romeo_and_juliet_gut.txt", 1024)
    encoder = rotations.metadata.get("encoder", "minmax")
    from oscar_hf.calibrate.clip_search import encoder_fake_quantizer

    errors = proxy(model, ids, {
        "shipped": Candidate(rotations, key_clips, value_clips, quantizer=encoder_fake_quantizer(encoder)),
        "hadamard": Candidate(Rotations.hadamard(range(30), 64)),
    })
    print(errors)
    assert errors["shipped"]["kl"] < 0.7 * errors["hadamard"]["kl"]
    assert errors["shipped"]["rel_mse"] < 0.7 * errors["hadamard"]["rel_mse"]
