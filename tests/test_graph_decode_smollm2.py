"""Graph decode's step path on a real model: SmolLM2-135M (Llama, GQA 9/3, head_dim 64) with the shipped calibrated
rotations, a left-padded batch whose prompts reach into the INT2 history, greedy tokens equal to `generate`'s."""

import os

import pytest
import torch

from oscar_hf import OscarCache, graphed_generate
from oscar_hf.compat import cache_argument_name
from oscar_hf.eval.assets import play_tokens

pytestmark = pytest.mark.slow

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "rotations", "smollm2-135m")


def test_left_padded_smollm2_batch_gives_generates_tokens(smollm2):
    model, tokenizer = smollm2
    text = play_tokens(tokenizer, "lear_gut.txt", 900)[0]
    lengths = (900, 610)  # row 1's 290 pads lead its history; each row's sink is its own first 64 real tokens
    ids = torch.full((2, max(lengths)), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, max(lengths) - length:] = text[-length:]
        mask[row, max(lengths) - length:] = 1
    cache = OscarCache(model, rotations=SHIPPED)
    got = graphed_generate(model, ids, cache, 48, attention_mask=mask)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id,
                               **{cache_argument_name(model): OscarCache(model, rotations=SHIPPED)})
    assert cache.layers[0].sink_length == 64
    assert cache.layers[0].row_start.tolist() == [0, 290]
    assert cache.layers[0].history_length == 900 - 64 - 256 + 5 * 8  # 5 demotions of 8 during the 48 steps
    assert torch.equal(got, reference)
