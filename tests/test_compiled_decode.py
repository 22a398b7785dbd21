"""Counted decode and the compiled front door: after a prefill, decode steps keep their counts on the device, so
`torch.compile` (and transformers' own compile in `generate`) traces one graph for every phase of the demotion
cycle and replays it."""

from __future__ import annotations

import copy

import pytest
import torch

from oscar_hf.attention import oscar_attention
from oscar_hf import OscarCache
from oscar_hf.compat import compile_config_anywhere

from conftest import cache_argument_name, forward, kernel_qwen3, tiny_model

OPTIONS = dict(sink_tokens=4, recent_tokens=8, demote_block=8)  # a cycle of 8 steps: 48 steps are 6 cycles
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@torch.no_grad()
def _decode(model, ids, cache, steps, step_forward):
    """Prefill eagerly, then `steps` greedy single-token forwards through `step_forward`; stacked last logits."""
    out = forward(model, ids, cache)
    logits = [out.logits[:, -1].float()]
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = step_forward(token, cache)
        logits.append(out.logits[:, -1].float())
        token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits)


def _eager(model):
    return lambda token, cache: forward(model, token, cache)


@pytest.mark.parametrize("method", ["hadamard", pytest.param("none", marks=pytest.mark.quick)])
def test_counted_steps_equal_host_counted_steps_bit_for_bit(method):
    model = tiny_model("qwen3", seed=3)
    ids = torch.randint(1, 96, (2, 30))
    counted = OscarCache(model, method=method, **OPTIONS)
    reference = OscarCache(model, method=method, **OPTIONS)
    for layer in reference.layers:
        layer.allow_counted_decode = False
    a = _decode(model, ids, counted, 20, _eager(model))
    b = _decode(model, ids, reference, 20, _eager(model))
    assert counted.layers[0].counted is not None and reference.layers[0].counted is None
    assert torch.equal(a, b)
    # the same tiers: 50 tokens = 4 sink + 40 history (demoted in blocks of 8) + 6 recent
    assert int(counted.get_seq_length()) == 50
    assert [repr(x) for x in counted.layers] == [repr(x) for x in reference.layers]
    assert counted.nbytes() == reference.nbytes()


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_forward_matches_eager_over_six_cycles_in_one_graph(device):
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1).to(device)
    ids = torch.randint(1, 96, (2, 40), device=device)
    eager = _decode(model, ids, OscarCache(model, method="hadamard", **OPTIONS), 48, _eager(model))
    compiled_forward = torch.compile(model.forward, fullgraph=True)
    name = cache_argument_name(model)
    cache = OscarCache(model, method="hadamard", **OPTIONS)
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _decode(model, ids, cache, 48,
                       lambda token, c: compiled_forward(input_ids=token, use_cache=True, **{name: c}))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before == 1  # no recompilation
    assert cache.layers[0].history_length == (40 - 4 - 8) + 48  # six demotions of 8 replayed by the graph
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)


def test_a_layer_split_by_kv_heads_compiles_into_one_op_per_layer(monkeypatch):
    """A split layer (a 4-bit KV head beside a 2-bit one) decodes through one custom op per layer and step
    (`oscar_hf::decode_attention` with its history as runs), compiled, with the eager steps' logits."""
    from oscar_hf.kernels.reference.backend import ReferenceBackend

    torch._dynamo.reset()
    model = tiny_model("llama", seed=4)
    ids = torch.randint(1, 96, (2, 40))
    options = dict(OPTIONS, high_precision_heads=((0, 1), (1, 0)))
    eager = _decode(model, ids, OscarCache(model, method="hadamard", **options), 24, _eager(model))
    seen = []
    decode = ReferenceBackend.decode_attention

    def recording(self, call):
        seen.append(type(call.history).__name__)
        return decode(self, call)

    monkeypatch.setattr(ReferenceBackend, "decode_attention", recording)
    compiled_forward = torch.compile(model.forward, fullgraph=True)
    name = cache_argument_name(model)
    cache = OscarCache(model, method="hadamard", **options)
    compiled = _decode(model, ids, cache, 24,
                       lambda token, c: compiled_forward(input_ids=token, use_cache=True, **{name: c}))
    assert [len(layer.history.parts) for layer in cache.layers] == [2, 2]
    split_calls = seen.count("HeadSplitTensors")
    assert split_calls >= 24 * 2 and split_calls * 2 == seen.count("HistoryTensors")  # each then read run by run
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)


def test_eager_steps_between_compiled_ones_read_the_counts_back():
    """Eager steps decide their demotions on the host (`CountedDecode.mirror`); compiled steps drop the mirror,
    and the next eager step reads the counts back. Steps alternating in runs of 5 (so the demotions fall on both
    kinds) give the all-eager logits and tiers."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    ids = torch.randint(1, 96, (2, 40))
    reference = OscarCache(model, method="hadamard", **OPTIONS)
    eager = _decode(model, ids, reference, 40, _eager(model))
    compiled_forward = torch.compile(model.forward, fullgraph=True)
    name = cache_argument_name(model)
    steps = iter(range(40))
    read_back = []

    def alternating(token, cache):
        if next(steps) // 5 % 2:
            return compiled_forward(input_ids=token, use_cache=True, **{name: cache})
        counted = cache.layers[0].counted
        dropped = counted.mirror is None
        out = forward(model, token, cache)
        if dropped:  # the first eager step after compiled ones
            read_back.append(counted.mirror == counted.counts.tolist())
        return out

    cache = OscarCache(model, method="hadamard", **OPTIONS)
    mixed = _decode(model, ids, cache, 40, alternating)
    torch.testing.assert_close(mixed, eager, atol=1e-4, rtol=0)
    assert [repr(x) for x in cache.layers] == [repr(x) for x in reference.layers]
    assert read_back == [True] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_a_fullgraph_compiled_forward_holds_the_prefill_in_generate(device):
    """`model.forward = torch.compile(model.forward, fullgraph=True)` (on CUDA with `mode="reduce-overhead"`), then
    plain `generate` (its own compile off): the prefill is one graph, with each layer's update and attention one
    opaque op, and the decode steps a second graph over six demotion cycles. A second request on a new cache, with
    a prompt of the same length, reuses both graphs (the layer handles are tensors, guarded by shape). Tokens equal
    eager generate's."""
    torch._dynamo.reset()
    # on CUDA a model whose heads the kernels take: a CUDA graph cannot hold the reference's host reads
    model = tiny_model("llama", seed=1) if device == "cpu" else _kernel_qwen3(device)
    ids = torch.randint(1, 96, (2, 40), device=device)
    name = cache_argument_name(model)
    options = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False, disable_compile=True)
    reference = OscarCache(model, method="hadamard", **OPTIONS)
    want = model.generate(ids, **options, **{name: reference})
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead" if device == "cuda" else None)
    try:
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(2):
            cache = OscarCache(model, method="hadamard", **OPTIONS)
            got = model.generate(ids, **options, **{name: cache})
            assert torch.equal(got, want)
            assert cache.layers[0].counted is not None
            assert [repr(x) for x in cache.layers] == [repr(x) for x in reference.layers]  # the same tiers
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
    finally:
        model.forward = eager_forward


def test_a_second_turn_through_a_fullgraph_compiled_forward_continues_the_cache():
    """A chat's second `generate` on the same cache (its new tokens a multi-token forward on a cache that was
    decoding) under `fullgraph=True`: eager generate's tokens, one more graph. `compile_decode=True`: generate
    then builds the mask outside the compiled forward, which needs it (a cache that lets generate compile says so)."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    name = cache_argument_name(model)
    ids, more = torch.randint(1, 96, (1, 40)), torch.randint(1, 96, (1, 10))
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, disable_compile=True)

    def two_turns():
        cache = OscarCache(model, method="hadamard", compile_decode=True, **OPTIONS)
        first = model.generate(ids, **options, **{name: cache})
        return model.generate(torch.cat([first, more], dim=1), **options, **{name: cache})

    want = two_turns()
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, fullgraph=True)
    try:
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert torch.equal(two_turns(), want)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 3  # prefill, decode, 2nd prefill
    finally:
        model.forward = eager_forward


def test_an_opaque_update_finds_its_own_layer_after_a_deepcopy():
    """The handle that names a layer for a compiled prefill is the layer's own: a deep copy gets a new one, so a
    compiled forward over the copy fills the copy and leaves the original alone."""
    from oscar_hf.handoff import layer_of

    model = tiny_model("llama", seed=1)
    cache = OscarCache(model, method="hadamard", **OPTIONS)
    cfg = model.config
    shape = (1, cfg.num_key_value_heads, 20, cfg.hidden_size // cfg.num_attention_heads)
    for i in range(cfg.num_hidden_layers):  # 20 cached tokens, host-counted (no attention started counted decode)
        cache.update(torch.randn(shape), torch.randn(shape), i)
    clone = copy.deepcopy(cache)
    assert layer_of(clone.layers[0].handle) is clone.layers[0]
    assert layer_of(cache.layers[0].handle) is cache.layers[0]
    torch._dynamo.reset()
    compiled_forward = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        compiled_forward(input_ids=torch.randint(1, 96, (1, 12)), use_cache=True,
                         **{cache_argument_name(model): clone})
    assert int(clone.get_seq_length()) == 32 and int(cache.get_seq_length()) == 20


def test_a_compiled_step_reads_seven_tensors_of_each_layer():
    """Every cache tensor a compiled step reads is a graph input whose guards run on every call (and the
    cudagraph replay handles each input): a layer hands the step its two BF16 buffers, its four history buffers
    and one tensor of counts, plus its rotations; window and staging blocks are made inside the graph."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    ids = torch.randint(1, 96, (1, 40))
    cache = OscarCache(model, method="hadamard", **OPTIONS)
    guarded: set[str] = set()

    def record(entries):
        guarded.update(e.name for e in entries if e.guard_type == "TENSOR_MATCH")
        return [True] * len(entries)

    compiled_forward = torch.compile(model.forward, fullgraph=True, options={"guard_filter_fn": record})
    name = cache_argument_name(model)
    _decode(model, ids, cache, 3, lambda token, c: compiled_forward(input_ids=token, use_cache=True, **{name: c}))
    layer = {n.split(".layers[1].", 1)[1] for n in guarded if ".layers[1]." in n}
    assert layer - {"tiers.key_rotation", "tiers.value_rotation"} == {
        "tiers.keys_buffer", "tiers.values_buffer", "mode.counts", "tiers.history.key_codes",
        "tiers.history.key_scale_zero", "tiers.history.value_codes", "tiers.history.value_scale_zero"}


@pytest.mark.parametrize("options", [dict(do_sample=False),
                                     pytest.param(dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9),
                                                  marks=pytest.mark.quick),
                                     dict(do_sample=True, min_p=0.05, repetition_penalty=1.3)])
def test_generate_compiles_the_decode_step_and_gives_the_eager_tokens(options):
    torch._dynamo.reset()
    model = tiny_model("llama", seed=2)
    ids = torch.randint(1, 96, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :25] = 0  # a left-padded row: its sink holds pads until decoding demotes its first real tokens
    name = cache_argument_name(model)

    def run(compile_config):
        torch.manual_seed(0)
        cache = OscarCache(model, method="hadamard", compile_decode=compile_config is not None, **OPTIONS)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24,
                             compile_config=compile_config, **{name: cache}, **options)
        return out, cache

    eager, _ = run(None)
    config = compile_config_anywhere(fullgraph=True)
    compiled, cache = run(config)
    assert cache.layers[0].counted is not None  # decoded device-counted
    assert cache.layers[0].sink_length == 4 and cache.layers[0].row_start.tolist() == [0, 25]
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled, eager)


def _kernel_qwen3(device):
    model = kernel_qwen3(device=device)
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("method", ["hadamard", "none"])
def test_kernels_decode_counted_steps_like_the_reference(method):
    """Triton's interpreter on CPU (a plan cut for the buffers' capacities, many splits), the GPU otherwise: the
    kernels read the BF16 and history counts from the device; a left-padded row."""
    pytest.importorskip("triton")
    from oscar_hf.kernels.reference.backend import ReferenceBackend
    from oscar_hf.kernels.triton.backend import TritonBackend
    from oscar_hf.kernels.triton.interpreter import kernel_device

    device = kernel_device()
    model = _kernel_qwen3(device).float()
    ids = torch.randint(3, 256, (2, 37), device=device)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    name = cache_argument_name(model)
    tokens = {}
    for label, backend in (("kernels", TritonBackend(min_dense_tokens=8, min_history_tokens=8, target_programs=16)),
                           ("reference", ReferenceBackend())):
        cache = OscarCache(model, method=method, backend=backend, **OPTIONS)
        tokens[label] = model.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20,
                                       do_sample=False, disable_compile=True, **{name: cache})
        assert cache.layers[0].counted is not None
    assert torch.equal(tokens["kernels"], tokens["reference"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers compiles generate's step on CUDA")
@pytest.mark.parametrize("context", [4000, 32768])
def test_generate_compiles_on_cuda_by_itself_and_keeps_the_eager_tokens(context):
    """Plain `generate` with an OscarCache compiles the decode step on CUDA (CUDA graphs, `reduce-overhead`).
    float32, so that inductor's fusions of the rest of the model (which round differently in bf16) leave the
    greedy choices alone. Row 1 is left-padded: its pads lead its history, skipped by count in the kernels."""
    torch._dynamo.reset()
    model = _kernel_qwen3("cuda")
    ids = torch.randint(3, 256, (2, context), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :500] = 0
    name = cache_argument_name(model)
    runs = {}
    for label, options in (("eager", dict(disable_compile=True)), ("compiled", {})):
        cache = OscarCache(model, method="hadamard", compile_decode=label == "compiled")
        runs[label] = model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40,
                                     do_sample=False, **options, **{name: cache})
    assert hasattr(model, "_compiled_call")
    assert torch.equal(runs["compiled"], runs["eager"])


def _front_door(model, ids, options, compiled, counted=True, seed=0, **cache_options):
    """`generate` through an OscarCache, eager or compiled by transformers itself (`_compile_all_devices` lets
    it compile on CPU), optionally with counted decode turned off (the host-counted reference)."""
    torch.manual_seed(seed)
    cache = OscarCache(model, method="hadamard", compile_decode=compiled, **(cache_options or OPTIONS))
    for layer in cache.layers:
        layer.allow_counted_decode = counted
    config = None
    if compiled:
        config = compile_config_anywhere()
    out = model.generate(ids, compile_config=config, disable_compile=not compiled, **options,
                         **{cache_argument_name(model): cache})
    return out, cache


@pytest.mark.parametrize("compiled", [False, True])
def test_beam_search_and_several_return_sequences_match_host_counted_decode(compiled):
    torch._dynamo.reset()
    model = tiny_model("llama", seed=4)
    ids = torch.randint(1, 96, (2, 30))
    for options in (dict(num_beams=3, max_new_tokens=20, min_new_tokens=20, do_sample=False),
                    dict(num_return_sequences=3, max_new_tokens=20, min_new_tokens=20, do_sample=True, top_k=10)):
        got, cache = _front_door(model, ids, options, compiled)
        want, _ = _front_door(model, ids, options, False, counted=False)
        assert torch.equal(got, want), options
        assert cache.layers[0].counted is not None


def test_streamers_and_stop_strings_see_the_counted_steps():
    from transformers.generation.streamers import BaseStreamer

    from conftest import char_tokenizer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.chunks.append("end")

    tokenizer = char_tokenizer()
    model = tiny_model("llama", seed=6)
    ids = torch.randint(2, 96, (1, 30))
    options = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    plain, _ = _front_door(model, ids, options, False, counted=False)
    pieces = tokenizer.convert_ids_to_tokens(plain[0].tolist())
    stop = next(p for p in pieces[40:] if p.isalnum())  # a character the greedy continuation produces
    streamer = Collect()
    got, _ = _front_door(model, ids, dict(options, streamer=streamer, stop_strings=stop, tokenizer=tokenizer), False)
    first = next(i for i in range(30, plain.shape[1]) if pieces[i] == stop)
    assert torch.equal(got[0], plain[0, : first + 1])
    assert sum(streamer.chunks[:-1], []) == got[0].tolist() and streamer.chunks[-1] == "end"


def test_a_compiled_step_that_fills_the_history_drops_blocks_and_warns(caplog):
    """Compiled steps cannot grow the history: past `max_cache_len` (plus the slack of two blocks) they drop the
    demoted blocks, never write out of bounds, and the host warns when it next reads the counts."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    ids = torch.randint(1, 96, (1, 40))
    cache = OscarCache(model, method="hadamard", max_cache_len=48, **OPTIONS)
    compiled_forward = torch.compile(model.forward, fullgraph=True)
    name = cache_argument_name(model)
    logits = _decode(model, ids, cache, 48, lambda token, c: compiled_forward(input_ids=token, use_cache=True,
                                                                              **{name: c}))
    layer = cache.layers[0]
    assert torch.isfinite(logits).all()
    with caplog.at_level("WARNING"):
        assert layer.history_length <= layer.history.capacity < 28 + 48
    assert "demoted tokens were dropped" in caplog.text and "max_cache_len" in caplog.text


def test_prompts_of_similar_length_reuse_the_compiled_step():
    """History capacities come in buckets (`history.CAPACITY_BUCKET`): a new prompt length meets the same
    buffer shapes, so the compiled step is replayed, not recompiled."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    compiled_forward = torch.compile(model.forward, fullgraph=True)
    name = cache_argument_name(model)
    step = lambda token, c: compiled_forward(input_ids=token, use_cache=True, **{name: c})  # noqa: E731
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    capacities = set()
    for length in (40, 57, 71):
        cache = OscarCache(model, method="hadamard", **OPTIONS)
        _decode(model, torch.randint(1, 96, (2, length)), cache, 10, step)
        capacities.add(cache.layers[0].history.capacity)
    assert len(capacities) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("operation", ["deepcopy", "crop", "select", "repeat", "reorder"])
def test_cache_operations_between_counted_steps_match_host_counted_decode(operation):
    """A batch operation, a crop or a copy between decode steps leaves counted decode (or, for a reorder, keeps
    it in place) with the same tiers as host-counted decode."""
    import copy

    model = tiny_model("llama", seed=5)
    ids = torch.randint(1, 96, (2, 30))
    apply = {
        "deepcopy": lambda c: copy.deepcopy(c),
        "crop": lambda c: (c.crop(-2), c)[1],
        "select": lambda c: (c.batch_select_indices(torch.tensor([1])), c)[1],
        "repeat": lambda c: (c.batch_repeat_interleave(2), c)[1],
        "reorder": lambda c: (c.reorder_cache(torch.tensor([1, 0])), c)[1],
    }[operation]
    rows = {"select": [1], "repeat": [0, 0, 1, 1], "reorder": [1, 0]}.get(operation, [0, 1])
    logits = []
    for counted in (True, False):
        cache = OscarCache(model, method="hadamard", **OPTIONS)
        for layer in cache.layers:
            layer.allow_counted_decode = counted
        out = _decode(model, ids, cache, 9, _eager(model))
        token = out[-1].argmax(-1, keepdim=True)
        if operation == "crop":
            token = ids[:, -2:-1] * 0 + 5  # a new token after the two removed
        cache = apply(cache)
        token = token[rows]
        steps = []
        with torch.no_grad():
            for _ in range(12):
                step = forward(model, token, cache).logits[:, -1]
                steps.append(step)
                token = step.argmax(-1, keepdim=True)
        logits.append(torch.stack(steps))
        assert int(cache.get_seq_length()) == 30 + 9 + 12 - (2 if operation == "crop" else 0)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_generate_compiles_only_decode_steps_a_cuda_graph_can_hold(monkeypatch):
    """transformers decides before the prefill, and on a GPU replays the compiled step from a CUDA graph: a layer
    whose backend reads counts on the host (the reference, or an encoder the kernels do not take) must say no
    there, and yes on the CPU, where those reads just run inside the compiled step."""
    pytest.importorskip("triton")
    from oscar_hf.kernels.reference.backend import ReferenceBackend
    from oscar_hf.kernels.triton.backend import TritonBackend

    model = kernel_qwen3(device="cpu")
    dim = model.config.head_dim
    reference = OscarCache(model, method="hadamard", backend=ReferenceBackend(), **OPTIONS)
    kernels = OscarCache(model, method="hadamard", backend=TritonBackend(), **OPTIONS)
    lloyd = OscarCache(model, method="hadamard", backend=TritonBackend(), encoder="lloyd", **OPTIONS)
    assert reference.can_compile and kernels.can_compile and lloyd.can_compile  # the model is on the CPU
    forward(model, torch.randint(3, 256, (1, 40)), reference)
    assert reference.can_compile

    cuda = torch.device("cuda")
    assert not reference.layers[0].compileable_on(cuda, dim, dim)
    assert kernels.layers[0].compileable_on(cuda, dim, dim)
    assert not kernels.layers[0].compileable_on(cuda, 48, 48)  # a head size the kernels do not take
    # asked again, as `generate` does every step (the layer keeps its answers), each stands
    assert kernels.layers[0].compileable_on(cuda, dim, dim) and not reference.layers[0].compileable_on(cuda, dim, dim)
    assert not kernels.layers[0].compileable_on(cuda, 48, 48)
    monkeypatch.setattr(type(model), "device", property(lambda self: cuda))  # the model as if on a GPU
    assert reference.can_compile  # filled on the CPU: its layers answer for their own device
    assert not OscarCache(model, method="hadamard", backend=ReferenceBackend(), **OPTIONS).can_compile
    assert not OscarCache(model, method="hadamard", backend=TritonBackend(), encoder="lloyd",
                          **OPTIONS).can_compile
    assert OscarCache(model, method="hadamard", backend=TritonBackend(), **OPTIONS).can_compile


def test_a_model_switched_to_oscar_attention_still_compiles_fullgraph_with_another_cache():
    """An OscarCache switches the model to the "oscar" attention; with a cache of transformers' own afterwards (a
    StaticCache, no segment) that attention is SDPA and traceable: `fullgraph=True` compiles, with eager's logits."""
    from transformers import StaticCache

    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    ids = torch.randint(1, 96, (1, 20))
    forward(model, ids, OscarCache(model, method="hadamard", **OPTIONS))
    assert model.config._attn_implementation == "oscar"
    name = cache_argument_name(model)
    logits = {}
    for label, run in (("eager", model.forward), ("compiled", torch.compile(model.forward, fullgraph=True))):
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{name: cache})
            logits[label] = run(input_ids=ids[:, -1:], use_cache=True, cache_position=torch.tensor([20]),
                                **{name: cache}).logits
    torch.testing.assert_close(logits["compiled"], logits["eager"], atol=1e-4, rtol=0)


def test_an_attention_hook_sees_the_counted_steps_and_can_replace_them():
    """An `oscar_attention(model, hook)` hook on decode steps of a counted cache: a hook that returns None leaves the logits as they are
    (through a demotion) and sees each layer's step with its segment; one that returns a tensor replaces the step's
    attention output."""
    model = tiny_model("llama", seed=1)
    ids = torch.randint(1, 96, (1, 40))
    plain, hooked = (OscarCache(model, method="hadamard", **OPTIONS) for _ in range(2))
    seen = []

    def watch(call):
        seen.append((call.layer_idx, call.segment.counted))

    with torch.no_grad():
        forward(model, ids, plain)
        forward(model, ids, hooked)
        token = torch.tensor([[5]])
        for _ in range(10):
            want = forward(model, token, plain).logits
            with oscar_attention(model, watch):
                got = forward(model, token, hooked).logits
            assert torch.equal(got, want)
        assert seen == [(i, True) for _ in range(10) for i in range(len(model.model.layers))]
        with oscar_attention(model, lambda call: torch.zeros_like(call.query.transpose(1, 2))):
            zeroed = forward(model, token, hooked)
        assert not torch.allclose(zeroed.logits, forward(model, token, plain).logits)


def test_a_compiled_multi_token_forward_after_compiled_steps_says_what_to_do():
    """After compiled decode steps only the device knows the cache's length; a compiled forward of several tokens
    needs it on the host (its mask), so it stops with an error that says so; run eagerly, the same forward works."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    cache = OscarCache(model, method="hadamard", **OPTIONS)
    compiled = torch.compile(model.forward, fullgraph=True)
    name = cache_argument_name(model)
    with torch.no_grad():
        forward(model, torch.randint(1, 96, (1, 40)), cache)
        for _ in range(3):
            compiled(input_ids=torch.tensor([[5]]), use_cache=True, **{name: cache})
        with pytest.raises(Exception, match="needs the cache's length on the host"):
            compiled(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True, **{name: cache})
        forward(model, torch.tensor([[5, 6, 7]]), cache)
    assert int(cache.get_seq_length()) == 40 + 3 + 3


def test_a_compiled_module_decodes_like_the_eager_one_in_one_graph():
    """`torch.compile(model)` (the module, not its forward), called step by step on an OscarCache: 24 decode steps
    (three demotion cycles) in one graph, with eager's logits."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    ids = torch.randint(1, 96, (2, 40))
    eager = _decode(model, ids, OscarCache(model, method="hadamard", **OPTIONS), 24, _eager(model))
    compiled_model = torch.compile(model)
    name = cache_argument_name(model)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _decode(model, ids, OscarCache(model, method="hadamard", **OPTIONS), 24,
                       lambda token, c: compiled_model(input_ids=token, use_cache=True, **{name: c}))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)
