"""OscarCache end to end with the Triton backend: `generate` gives the reference backend's tokens.

On CPU the kernels run through Triton's interpreter on a tiny random model and a short prompt; on a CUDA device
the same comparison runs at a 32k-token context (against the reference backend on the GPU and on the CPU), and the
decode path is checked to never synchronize the host.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.attention import oscar_attention_forward  # noqa: E402
from oscar_hf.compat import cache_argument_name  # noqa: E402
from oscar_hf.handoff import publish_segment  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402

from conftest import kernel_qwen3  # noqa: E402

DEVICE = kernel_device()
ON_GPU = DEVICE.type == "cuda"

from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402


def _tiny_model(device, seed=0):
    return kernel_qwen3(seed=seed, device=device)


def _generate(model, input_ids, attention_mask, backend, new_tokens, **options):
    """Greedy tokens through an OscarCache whose layers use `backend`, decoded eagerly: a compiled step rounds
    differently (`tests/test_compiled_decode.py` compares compiled with eager decoding)."""
    cache = OscarCache(model, rotations="hadamard", backend=backend, **options)
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, disable_compile=True,
                         **{cache_argument_name(model): cache})
    return out[:, input_ids.shape[1]:], cache


def _left_padded_batch(lengths, vocab, device):
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), device=device)
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
        ids[row, : width - length] = 0
    return ids, mask


@pytest.mark.skipif(ON_GPU, reason="the CPU-sized variant; the GPU runs the 32k-context one")
def test_generate_with_kernels_matches_reference_tokens_cpu():
    model = _tiny_model(DEVICE)
    ids, mask = _left_padded_batch([40, 33], model.config.vocab_size, DEVICE)
    options = dict(sink_tokens=4, recent_tokens=16, demote_block=4)
    got, cache = _generate(model, ids, mask, TritonBackend(), 10, **options)
    ref, _ = _generate(model, ids, mask, ReferenceBackend(), 10, **options)
    assert cache.layers[0].backend.name == "triton"
    assert cache.layers[0].history_length > 0
    assert torch.equal(got, ref)


def test_a_4_bit_layer_beside_a_2_bit_one_generates_the_reference_tokens():
    model = _tiny_model(DEVICE, seed=1)
    ids, mask = _left_padded_batch([44, 37], model.config.vocab_size, DEVICE)
    options = dict(sink_tokens=4, recent_tokens=16, demote_block=4, high_precision_layers=(1,))
    got, cache = _generate(model, ids, mask, TritonBackend(), 10, **options)
    ref, _ = _generate(model, ids, mask, ReferenceBackend(), 10, **options)
    assert [layer.history.config.bits for layer in cache.layers] == [2, 4] and cache.layers[1].history_length > 0
    assert torch.equal(got, ref)


@pytest.mark.parametrize("options,widths", [
    (dict(bits=3), [[(0, 2, 3)], [(0, 2, 3)]]),  # one run of both KV heads: the layer is not split
    (dict(high_precision_bits=3, high_precision_heads=((0, 1), (1, 0)), scale_dtype="compact"),
     [[(0, 1, 2), (1, 2, 3)], [(0, 1, 3), (1, 2, 2)]]),
], ids=["3-bit layers", "3-bit heads beside 2-bit ones"])
def test_a_3_bit_history_generates_the_reference_tokens(options, widths):
    """3-bit codes demoted and read by the kernels, prefill and counted decode: whole layers, and runs of KV heads
    beside 2-bit ones with compact pairs."""
    model = _tiny_model(DEVICE, seed=3)
    ids, mask = _left_padded_batch([44, 37], model.config.vocab_size, DEVICE)
    options = dict(sink_tokens=4, recent_tokens=16, demote_block=4, **options)
    got, cache = _generate(model, ids, mask, TritonBackend(), 10, **options)
    ref, _ = _generate(model, ids, mask, ReferenceBackend(), 10, **options)
    runs = [[(start, stop, part.config.bits) for start, stop, part in layer.history.parts]
            if hasattr(layer.history, "parts") else [(0, 2, layer.history.config.bits)] for layer in cache.layers]
    assert runs == widths and cache.layers[1].history_length > 0
    assert torch.equal(got, ref)


def test_a_layer_split_by_kv_heads_generates_the_reference_tokens():
    """4-bit and 2-bit runs of KV heads in one layer (`high_precision_heads`), compact pairs and the sigma grid on
    the 2-bit run: every run through the kernels, prefill and counted decode."""
    model = _tiny_model(DEVICE, seed=2)
    ids, mask = _left_padded_batch([44, 37], model.config.vocab_size, DEVICE)
    options = dict(sink_tokens=4, recent_tokens=16, demote_block=4, high_precision_heads=((0, 1), (1, 0)),
                   encoder="sigma", scale_dtype="compact", key_clip_ratio=None, value_clip_ratio=None)
    got, cache = _generate(model, ids, mask, TritonBackend(), 10, **options)
    ref, _ = _generate(model, ids, mask, ReferenceBackend(), 10, **options)
    runs = [[(start, stop, part.config.bits) for start, stop, part in layer.history.parts] for layer in cache.layers]
    assert runs == [[(0, 1, 2), (1, 2, 4)], [(0, 1, 4), (1, 2, 2)]] and cache.layers[1].history_length > 0
    assert torch.equal(got, ref)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_generate_32k_context_matches_reference_tokens_gpu():
    """Two left-padded rows at a 32k-token context: the kernels' tokens equal the reference backend's on the GPU."""
    model = _tiny_model(DEVICE)
    ids, mask = _left_padded_batch([32768, 32768 - 1000], model.config.vocab_size, DEVICE)
    got, cache = _generate(model, ids, mask, TritonBackend(), 24)
    assert cache.layers[0].backend.name == "triton"
    assert cache.layers[0].history_length > 30000
    ref, _ = _generate(model, ids, mask, ReferenceBackend(), 24)
    assert torch.equal(got, ref)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_generate_32k_context_matches_cpu_reference_tokens():
    """One 32k-token row: the kernels on the GPU give the tokens of the reference path on the CPU."""
    model = _tiny_model(DEVICE)
    ids, mask = _left_padded_batch([32768], model.config.vocab_size, DEVICE)
    got, _ = _generate(model, ids, None, TritonBackend(), 24)
    ref, _ = _generate(_tiny_model("cpu"), ids.cpu(), None, ReferenceBackend(), 24)
    assert torch.equal(got.cpu(), ref)


def _decode_logits(model, ids, backend, steps, tokens=None):
    """Last-position logits (float32) of the prefill and of `steps` decode steps through an OscarCache on
    `backend`, feeding `tokens` `[B, steps]` (default: greedy from these logits); returns (logits, tokens)."""
    with torch.no_grad():
        cache = OscarCache(model, rotations="hadamard", backend=backend)
        kwargs = {cache_argument_name(model): cache, "use_cache": True}
        logits = [model(ids, **kwargs).logits[:, -1].float()]
        fed = []
        for step in range(steps):
            token = logits[-1].argmax(-1) if tokens is None else tokens[:, step]
            fed.append(token)
            logits.append(model(token[:, None], **kwargs).logits[:, -1].float())
    return torch.stack(logits, 1), torch.stack(fed, 1)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_decode_through_the_cuda_history_kernel_matches_triton_logits(monkeypatch):
    """Two unpadded 16k-token rows in bfloat16 (the CUDA history kernel takes neither masks nor float32): every
    decode step's history goes through the hand-written kernel, and its logits equal the Triton-only path's on the
    same tokens to bfloat16 accuracy: 6.4e-3 relative as measured on an H200, as far as the Triton path is from the reference
    backend's (6.4e-3). (Greedy tokens are not compared: bfloat16 logits tie, and 2% of them flipped.)"""
    from oscar_hf.kernels.cuda import history as cuda_history

    if not cuda_history.available(cuda_history.device_index(DEVICE), cuda_history.CudaHistoryConfig()):
        pytest.skip("the CUDA history kernel is not available here (NVRTC, compute capability)")
    model = _tiny_model(DEVICE).to(torch.bfloat16)
    ids, _ = _left_padded_batch([16384, 16384], model.config.vocab_size, DEVICE)
    calls = []
    original = cuda_history.history_partials
    monkeypatch.setattr(cuda_history, "history_partials", lambda *a, **k: calls.append(1) or original(*a, **k))
    steps = 24
    # launched directly (no eager CUDA graphs), so that every step's call reaches the counter
    cuda = TritonBackend(cuda_history=True, cuda_history_config=cuda_history.CudaHistoryConfig(min_history_bytes=0),
                         eager_graphs=False, compile_threads=0)  # nor a compile-only pass before a call
    got, tokens = _decode_logits(model, ids, cuda, steps)
    layers = model.config.num_hidden_layers
    # every decode step of every layer, and each layer's warm-up step when the prefill's forward closes
    # (`OscarLayer._warm_counted_step`: the kernels compile outside any CUDA-graph recording)
    assert len(calls) == (steps + 1) * layers
    calls.clear()
    ref, _ = _decode_logits(model, ids, TritonBackend(cuda_history=False, eager_graphs=False), steps, tokens)
    assert not calls
    assert torch.equal(got[:, 0], ref[:, 0])  # the prefill attends in BF16 on both paths
    error = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert error < 1.5e-2, f"decode logits differ by {error:.2e} (relative)"


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_decode_path_never_synchronizes_the_host():
    """update + attention + settle (with demotions) for many steps under CUDA's sync debug mode 'error', through
    the attention function transformers calls."""
    model = _tiny_model(DEVICE)
    cache = OscarCache(model, rotations="hadamard", sink_tokens=8, recent_tokens=32, demote_block=8,
                       backend=TritonBackend())
    layer = cache.layers[0]
    batch, heads, dim = 2, 2, 64
    layer.update(torch.randn(batch, heads, 500, dim, device=DEVICE), torch.randn(batch, heads, 500, dim, device=DEVICE))
    layer.settle()  # the first demotion (a sync by design)

    attention = model.model.layers[0].self_attn

    def step():  # what one layer of a decode forward does: update, then the "oscar" attention (which settles)
        keys, values = layer.update(torch.randn(batch, heads, 1, dim, device=DEVICE),
                                    torch.randn(batch, heads, 1, dim, device=DEVICE))
        publish_segment(keys, {}, layer.open_segment())
        query = torch.randn(batch, 4, 1, dim, device=DEVICE)
        oscar_attention_forward(attention, query, keys, values, None, scaling=dim**-0.5)

    step()  # its close starts counted decode: the counts go to the device once (a copy by design)
    assert layer.counted is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert layer.history_length > 450


@pytest.mark.quick
def test_history_grows_by_an_eighth():
    """Spare history capacity stays under 12.5% (amortized growth without wasting half of a long context)."""
    from oscar_hf.config import OscarConfig
    from oscar_hf.history import QuantizedHistory

    history = QuantizedHistory(1, 2, 64, 64, OscarConfig(), torch.device("cpu"))
    keys = torch.randn(1, 2, 1000, 64)
    history.append(keys, keys, None, None, ReferenceBackend())
    assert history.key_codes.shape[2] == 1000
    history.append(keys[:, :, :8], keys[:, :, :8], None, None, ReferenceBackend())
    assert history.key_codes.shape[2] == 1000 + 1000 // 8 + 1  # an eighth more, made even (`history._grown`)
