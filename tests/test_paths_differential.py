"""Every execution path stores the same cache.

The paths: eager steps; eager steps replayed from CUDA graphs (`kernels.replay`, CUDA only);
`torch.compile(model.forward, fullgraph=True)`; `torch.compile(model)`; `mode="reduce-overhead"`; `generate`'s own
compile; the deprecated `graphed_generate`. Across several demotion cycles:
- `method="none"` stores the tiers and the history unquantized, so on every path the stored rows and the logits
  equal DynamicCache's (float rounding: 1e-5 relative), in every layer, with a left-padded row and with beams;
- every quantized preset, fed identical K/V through `update()` (so that no projection is recompiled and rounds
  differently), stores the same codes and (scale, zero) pairs on every path, bit for bit;
- with the model's own projections, the greedy tokens of a quantized cache equal eager's.

Inductor's CPU kernels split their loops over threads. The fault these tests were written for (the recent window's
shift after a demotion, fused by inductor into one kernel that read rows other threads had already overwritten)
showed with 8 threads and not with 2, so the compiled paths here run with 8.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, graphed_generate
from oscar_hf.attention import oscar_attention_forward
from oscar_hf.compat import compile_config_anywhere
from oscar_hf.config import PRESETS
from oscar_hf.rotations import Rotations
from oscar_hf.rotations.rotations import RETRIEVAL_HEADS_KEY, RETRIEVAL_LAYERS_KEY

from conftest import cache_argument_name, forward, kernel_qwen3, tiny_llama

PROMPT, STEPS = 400, 24  # the default tiers (64 | history | 256, blocks of 8): 80 history tokens, 3 demotions
THREADS = 8


@contextlib.contextmanager
def threads(n: int = THREADS):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _generate_config():
    return compile_config_anywhere(fullgraph=True)


def _step_paths(model):
    """Single-token forwards of each step path: name -> callable(token, cache)."""
    name = cache_argument_name(model)
    compiled_forward = torch.compile(model.forward, fullgraph=True)
    compiled_module = torch.compile(model)
    reduce_overhead = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
    return {
        "eager": lambda token, cache: forward(model, token, cache),
        "compiled forward": lambda token, cache: compiled_forward(input_ids=token, use_cache=True, **{name: cache}),
        "compiled module": lambda token, cache: compiled_module(input_ids=token, use_cache=True, **{name: cache}),
        "reduce-overhead": lambda token, cache: reduce_overhead(input_ids=token, use_cache=True, **{name: cache}),
    }


def _assert_rows_equal(oscar, dynamic, what: str):
    """Every layer's stored K/V (history dequantized, time order) equals DynamicCache's, within 1e-5 relative."""
    for i, layer in enumerate(oscar.layers):
        keys, values = layer.dense_kv()
        for got, want, kind in ((keys, dynamic.layers[i].keys, "keys"), (values, dynamic.layers[i].values, "values")):
            assert got.shape == want.shape, (what, i, kind)
            bad = ((got - want).abs() > 1e-5 * want.abs().amax()).any(dim=(0, 1, 3)).nonzero().flatten().tolist()
            assert not bad, f"{what}: layer {i} {kind} differ from DynamicCache's in rows {bad}"


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0, layers=4)


@torch.no_grad()
def test_every_step_path_of_the_unquantized_cache_stores_and_scores_like_dynamic_cache(llama):
    torch._dynamo.reset()
    ids = torch.randint(1, 96, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    with threads():
        for path, step in _step_paths(llama).items():
            dynamic, oscar = DynamicCache(config=llama.config), OscarCache(llama, method="none")
            want = forward(llama, ids, dynamic).logits[:, -1:]
            forward(llama, ids, oscar)
            for i in range(STEPS):
                token = want.argmax(-1)
                want = forward(llama, token, dynamic).logits
                got = step(token, oscar).logits
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item(),
                                           msg=lambda m: f"{path}, step {i}: {m}")
            assert oscar.layers[0].history_length == PROMPT - 64 - 256 + STEPS  # three demotions
            _assert_rows_equal(oscar, dynamic, path)


@torch.no_grad()
@pytest.mark.parametrize("path", ["generate compile", "compiled forward, beams", "graphed_generate"])
def test_generate_paths_of_the_unquantized_cache_equal_dynamic_cache_with_padding(llama, path):
    """A left-padded row (its pads lead the history): DynamicCache's tokens, scores and stored rows. transformers
    compiles greedy and sampling steps itself, not beam search's, so beams run through a compiled forward."""
    torch._dynamo.reset()
    ids = torch.randint(1, 96, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    beams = 2 if "beams" in path else 1
    options = dict(attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                   num_beams=beams, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    name = cache_argument_name(llama)
    dynamic = DynamicCache(config=llama.config)
    want = llama.generate(ids, **options, disable_compile=True, **{name: dynamic})
    oscar = OscarCache(llama, method="none", compile_decode=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with threads():
        if path == "graphed_generate":  # deprecated: generate, which compiles on CUDA only
            with pytest.warns(FutureWarning):
                got_ids = graphed_generate(llama, ids, oscar, max_new_tokens=STEPS, attention_mask=mask,
                                           pad_token_id=0)
            assert torch.equal(got_ids, want.sequences)
        else:
            eager_forward = llama.forward
            if path == "compiled forward, beams":
                llama.forward = torch.compile(llama.forward, fullgraph=True)
            try:
                got = llama.generate(ids, **options, compile_config=_generate_config(), **{name: oscar})
            finally:
                llama.forward = eager_forward
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the step did compile
            assert oscar.layers[0].counted is not None
            assert torch.equal(got.sequences, want.sequences)
            for i, (a, b) in enumerate(zip(got.logits, want.logits)):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item(),
                                           msg=lambda m: f"{path}, step {i}: {m}")
    _assert_rows_equal(oscar, dynamic, path)


# ----------------------------------------------------------------------------------- quantized: identical K/V
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64  # a head size the GPU kernels take
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _AttentionModule(torch.nn.Module):
    """What the attention function reads of a model's attention module."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx, self.is_causal, self.num_key_value_groups = layer_idx, True, 2
        self.scaling = HEAD_DIM**-0.5


MODULES = [_AttentionModule(i) for i in range(LAYERS)]


def _kv_step(cache, queries, keys, values):
    """One forward's update and attention in every layer, as a model's attention layers run them."""
    outs = []
    for i, module in enumerate(MODULES):
        k, v = cache.update(keys[i], values[i], i)
        out, _ = oscar_attention_forward(module, queries[i], k, v, None)
        outs.append(out)
    return torch.stack(outs)


def _ranked_rotations() -> Rotations:
    """Hadamard rotations that record layer and head rankings, as `oscar-calibrate` writes them."""
    rotations = Rotations.hadamard(list(range(LAYERS)), HEAD_DIM)
    rotations.metadata[RETRIEVAL_LAYERS_KEY] = json.dumps([1, 0])
    rotations.metadata[RETRIEVAL_HEADS_KEY] = json.dumps([[1, 1], [0, 0], [0, 1], [1, 0]])
    return rotations


def _states(generator, tokens: int, device: str):
    """(queries, keys, values) of `tokens` tokens for every layer; keys with a few large channels, as RoPE'd keys
    have, so that clipping and the code grid matter."""
    shape = (LAYERS, 2, KV_HEADS, tokens, HEAD_DIM)
    keys = torch.randn(shape, generator=generator) * (1 + 4 * (torch.arange(HEAD_DIM) % 7 == 0))
    states = (torch.randn((LAYERS, 2, 2 * KV_HEADS, tokens, HEAD_DIM), generator=generator), keys,
              torch.randn(shape, generator=generator))
    return tuple(t.to(device) for t in states)


def _stored(cache) -> dict[str, torch.Tensor]:
    """What each layer stores: its BF16 buffers, its counts, and each history buffer's stored rows."""
    out = {}
    for i, layer in enumerate(cache.layers):
        out[f"layer {i} BF16 keys"] = layer.keys_buffer.clone()
        out[f"layer {i} BF16 values"] = layer.values_buffer.clone()
        out[f"layer {i} counts"] = layer.counted.counts.clone()
        for j, buffer in enumerate(layer.history.buffers()):
            out[f"layer {i} history buffer {j}"] = buffer[:, :, : layer.history_length].clone()
    return out


@torch.no_grad()
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.quick) if m == "oscar" else m
                                    for m in sorted(PRESETS)])
def test_every_path_stores_the_same_codes_and_pairs_from_the_same_states(method, device):
    """On CUDA the eager steps replay from CUDA graphs and the compiled ones run `reduce-overhead`."""
    torch._dynamo.reset()
    steps = 20
    generator = torch.Generator().manual_seed(2)
    prompt = _states(generator, PROMPT, device)
    decode = [_states(generator, 1, device) for _ in range(steps)]
    options = dict(rotations=_ranked_rotations()) if PRESETS[method].rotation == "file" else {}
    compiled_step = torch.compile(_kv_step, fullgraph=True, mode="reduce-overhead" if device == "cuda" else None)
    stored, outputs = {}, {}
    with threads():
        for path, step in (("eager", _kv_step), ("compiled", compiled_step)):
            cache = OscarCache(_tiny_config(), method=method, **options)
            _kv_step(cache, *prompt)
            outputs[path] = torch.stack([step(cache, *states).clone() for states in decode])  # graphs reuse outputs
            stored[path] = _stored(cache)
    assert cache.layers[0].history_length == PROMPT - 64 - 256 + 16  # two demotions
    assert stored["compiled"].keys() == stored["eager"].keys()
    for name, want in stored["eager"].items():
        differs = stored["compiled"][name] != want  # bit for bit (the float buffers hold no NaN)
        assert not differs.any(), f"{method}: {name} differ at {differs.nonzero()[:4].tolist()}"
    torch.testing.assert_close(outputs["compiled"], outputs["eager"], rtol=0, atol=1e-5)


def _tiny_config():
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=2 * KV_HEADS * HEAD_DIM, num_hidden_layers=LAYERS,
                                      num_attention_heads=2 * KV_HEADS, num_key_value_heads=KV_HEADS,
                                      head_dim=HEAD_DIM, max_position_embeddings=4096)
    config._attn_implementation = "oscar"  # what a model switched to the cache's attention says
    return config


# ----------------------------------------------------------------------------------- quantized: the model's own
@torch.no_grad()
@pytest.mark.parametrize("method", ["hadamard", "oscar-mixed"])
def test_greedy_tokens_of_a_quantized_cache_are_eager_ones_on_every_compiled_path(method):
    """64 greedy steps (eight demotions) with the model's own projections. The output head is scaled (so greedy
    choices are decisive, `kernel_qwen3`); a code that a compiled projection's rounding flipped would still change
    no token here unless it moved the logits by more than those margins."""
    torch._dynamo.reset()
    model = kernel_qwen3(head_dim=HEAD_DIM, layers=LAYERS, seed=3)
    model.generation_config.pad_token_id = 0
    options = dict(rotations=_ranked_rotations()) if PRESETS[method].rotation == "file" else {}
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    name = cache_argument_name(model)
    run = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
    want = model.generate(ids, disable_compile=True, **run, **{name: OscarCache(model, method=method, **options)})
    with threads():
        got = model.generate(ids, compile_config=_generate_config(), **run,
                             **{name: OscarCache(model, method=method, compile_decode=True, **options)})
        assert torch.equal(got, want), "generate's compile"
        compiled = torch.compile(model.forward, fullgraph=True)
        cache = OscarCache(model, method=method, **options)
        tokens = [forward(model, ids, cache).logits[:, -1:].argmax(-1)]
        for _ in range(63):
            tokens.append(compiled(input_ids=tokens[-1], use_cache=True, **{name: cache}).logits.argmax(-1))
        assert torch.equal(torch.cat(tokens, dim=1), want[:, PROMPT:]), "compiled forward"
