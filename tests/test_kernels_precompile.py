"""Compiling a call's kernels on threads before it runs (`kernels.triton.precompile`): a compile-only pass
launches nothing, the backend runs one once per kind of call, and the calls give what they give without it.

Runs on CPU through Triton's interpreter (where a pass compiles nothing) and on a CUDA device (where it compiles on
threads).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import QuantizedHistory  # noqa: E402
from oscar_hf.kernels.interface import DecodeCall, DemoteCall, HistoryTensors  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402

DEVICE = kernel_device()

from oscar_hf.kernels.triton.common import compiling_only  # noqa: E402
from oscar_hf.kernels.triton.precompile import ParallelCompile, call_shape, compile_only  # noqa: E402

from conftest import poisoned_output_backend  # noqa: E402

BATCH, KV_HEADS, GROUPS, DIM, HISTORY, DENSE, SINK = 2, 2, 2, 64, 150, 40, 5


def _case(q_len, bits=2):
    torch.manual_seed(q_len)
    rotation, _ = torch.linalg.qr(torch.randn(DIM, DIM, dtype=torch.float64))
    rotation = rotation.float().to(DEVICE)
    history = QuantizedHistory(BATCH, KV_HEADS, DIM, DIM, OscarConfig(bits=bits), DEVICE)
    history.append(torch.randn(BATCH, KV_HEADS, HISTORY, DIM, device=DEVICE),
                   torch.randn(BATCH, KV_HEADS, HISTORY, DIM, device=DEVICE), rotation, rotation, ReferenceBackend())
    query = torch.randn(BATCH, KV_HEADS * GROUPS, q_len, DIM, device=DEVICE)
    keys = torch.randn(BATCH, KV_HEADS, DENSE, DIM, device=DEVICE)
    values = torch.randn(BATCH, KV_HEADS, DENSE, DIM, device=DEVICE)
    return rotation, history.kernel_view(), query, keys, values


def _backend(threads):
    return poisoned_output_backend(target_programs=64, min_dense_tokens=16, min_history_tokens=32,
                                   dequantize_from_rows=GROUPS * 8, compile_threads=threads)


def _calls(backend):
    """The backend's four kinds of call: a decode-sized and a chunk-sized (dequantizing) `tiered_attention`, a
    counted `decode_attention`, and a demotion into poisoned codes; each returns what it wrote."""
    rotation, history, query, keys, values = _case(1)
    _, _, chunk, _, _ = _case(12)
    counted = HistoryTensors(history.keys, history.values, history.key_scale_zero, history.value_scale_zero,
                             history.length, history.bits, torch.tensor([HISTORY], dtype=torch.int32, device=DEVICE))
    dense_length = torch.tensor([DENSE], dtype=torch.int32, device=DEVICE)
    rows = torch.randn(BATCH, KV_HEADS, 24, DIM, device=DEVICE)
    scaling = DIM**-0.5

    def demote():
        codes = torch.full((BATCH, KV_HEADS, 24, DIM // 4), 0xA5, dtype=torch.uint8, device=DEVICE)
        pairs = torch.full((BATCH, KV_HEADS, 24, 2), float("nan"), dtype=torch.float16, device=DEVICE)
        value_codes, value_pairs = codes.clone(), pairs.clone()
        backend.demote_kv(DemoteCall(rows, rows * 0.5, rotation, rotation, 0.95, None, 2, "minmax", codes, pairs,
                                     value_codes, value_pairs))
        return torch.cat([codes.flatten().float(), pairs.flatten().float(), value_codes.flatten().float(),
                          value_pairs.flatten().float()])

    return {
        "decode-sized tiered": lambda: backend.tiered_attention(query, keys, values, None, history, SINK, rotation,
                                                                rotation, scaling),
        "chunk, dequantized": lambda: backend.tiered_attention(chunk, keys, values, None, history, SINK, rotation,
                                                               rotation, scaling),
        "counted decode": lambda: backend.decode_attention(DecodeCall(query, keys, values, dense_length, counted,
                                                                      rotation, rotation, scaling)),
        "demotion": demote,
    }


def test_a_compile_only_pass_launches_nothing_and_the_calls_are_unchanged():
    """Inside `compile_only` every call leaves its (poisoned) output as it was; outside, a backend that runs a pass
    first gives bit for bit what one that does not gives."""
    for name, call in _calls(_backend(threads=0)).items():
        with compile_only(threads=4):
            before = call()
        poisoned = torch.isnan(before).all() if name != "demotion" else _untouched_demotion(before)
        assert poisoned, f"{name}: a compile-only pass wrote its output"
    plain, first = _calls(_backend(threads=0)), _calls(_backend(threads=4))
    for name in plain:
        expected, got = plain[name](), first[name]()
        assert torch.isfinite(expected).all() or name == "demotion"
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected)), name


def _untouched_demotion(written):
    return bool(((written == 0xA5) | torch.isnan(written)).all())


@pytest.mark.quick
def test_the_backend_runs_one_pass_per_kind_of_call():
    """`ParallelCompile.first`: a pass (the call run once with launches compiling only) before the first call of
    each kind on a CUDA device (`rehearse`: the pass alone); none on another device, with fewer than 2 threads, or for a call whose arguments
    differ only where Triton does not tell them apart; a pass that fails leaves the call to run."""
    seen = []

    def call():
        seen.append(compiling_only())
        return len(seen)

    cuda = torch.device("cuda")
    compiles = ParallelCompile(threads=4)
    for rows, passes in ((32, [True, False]), (48, [False]), (33, [True, False]), (35, [False]), (1, [True, False])):
        seen.clear()
        compiles.first("call", (torch.empty(2, rows, DIM), rows), cuda, call)
        assert seen == passes, rows
    seen.clear()
    compiles.first("another call", (torch.empty(2, 32, DIM), 32), cuda, call)
    assert seen == [True, False]
    seen.clear()
    for _ in range(2):  # calls yet to come: a pass once, and nothing run for real
        compiles.rehearse("calls to come", (torch.empty(2, 32, DIM),), cuda, call)
    assert seen == [True]
    for compiles, device in ((ParallelCompile(threads=1), cuda), (ParallelCompile(threads=4), torch.device("cpu"))):
        seen.clear()
        compiles.first("call", (torch.empty(2, 32, DIM),), device, call)
        assert seen == [False]

    def fails_when_compiling():
        if compiling_only():
            raise RuntimeError("no compiler")
        return "ran"

    assert ParallelCompile(threads=4).first("call", (), cuda, fails_when_compiling) == "ran"


@pytest.mark.quick
def test_call_shape_tells_apart_what_triton_specializes_on():
    """Integers: 1, multiples of 16 and the rest; tensors: dtype, device, and those classes of sizes and strides."""
    assert call_shape(1) != call_shape(2) == call_shape(3) != call_shape(32) == call_shape(4096)
    a, b = torch.empty(4, 32), torch.empty(4, 48)
    assert call_shape(a) == call_shape(b) != call_shape(torch.empty(4, 33)) != call_shape(a.half())
    assert call_shape(a) != call_shape(a.t())  # strides (32, 1) against (1, 32)
    assert call_shape((a, None, 0.5, "x")) == call_shape((b, None, 0.25, "x")) != call_shape((b, None, 0.25, "y"))


def _recording_launches(monkeypatch, records: dict, current: list) -> None:
    """Every kernel launch (a compile-only pass's included) appends to `records[current[0]]` what selects its
    variant, and more: the kernel, each tensor argument's dtype, shape, strides and 16-byte alignment, every other
    argument's value but a float's (Triton passes floats as values and specializes on none)."""
    from oscar_hf.kernels.triton import common, demote, dequantize, merge, move_rows, query_rotation, stage1

    def described(value):
        if isinstance(value, torch.Tensor):
            return value.dtype, tuple(value.shape), value.stride(), value.data_ptr() % 16 == 0
        return float if isinstance(value, float) else value

    def launch(kernel, grid, *args, **kwargs):
        records[current[0]].append((getattr(kernel, "__name__", repr(kernel)), tuple(described(a) for a in args),
                                    tuple(sorted((name, described(v)) for name, v in kwargs.items()))))
        common.launch(kernel, grid, *args, **kwargs)

    for module in (demote, dequantize, merge, move_rows, query_rotation, stage1):
        monkeypatch.setattr(module, "launch", launch)


def _state(cache):
    """Every initialized layer's counts and the bytes of every tensor of its tiers (bytes: capacity past the
    stored rows is uninitialized, and may hold NaN, which no NaN equals)."""
    return [(layer.counts(), [t.detach().clone().flatten().view(torch.uint8)
                              for t in layer.tiers.static_tensors() if t is not None])
            for layer in cache.layers if layer.is_initialized]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(counts == other_counts and all(torch.equal(x, y) for x, y in zip(ts, others))
                                    for (counts, ts), (other_counts, others) in zip(a, b))


def test_a_rehearsed_hand_over_asks_for_the_variants_the_close_and_the_first_steps_launch(monkeypatch):
    """When a host-counted forward hands a layer over to counted decode, its close first runs a pass
    (`layer._rehearse_hand_over`, through the backend's `rehearse`; on CUDA, once per shape) that launches the
    kernels of that close and of a demotion block's counted steps (attention, demotion, window shift) with arguments
    Triton tells apart exactly as the real close and the first real steps launch them, runs none of them, and
    leaves the cache as it was. The cache is the default's: the data-free profile splits layer 0 by KV heads (a
    4-bit and a 2-bit run)."""
    from oscar_hf import OscarCache
    from oscar_hf.kernels.triton.backend import TritonBackend

    from conftest import forward, kernel_qwen3

    model = kernel_qwen3(device=DEVICE)
    options = dict(sink_tokens=4, recent_tokens=16, demote_block=2)
    backend = TritonBackend(target_programs=64, min_dense_tokens=16, min_history_tokens=32)
    cache = OscarCache(model, backend=backend, **options)
    records, current, passes = {"pass": [], "real": []}, ["real"], []
    _recording_launches(monkeypatch, records, current)

    def rehearse(name, args, device, calls):  # what a CUDA device's first close of this shape runs
        if compiling_only():  # the copy's own close, inside the pass: `ParallelCompile.rehearse` runs no pass there
            return
        before = _state(cache)
        current[0] = "pass"
        with compile_only(threads=2):
            calls()
        current[0] = "real"
        passes.append(_same(_state(cache), before))

    monkeypatch.setattr(backend, "rehearse", rehearse)
    ids = torch.randint(3, model.config.vocab_size, (2, 45), device=DEVICE)
    with torch.no_grad():
        token = forward(model, ids, cache).logits[:, -1:].argmax(-1)
        for _ in range(2 * options["demote_block"] + 1):  # through two demotions
            token = forward(model, token, cache).logits[:, -1:].argmax(-1)
    assert [type(layer.history).__name__ for layer in cache.layers] == ["HeadSplitHistory", "QuantizedHistory"]
    assert passes == [True, True], "a pass per layer's hand-over, each leaving the cache as it was"
    assert "_demote_kernel" in {name for name, _, _ in records["real"]}  # the window shift is a kernel on CUDA only
    assert set(records["pass"]) == set(records["real"])
