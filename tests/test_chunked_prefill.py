"""`generate(..., prefill_chunk_size=N)` with an OscarCache: the prompt goes in N tokens at a time and demotion
runs between chunks, so the cache, not the prompt, bounds what a long prefill holds.

- Unquantized (`method="none"`), chunked prefill equals DynamicCache's chunked prefill: tokens and stored rows.
- The first layer sees the same K/V chunked or not, so it stores the same codes either way: demoting between
  chunks stores what one prefill stores.
- Chunk after chunk, the cache holds sink + history + at most recent + chunk - 1 BF16 tokens.
- Eager and `generate`'s compile (which compiles the chunks too) store the same cache and pick the same tokens.
- An unpadded chunk gets no mask tensor (`attention.oscar_mask`), and stores what the materialized mask stores.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AttentionMaskInterface, DynamicCache
from transformers.masking_utils import causal_mask_function, sdpa_mask

from oscar_hf import OscarCache
from oscar_hf.compat import compile_config_anywhere

from conftest import cache_argument_name, forward, tiny_llama

PROMPT, CHUNK, NEW = 700, 128, 8


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0, layers=3)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 96, (2, PROMPT), generator=torch.Generator().manual_seed(seed))


def _generate(model, cache, chunk: int | None, compiled: bool = False) -> torch.Tensor:
    options = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   attention_mask=torch.ones(2, PROMPT, dtype=torch.long), prefill_chunk_size=chunk)
    if compiled:
        options["compile_config"] = compile_config_anywhere(fullgraph=True)
    else:
        options["disable_compile"] = True
    return model.generate(_ids(), **options, **{cache_argument_name(model): cache})


def _stored_codes(layer) -> list[torch.Tensor]:
    return [buffer[:, :, : layer.history_length].clone() for buffer in layer.history.buffers()]


@torch.no_grad()
@pytest.mark.quick
def test_unquantized_chunked_prefill_equals_dynamic_cache(llama):
    dynamic, oscar = DynamicCache(config=llama.config), OscarCache(llama, method="none")
    want = _generate(llama, dynamic, CHUNK)
    got = _generate(llama, oscar, CHUNK)
    assert torch.equal(got, want)
    for i, layer in enumerate(oscar.layers):
        keys, values = layer.dense_kv()
        torch.testing.assert_close(keys, dynamic.layers[i].keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(values, dynamic.layers[i].values, rtol=0, atol=1e-5)


@torch.no_grad()
@pytest.mark.quick
def test_demoting_between_chunks_stores_what_one_prefill_stores(llama):
    """Layer 0's K/V do not depend on attention, so its history must be the same codes chunked or not; later layers
    attend to the quantized history of earlier chunks and may differ, as decoding does."""
    ids = _ids()
    whole, chunked = OscarCache(llama, method="hadamard"), OscarCache(llama, method="hadamard")
    forward(llama, ids, whole)
    for start in range(0, PROMPT, CHUNK):
        forward(llama, ids[:, start:start + CHUNK], chunked)
    a, b = whole.layers[0], chunked.layers[0]
    assert a.history_length > 0
    # a one-shot prefill keeps up to recent + one demotion block in BF16, a chunked one up to recent + chunk - 1:
    # compare the history both hold
    shared = min(a.history_length, b.history_length)
    for x, y in zip(_stored_codes(a), _stored_codes(b)):
        assert torch.equal(x[:, :, :shared], y[:, :, :shared])


@torch.no_grad()
def test_chunked_prefill_holds_at_most_recent_plus_a_chunk_in_bf16(llama):
    cache = OscarCache(llama, method="hadamard")
    config = cache.oscar_config
    ids = _ids()
    for start in range(0, PROMPT, CHUNK):
        forward(llama, ids[:, start:start + CHUNK], cache)
        layer = cache.layers[0]
        seen = min(PROMPT, start + CHUNK)
        bf16 = seen - layer.history_length
        assert bf16 <= config.sink_tokens + config.recent_tokens + CHUNK - 1, (start, bf16)
    assert cache.layers[0].history_length >= PROMPT - config.sink_tokens - config.recent_tokens - CHUNK


@torch.no_grad()
def test_compiled_chunked_prefill_stores_what_eager_stores(llama):
    """The first layer's K/V are the same on both paths, so its codes must be bit for bit the same. Later layers'
    K/V come from projections inductor compiles, which round differently from eager (~1e-7 here; the fed-K/V tests
    of `test_paths_differential` show that the demotion itself is exact), so there a (scale, zero) pair may move by
    one float16 step: their rows agree within that."""
    torch._dynamo.reset()
    eager, compiled = OscarCache(llama, method="hadamard"), OscarCache(llama, method="hadamard", compile_decode=True)
    want = _generate(llama, eager, CHUNK)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = _generate(llama, compiled, CHUNK, compiled=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the decode step did compile
    assert torch.equal(got, want)
    for x, y in zip(_stored_codes(eager.layers[0]), _stored_codes(compiled.layers[0])):
        assert torch.equal(x, y), "layer 0: compiled chunked prefill stored other codes"
    for i, (a, b) in enumerate(zip(eager.layers, compiled.layers)):
        assert a.history_length == b.history_length, i
        for x, y in zip(a.dense_kv(), b.dense_kv()):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-3 * x.abs().max().item(), msg=f"layer {i}: compiled and eager rows differ")


@contextlib.contextmanager
def _mask_function(function):
    """The "oscar" attention's mask function replaced by `function` within the block."""
    from oscar_hf.attention import OSCAR_ATTENTION, register

    AttentionMaskInterface.register(OSCAR_ATTENTION, function)
    try:
        yield
    finally:
        register()


@torch.no_grad()
def test_unpadded_chunks_get_no_mask_tensor_and_store_what_the_mask_stores(llama):
    """`oscar_mask` gives a chunk of an unpadded prompt None (bottom-right causal) instead of a `[B, 1, q, kv]`
    tensor; the tokens and every stored row must be what transformers' materialized mask gives."""
    from oscar_hf.attention import oscar_mask

    given = []

    def recording(**kwargs):
        mask = oscar_mask(**kwargs)
        given.append((kwargs["q_length"], kwargs["kv_length"], mask))
        return mask

    masked, unmasked = OscarCache(llama, method="hadamard"), OscarCache(llama, method="hadamard")  # (registers)
    with _mask_function(sdpa_mask):
        want = _generate(llama, masked, CHUNK)
    with _mask_function(recording):
        got = _generate(llama, unmasked, CHUNK)
    chunks = [(q, kv, m) for q, kv, m in given if 1 < q < kv]
    assert len(chunks) == -(-PROMPT // CHUNK) - 1 and all(m is None for _, _, m in chunks)
    assert torch.equal(got, want)
    for i, (a, b) in enumerate(zip(masked.layers, unmasked.layers)):
        assert a.history_length == b.history_length > 0, i
        for x, y in zip(_stored_codes(a), _stored_codes(b)):
            assert torch.equal(x, y), f"layer {i}: other codes without the mask tensor"
        for x, y in zip(a.dense_kv(), b.dense_kv()):
            assert torch.equal(x, y), f"layer {i}"


@torch.no_grad()
def test_dynamic_cache_chunks_under_oscar_attention_equal_sdpa(llama):
    """Without an OscarCache (and so without a history), the "oscar" attention reads a chunk's None mask as
    bottom-right causal, not as SDPA's top-left `is_causal`."""
    from oscar_hf import use_oscar_attention

    outputs, caches = [], []
    for implementation in ("sdpa", "oscar"):
        if implementation == "oscar":
            use_oscar_attention(llama)
        else:
            llama.set_attn_implementation("sdpa")
        caches.append(DynamicCache(config=llama.config))
        outputs.append(_generate(llama, caches[-1], CHUNK))
    assert torch.equal(outputs[0], outputs[1])
    for a, b in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=1e-6)


@pytest.mark.quick
def test_oscar_mask_is_none_only_for_unpadded_causal_chunks():
    from transformers.masking_utils import sliding_window_causal_mask_function

    from oscar_hf.attention import oscar_mask

    def mask(q=4, kv=12, attention_mask=None, **kw):
        options = dict(batch_size=2, q_length=q, kv_length=kv, q_offset=kv - q, kv_offset=0,
                       mask_function=causal_mask_function, attention_mask=attention_mask, device="cpu")
        options.update(kw)
        return oscar_mask(**options)

    assert mask() is None
    assert mask(attention_mask=torch.ones(2, 12, dtype=torch.bool)) is None
    padded = torch.ones(2, 12, dtype=torch.bool)
    padded[1, :3] = False
    want = sdpa_mask(batch_size=2, q_length=4, kv_length=12, q_offset=8, kv_offset=0,
                     mask_function=causal_mask_function, attention_mask=padded, device="cpu")
    assert torch.equal(mask(attention_mask=padded), want)
    assert mask(q_offset=5) is not None  # queries that are not the last positions: not bottom-right
    assert mask(allow_is_causal_skip=False) is not None
    assert mask(mask_function=sliding_window_causal_mask_function(4), local_size=4) is not None
    causal = mask(q=12, kv=12)  # sdpa_mask's own skip (is_causal) stays
    assert causal is None
