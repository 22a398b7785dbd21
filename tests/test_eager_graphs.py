"""Eager decode steps replay their attention kernels from CUDA graphs (`kernels.replay`): the tensors the attention
reads keep their addresses from step to step, the replayed steps give the direct launches' bits, and one graph per
layer serves every phase of the demotion cycle (a new one only when a buffer moves)."""

from __future__ import annotations

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.demotion import padded_starts
from oscar_hf.kernels.interface import DecodeCall

from conftest import cache_argument_name, kernel_qwen3, tiny_model

OPTIONS = dict(sink_tokens=4, recent_tokens=8, demote_block=8)  # a cycle of 8 steps
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")


def _record_segments(cache):
    """Wrap each layer's `open_segment`: the counted segments' (history count, dense start, history start), the
    count's value and the fresh derivation, per step."""
    seen = []
    for layer in cache.layers:
        opened = layer.open_segment

        def wrapped(layer=layer, opened=opened):
            segment = opened()
            if segment.counted:
                counted = layer.counted
                stored = counted.history_count()
                want = padded_starts(layer.row_start, stored)
                seen.append((layer.layer_idx, segment.history.length_ptr, segment.dense_start, segment.history_start,
                             torch.equal(segment.history.length_ptr, stored),
                             torch.equal(segment.dense_start, want[0]) and torch.equal(segment.history_start, want[1])))
            return segment

        layer.open_segment = wrapped
    return seen


@pytest.mark.quick
def test_an_eager_step_reads_the_same_count_tensors_every_step_and_their_values_follow_the_demotions():
    model = tiny_model("qwen3", seed=3)
    ids = torch.randint(1, 96, (2, 30))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    cache = OscarCache(model, method="hadamard", **OPTIONS)
    seen = _record_segments(cache)
    model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                   disable_compile=True, **{cache_argument_name(model): cache})
    assert cache.layers[0].counted is not None
    for layer_idx in range(len(cache.layers)):
        steps = [s for s in seen if s[0] == layer_idx]
        assert len(steps) >= 38
        for position in (1, 2, 3):  # the same tensor every step (a graph keyed by its address stays valid)
            assert len({s[position].data_ptr() for s in steps}) == 1
        assert all(s[4] and s[5] for s in steps)  # and its value is the count's at that step
    # the count moved with the demotions: 18 after the prefill, then four blocks of 8 in the 39 decode forwards
    assert cache.layers[0].history_length == (30 - 4 - 8) + 32


def _generate(model, ids, mask, cache, **options):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                         disable_compile=True, output_logits=True, return_dict_in_generate=True,
                         **options, **{cache_argument_name(model): cache})
    return out.sequences, torch.stack(out.logits)


@CUDA
@pytest.mark.parametrize("case", ["padded", "long", "beams", "grows"])
def test_replayed_eager_steps_give_the_direct_launches_bits(case):
    """48 eager steps (six demotion cycles) with the attention replayed from graphs, against the same backend
    launching directly: equal logits, and one capture per layer, except where the history grows (new buffers,
    new graphs). `long`: bfloat16 and a history the CUDA history kernel reads (its launch is captured too);
    `beams`: beam search reorders in place."""
    from oscar_hf.kernels.cuda import history as cuda_history
    from oscar_hf.kernels.triton.backend import TritonBackend

    model = kernel_qwen3(device="cuda")
    if case == "long":
        model = model.to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    context = 20000 if case == "long" else 300
    batch = 1 if case == "long" else 2
    ids = torch.randint(3, 256, (batch, context), device="cuda")
    mask = torch.ones_like(ids)
    if case == "padded":
        mask[1, :37] = 0
    options = dict(num_beams=2) if case == "beams" else {}
    cache_options = dict(OPTIONS, max_cache_len=context + 4) if case == "grows" else OPTIONS
    runs = {}
    for graphs in (False, True):
        backend = TritonBackend(eager_graphs=graphs,
                                cuda_history_config=cuda_history.CudaHistoryConfig(min_history_bytes=0))
        cache = OscarCache(model, method="hadamard", backend=backend, **cache_options)
        calls = []
        original = cuda_history.history_partials
        cuda_history.history_partials = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            runs[graphs] = _generate(model, ids, mask, cache, **options)
        finally:
            cuda_history.history_partials = original
        assert cache.layers[0].counted is not None
        assert bool(calls) == (case == "long")  # the CUDA history kernel: bfloat16 and no padding only
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
    layers = len(model.model.layers)
    if case == "grows":
        assert backend.graphs.captures > layers
    else:
        assert backend.graphs.captures == layers


@CUDA
def test_a_replay_launches_the_graph_between_two_copies():
    """An eager counted step's attention, replayed: the query copied in, the graph's kernels, the output copied out;
    the same bits as the direct call. The first call with a layout runs directly, the second captures."""
    from torch.profiler import ProfilerActivity, profile

    from oscar_hf.kernels.triton.backend import TritonBackend

    model = kernel_qwen3(device="cuda")
    ids = torch.randint(3, 256, (1, 300), device="cuda")
    backend = TritonBackend()
    cache = OscarCache(model, method="hadamard", backend=backend, **OPTIONS)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_argument_name(model): cache})
        layer = cache.layers[0]
        history = layer.open_segment().history
        layer.segment_open = False
        query = torch.randn(1, 4, 1, 64, device="cuda")
        call = DecodeCall(query, layer.keys_buffer, layer.values_buffer, layer.counted.rows, history,
                          layer.key_rotation, layer.value_rotation, 0.125)
        direct = backend.decode_attention(call)
        captures = backend.graphs.captures
        calls = [backend.eager_decode_attention(call) for _ in range(2)]
        assert backend.graphs.captures == captures + 1
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replayed = backend.eager_decode_attention(call)
            torch.cuda.synchronize()
    assert backend.graphs.captures == captures + 1
    for out in (*calls, replayed):
        assert torch.equal(out, direct)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    triton = [n for n in names if n.startswith("_")]
    assert len(names) - len(triton) == 2, names  # the two copies
    assert sorted(triton) == ["_attention_partials_kernel", "_merge_kernel", "_rotate_query_kernel"], names


@CUDA
def test_capturing_a_decode_step_the_reference_computes_says_why_it_cannot():
    """Head sizes the kernels do not take decode on the PyTorch reference, which reads the counts on the host: inside
    a CUDA-graph capture (a user's `mode="reduce-overhead"` compile) it raises a clear error before any CUDA call
    fails."""
    from oscar_hf.kernels.interface import HistoryTensors
    from oscar_hf.kernels.reference.backend import ReferenceBackend

    query = torch.randn(1, 4, 1, 48, device="cuda")
    keys = torch.randn(1, 2, 16, 48, device="cuda")
    codes = torch.zeros(1, 2, 16, 12, dtype=torch.uint8, device="cuda")
    pairs = torch.zeros(1, 2, 16, 2, dtype=torch.float16, device="cuda")
    length = torch.tensor([4], dtype=torch.int32, device="cuda")
    history = HistoryTensors(codes, codes, pairs, pairs, 16, 2, length)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="head size 48.*reduce-overhead"):
        with torch.cuda.graph(graph):
            ReferenceBackend().decode_attention(DecodeCall(query, keys, keys, length, history, None, None, 0.1))


@CUDA
def test_graphs_are_captured_again_after_a_clear_and_an_emptied_allocator_cache():
    """The backend clears its graphs when its scratch grows (a bigger batch, a layer with more KV heads); the
    captures that follow, after the allocator released the old graphs' memory, still succeed and replay the call
    (before the fix they failed inside PyTorch's allocator and ran directly from then on)."""
    from oscar_hf.kernels.replay import GraphReplay

    replay = GraphReplay()

    def body(x):  # allocates inside the capture
        return (x * 2).relu() + x.sum()

    for round_, size in enumerate((1 << 12, 1 << 16, 1 << 12, 1 << 18)):
        x = torch.randn(size, device="cuda")
        for _ in range(3):  # direct, captured, replayed
            out = replay(("step", size), x, body)
        torch.testing.assert_close(out, body(x))
        assert replay.captures == round_ + 1 and len(replay) == 1
        replay.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
