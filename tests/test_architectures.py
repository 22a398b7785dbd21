"""The architectures users move to (docs/models.md): linear attention beside full attention, layers that read
another layer's K/V, learned sinks, chunked attention. The cache takes transformers' own layer plan and replaces the
full-attention K/V only; with quantization off it generates as DynamicCache does, on every path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

from oscar_hf import OscarCache
from oscar_hf.compat import compile_config_anywhere
from oscar_hf.layer import OscarLayer
from oscar_hf.model_support import KEPT, QUANTIZED, SHARED, attention_shape

from conftest import VOCAB, cache_argument_name, forward, generate, tiny_model

TIERS = dict(sink_tokens=4, recent_tokens=16, demote_block=4)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs replay on a GPU only")
PROMPT, STEPS = 90, 12


def _padded_prompt(seed: int = 0):
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    return ids, mask


@pytest.mark.quick
@pytest.mark.parametrize("family, kinds, classes", [
    ("qwen3_next", [KEPT] * 3 + [QUANTIZED], [LinearAttentionLayer] * 3 + [OscarLayer]),
    ("nemotron_h", [KEPT, QUANTIZED] * 2, [LinearAttentionLayer, OscarLayer] * 2),
    ("gemma4", [KEPT, QUANTIZED] * 2 + [SHARED] * 2, [DynamicSlidingWindowLayer, OscarLayer] * 2),
    ("gpt_oss", [KEPT, QUANTIZED] * 2, [DynamicSlidingWindowLayer, OscarLayer] * 2),
    ("llama4", [KEPT] * 3 + [QUANTIZED], [DynamicSlidingWindowLayer] * 3 + [OscarLayer]),
])
def test_the_cache_is_transformers_plan_with_full_attention_kv_replaced(family, kinds, classes):
    model = tiny_model(family)
    shape = attention_shape(model.config)
    assert list(shape.layer_kinds) == kinds[: len(shape.layer_kinds)]  # 5.17 plans no layer for KV readers
    cache = OscarCache(model, method="none", **TIERS)
    dynamic = DynamicCache(config=model.config)
    for i, (ours, theirs) in enumerate(zip(cache.layers, dynamic.layers)):
        if shape.layer_kinds[i] == QUANTIZED:
            assert isinstance(ours, OscarLayer), i
        else:
            assert type(ours) is type(theirs), i  # transformers' own, as DynamicCache builds it
    for i, cls in enumerate(classes):
        assert isinstance(cache.layers[i], cls), (i, type(cache.layers[i]))
    if family == "gemma4":
        assert shape.kv_sources == ((5, 3),) and cache.layers[3].readers == (5,)  # layer 4 reads a window
        # readers hold nothing: stand-ins (>= 5.24's DummyLayer) or no cache layer at all (5.17)
        assert len(cache.layers) == 4 or all(type(layer).__name__ == "DummyLayer" for layer in cache.layers[4:])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "nemotron_h", "gemma4", "gpt_oss", "llama4"])
def test_the_unquantized_cache_generates_as_dynamic_cache_with_a_left_padded_row(family):
    """`method="none"` stores the history unquantized: DynamicCache's tokens and logits, through demotions."""
    model = tiny_model(family)
    ids, mask = _padded_prompt()
    kw = dict(attention_mask=mask, max_new_tokens=STEPS, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)
    want = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = OscarCache(model, method="none", **TIERS)
    got = generate(model, ids, cache, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=2e-5)
    assert all(layer.history_length > 0 for layer in cache.layers if isinstance(layer, OscarLayer))


@pytest.mark.parametrize("family", ["qwen3_next", "gemma4", "gpt_oss"])
def test_the_default_quantizes_and_gives_finite_logits(family):
    """The data-free default: a profile over the layers that store K/V, a 2-bit history, finite logits."""
    model = tiny_model(family)
    ids, mask = _padded_prompt(1)
    cache = OscarCache(model, **TIERS)
    out = generate(model, ids, cache, attention_mask=mask, max_new_tokens=4, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
    assert torch.isfinite(torch.stack(out.logits)).all()
    assert 0 < cache.bits_per_element() < 16
    profiled = cache.rotations
    assert set(profiled.layer_ids) == set(attention_shape(model.config).oscar_layer_ids)


@pytest.mark.quick
def test_a_layer_read_by_another_demotes_once_after_its_last_reader():
    """Gemma 4: layers 4 and 5 attend to layers 2 and 3's tiers. The source demotes once per forward, after the
    reader has attended, so the reader sees the same tokens as the source (otherwise `none` would differ from
    DynamicCache above) and nothing is demoted twice."""
    model = tiny_model("gemma4")
    ids, _ = _padded_prompt()
    cache = OscarCache(model, method="none", **TIERS)
    forward(model, ids, cache)
    source = cache.layers[3]
    assert source.history_length == PROMPT - TIERS["sink_tokens"] - TIERS["recent_tokens"]
    for step in range(TIERS["demote_block"] + 1):
        forward(model, torch.tensor([[5], [6]]), cache)
    assert source.get_seq_length() == PROMPT + TIERS["demote_block"] + 1
    assert int(source.history_length) == PROMPT + TIERS["demote_block"] - TIERS["sink_tokens"] - \
        TIERS["recent_tokens"]


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_next", "gemma4", "gpt_oss"])
@pytest.mark.parametrize("path", ["eager", pytest.param("graph replay", marks=CUDA), "compiled forward",
                                  "generate compile"])
def test_every_path_of_the_unquantized_cache_equals_dynamic_cache(family, path):
    """Eager steps, the same steps on CUDA (where the Triton backend replays each decode call from a CUDA graph,
    `kernels.replay`), a `torch.compile(model.forward)` step, and `generate`'s own compile (where every layer of
    the model's plan allows one: transformers' sliding layers do not, so gpt-oss and Gemma 4 decode eagerly there,
    as they do with DynamicCache): the tokens and logits of DynamicCache."""
    torch._dynamo.reset()
    device = "cuda" if path == "graph replay" else "cpu"
    model = tiny_model(family).to(device)
    model.generation_config.eos_token_id = None  # every step is compared: none may end a row early
    ids, mask = (t.to(device) for t in _padded_prompt(2))
    name = cache_argument_name(model)
    want = generate(model, ids, DynamicCache(config=model.config), attention_mask=mask, max_new_tokens=STEPS,
                    output_logits=True, return_dict_in_generate=True, pad_token_id=0, disable_compile=True)
    cache = OscarCache(model, method="none", compile_decode=path == "generate compile", **TIERS)
    if path == "generate compile":
        got = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, compile_config=compile_config_anywhere(),
                             **{name: cache})
        logits, tokens = torch.stack(got.logits), got.sequences[:, PROMPT:]
    else:
        step = torch.compile(model.forward) if path == "compiled forward" else model.forward
        # positions as generate gives them: counted from each row's first real token
        out = forward(model, ids, cache, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        logits, tokens = [out.logits[:, -1]], []
        full_mask = mask
        for _ in range(STEPS):
            token = logits[-1].argmax(-1, keepdim=True)
            tokens.append(token)
            full_mask = torch.cat([full_mask, torch.ones_like(token)], dim=1)
            logits.append(step(input_ids=token, attention_mask=full_mask, position_ids=full_mask.sum(-1, keepdim=True) - 1,
                               use_cache=True, **{name: cache}).logits[:, -1])
        logits, tokens = torch.stack(logits[:-1]), torch.cat(tokens, dim=1)
    assert torch.equal(tokens, want.sequences[:, PROMPT:])
    want_logits = torch.stack(want.logits)
    # inductor reassociates float32 sums across the whole model: on tiny Gemma 4, DynamicCache's own compiled steps
    # differ from its eager ones by 0.8e-5 of the largest logit
    scale = 3e-5 if "compile" in path else 1e-5 if device == "cpu" else 1e-4  # Triton's float32 dot products
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=scale * want_logits.abs().max().item())
