"""Compact (scale, zero) pairs (`OscarConfig(scale_dtype="compact")`, one byte each) in the Triton kernels: the
demotion kernel against the reference quantizer, the history read against the reference attention, and a whole
generate against the reference backend.

Runs on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there) and on a CUDA device.
Fresh random inputs each run; outputs are poisoned before every launch, and the reference fallbacks of the backend
raise while the kernels are under test, so that a result cannot come from the reference.

Tolerances of the demotion: compact pairs go through `log2` and `exp2`, which round differently in Triton (numpy's
under the interpreter, the GPU's approximations) and in torch (whose float32 `exp2` is not correctly rounded: 16
of the 256 scales differ from the correctly rounded ones by an ulp). A scale code whose `16 log2(scale) - 1e-4`
sits within an ulp of an integer, a zero code at a half, or a code at a near-tie of the stored grid can therefore
come out one apart. Such rows are rare (well under one in a thousand): the tests allow at most a 1e-3 fraction of
differing pair bytes and of differing codes, every difference at most one, and every dequantized value within one
step (the coarser of the two grids) of the reference's. The attention tests use `test_kernels_attention`'s
tolerances; the generate test asks for the reference's greedy tokens.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import QuantizedHistory  # noqa: E402
from oscar_hf.kernels.interface import DecodeCall, HistoryTensors  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.reference.quantize import (  # noqa: E402
    COMPACT,
    compact_scale,
    quantize_pack,
    unpack_codes,
    unpack_dequantize,
)
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402

DEVICE = kernel_device()
ON_GPU = DEVICE.type == "cuda"

from oscar_hf.kernels.triton import backend as triton_backend  # noqa: E402
from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402
from oscar_hf.kernels.triton.demote import demote_rows  # noqa: E402

from conftest import cache_argument_name, extreme_rows, kernel_qwen3, poisoned_output_backend  # noqa: E402

# demotion: rows; attention: (batch, kv heads, history tokens, dense tokens)
BATCH, HEADS, TOKENS = (3, 8, 300) if ON_GPU else (2, 2, 200)
KV_HEADS, HISTORY, DENSE = (8, 6000, 330) if ON_GPU else (2, 150, 40)
SINK = 5
TOLERANCE = {torch.float32: (2e-5, 2e-5), "history": (4e-3, 4e-3), "dense": (1.5e-2, 4e-3)}
REFERENCE_OPS = ("demote", "demote_kv", "dense_attention", "history_attention", "tiered_attention",
                 "decode_attention")


@pytest.fixture
def kernels_only(monkeypatch):
    """Make every reference op the Triton backend could fall back to raise (call it after the reference ran)."""

    def forbid():
        for name in REFERENCE_OPS:
            def refuse(*args, _name=name, **kwargs):
                raise AssertionError(f"the Triton backend handed {_name} to the PyTorch reference")
            monkeypatch.setattr(ReferenceBackend, name, refuse)

    return forbid


# ---------------------------------------------------------------------------------------------------- demotion
def _rows(batch, heads, tokens, dim):
    """Random rows of varied spread, with an all-zero, a constant and a near-constant row with a large offset, as
    a strided bfloat16 view into a larger buffer."""
    spread = torch.rand(batch, heads, 1, 1, device=DEVICE) * 4
    buffer = torch.randn(batch, heads, tokens + 7, dim, device=DEVICE) * spread
    x = buffer[:, :, 3 : 3 + tokens]
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 2.5
    x[-1, -1, 2] = 3000.0 + 1e-3 * torch.randn(dim, device=DEVICE)
    return x.to(torch.bfloat16)


def _poisoned(batch, heads, tokens, dim, bits):
    codes = torch.full((batch, heads, tokens + 5, dim * bits // 8), 0xA5, dtype=torch.uint8, device=DEVICE)
    pairs = torch.full((batch, heads, tokens + 5, 2), 0xA5, dtype=torch.uint8, device=DEVICE)
    return codes[:, :, 2 : 2 + tokens], pairs[:, :, 2 : 2 + tokens]


def _assert_compact_rows_match(codes, pairs, ref_codes, ref_pairs, bits):
    """The tolerance of the module docstring: rare one-apart codes and pair bytes, reads within one step."""
    pair_diff = (pairs.int() - ref_pairs.int()).abs()
    assert (pair_diff != 0).float().mean().item() <= 1e-3, "scale or zero codes differ"
    assert pair_diff.max().item() <= 1
    got, want = unpack_codes(codes, bits), unpack_codes(ref_codes, bits)
    code_diff = (got.int() - want.int()).abs()
    assert (code_diff != 0).float().mean().item() <= 1e-3, "codes differ"
    step = torch.maximum(compact_scale(pairs[..., 0]), compact_scale(ref_pairs[..., 0]))
    read = unpack_dequantize(codes, pairs, bits) - unpack_dequantize(ref_codes, ref_pairs, bits)
    assert (read.abs() <= step[..., None] * (1 + 1e-6)).all()


@pytest.mark.parametrize("encoder", ["minmax", "sigma"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_demote_writes_the_reference_compact_pairs(bits, encoder):
    dim = 64
    x = _rows(BATCH, HEADS, TOKENS, dim)
    for clip in (0.92, None):
        codes, pairs = _poisoned(BATCH, HEADS, TOKENS, dim, bits)
        demote_rows([(x, None, clip, codes, pairs)], bits, encoder=encoder)
        ref_codes, ref_pairs = quantize_pack(x.float(), bits, clip, COMPACT, encoder)
        _assert_compact_rows_match(codes, pairs, ref_codes, ref_pairs, bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_demote_compact_pairs_of_extreme_rows_like_the_reference(bits):
    """Min-max rows at finite extremes (`conftest.extreme_rows`): scales beyond the largest scale code saturate
    at code 255, their zero points at 0 or 255, in the kernel as in the reference."""
    dim = 64
    x = _rows(BATCH, HEADS, TOKENS, dim).float().contiguous()
    patterns = torch.cat([extreme_rows(sign * value, dim) for value in (6.5e4, 1e5, 3e38) for sign in (1.0, -1.0)])
    x[0, 0, : len(patterns)] = patterns.to(DEVICE)
    for clip in (0.92, None):
        codes, pairs = _poisoned(BATCH, HEADS, TOKENS, dim, bits)
        demote_rows([(x, None, clip, codes, pairs)], bits)
        ref_codes, ref_pairs = quantize_pack(x, bits, clip, COMPACT)
        assert (ref_pairs[0, 0, : len(patterns), 0] == 255).any()
        _assert_compact_rows_match(codes, pairs, ref_codes, ref_pairs, bits)


def test_demote_kv_of_compact_pairs_runs_the_kernel(kernels_only):
    """Keys and values through the backend op the cache calls, into a compact history, the reference barred."""
    dim, bits = 64, 2
    cfg = OscarConfig(scale_dtype="compact", encoder="sigma")
    keys = _rows(BATCH, HEADS, TOKENS, dim)
    values = _rows(BATCH, HEADS, TOKENS, dim) * 0.5
    ref = [quantize_pack(t.float(), bits, None, COMPACT, "sigma") for t in (keys, values)]
    kernels_only()
    history = QuantizedHistory(BATCH, HEADS, dim, dim, cfg, DEVICE)
    history._reserve(TOKENS + 3)
    for name in history._names:
        getattr(history, name).fill_(0xA5)
    history.append(keys, values, None, None, TritonBackend())
    for prefix, (ref_codes, ref_pairs) in zip(("key", "value"), ref):
        codes = getattr(history, f"{prefix}_codes")[:, :, :TOKENS]
        pairs = getattr(history, f"{prefix}_scale_zero")[:, :, :TOKENS]
        assert pairs.dtype == COMPACT
        _assert_compact_rows_match(codes, pairs, ref_codes, ref_pairs, bits)


# ---------------------------------------------------------------------------------------------------- attention
def _kernel_backend(launch=None):
    """A Triton backend that cuts these small inputs into several splits, its scratch and output poisoned."""
    backend = poisoned_output_backend(target_programs=256, min_dense_tokens=16, min_history_tokens=32, launch=launch)
    for buffer in backend._workspace(DEVICE, 1 << 22, 1 << 16, 1 << 16):
        buffer.fill_(float("nan"))
    return backend


def _orthogonal(dim):
    q, _ = torch.linalg.qr(torch.randn(dim, dim, dtype=torch.float64))
    return q.float().to(DEVICE)


def _compact_history(dim, bits, rotations, dtype):
    cfg = OscarConfig(bits=bits, scale_dtype="compact", encoder="sigma")
    history = QuantizedHistory(BATCH, KV_HEADS, dim, dim, cfg, DEVICE)
    keys = (torch.randn(BATCH, KV_HEADS, HISTORY, dim, device=DEVICE) * 1.5).to(dtype)
    values = torch.randn(BATCH, KV_HEADS, HISTORY, dim, device=DEVICE).to(dtype)
    history.append(keys, values, rotations[0], rotations[1], ReferenceBackend())
    view = history.kernel_view()
    assert view.key_scale_zero.dtype == COMPACT
    return view


def _case(bits, dtype, groups=2, dim=64):
    rotations = (_orthogonal(dim), _orthogonal(dim))
    history = _compact_history(dim, bits, rotations, dtype)
    query = (torch.randn(BATCH, KV_HEADS * groups, 1, dim, device=DEVICE) * 1.5).to(dtype)
    keys = torch.randn(BATCH, KV_HEADS, DENSE + 1, dim, device=DEVICE).to(dtype)
    values = torch.randn(BATCH, KV_HEADS, DENSE + 1, dim, device=DEVICE).to(dtype)
    return rotations, history, query, keys, values


def _assert_close(out, ref, tolerance, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert err <= tolerance, f"{what}: relative error {err:.2e} > {tolerance:.1e}"


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("bits,dtype", [pytest.param(2, torch.bfloat16, marks=pytest.mark.quick), (4, torch.bfloat16),
                                       (2, torch.float32), (3, torch.bfloat16)])
def test_history_partial_reads_compact_pairs(bits, dtype, token_major, kernels_only):
    """One decode query per row over a compact history with a padding mask, both orientations of the dots."""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    rotations, history, query, _, _ = _case(bits, dtype)
    mask = torch.rand(BATCH, 1, 1, HISTORY, device=DEVICE) > 0.2
    mask[0, ..., : HISTORY // 2] = False
    scaling = query.shape[-1] ** -0.5
    ref, ref_lse = ReferenceBackend().history_attention(query, history, *rotations, mask, scaling)
    kernels_only()
    launch = LaunchConfig(token_major=token_major, block_m=8 if token_major else 16)
    out, lse = _kernel_backend(launch).history_attention(query, history, *rotations, mask, scaling)
    out_tol, lse_tol = TOLERANCE[torch.float32] if dtype == torch.float32 else TOLERANCE["history"]
    _assert_close(out, ref, out_tol, "history partial")
    assert (lse - ref_lse).abs().max().item() <= lse_tol


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tiered_and_counted_decode_read_compact_pairs(bits, kernels_only):
    """A decode step over sink | compact history | recent through `tiered_attention` (with left-padding row
    starts) and through the counted `decode_attention` (lengths on the device)."""
    rotations, history, query, keys, values = _case(bits, torch.bfloat16)
    scaling = query.shape[-1] ** -0.5
    dense_start = torch.tensor([0, SINK - 1] + [2] * (BATCH - 2), dtype=torch.int32, device=DEVICE)
    history_start = torch.tensor([0, 37] + [0] * (BATCH - 2), dtype=torch.int32, device=DEVICE)
    ref = ReferenceBackend().tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling,
                                              dense_start=dense_start, history_start=history_start)
    counted = HistoryTensors(history.keys, history.values, history.key_scale_zero, history.value_scale_zero,
                             history.length, history.bits, torch.tensor([HISTORY], dtype=torch.int32, device=DEVICE))
    dense_length = torch.tensor([keys.shape[2]], dtype=torch.int32, device=DEVICE)
    kernels_only()
    got = _kernel_backend().tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling,
                                             dense_start=dense_start, history_start=history_start)
    _assert_close(got, ref, TOLERANCE["dense"][0], "tiered attention")
    got = _kernel_backend().decode_attention(DecodeCall(query, keys, values, dense_length, counted, *rotations,
                                                        scaling, None, dense_start, history_start))
    _assert_close(got, ref, TOLERANCE["dense"][0], "counted decode step")


# ---------------------------------------------------------------------------------------------------- the cache
def test_generate_with_compact_pairs_gives_the_reference_tokens(monkeypatch):
    """oscar-next's pairs (sigma rows, compact codes; a Hadamard rotation instead of a calibrated file) through a
    whole greedy generate, counted decode steps included: the kernels demote and read the history and give the
    reference backend's tokens."""
    device = DEVICE
    model = kernel_qwen3(device=device)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 256, (2, 37), device=device)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    options = dict(method="hadamard", scale_dtype="compact", encoder="sigma", sink_tokens=4, recent_tokens=8,
                   demote_block=8)
    name = cache_argument_name(model)

    def run(backend):
        cache = OscarCache(model, backend=backend, **options)
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                disable_compile=True, **{name: cache})
        assert cache.layers[0].counted is not None and cache.layers[0].history.key_scale_zero.dtype == COMPACT
        return tokens

    reference = run(ReferenceBackend())
    read, demoted = [], []
    attention_partials, demote = triton_backend.attention_partials, triton_backend.demote_rows

    def spy_attention(query, keys, values, history, *args, **kwargs):
        if history is not None and history.length:
            read.append(history.key_scale_zero.dtype)
        return attention_partials(query, keys, values, history, *args, **kwargs)

    def spy_demote(pairs, *args, **kwargs):
        demoted.append(pairs[0][-1].dtype)
        return demote(pairs, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "attention_partials", spy_attention)
    monkeypatch.setattr(triton_backend, "demote_rows", spy_demote)
    for op in ("demote", "demote_kv"):
        monkeypatch.setattr(ReferenceBackend, op, lambda *args, **kwargs: pytest.fail("reference demotion"))
    kernels = run(TritonBackend(min_dense_tokens=8, min_history_tokens=8, target_programs=16))
    assert read and set(read) == {COMPACT} and demoted and set(demoted) == {COMPACT}
    assert torch.equal(kernels, reference)


@pytest.mark.quick
def test_graph_capture_and_compile_accept_compact_pairs():
    backend = TritonBackend()
    for encoder in ("minmax", "sigma"):
        assert backend.graph_capture_problem(64, 64, encoder, COMPACT) is None
    assert backend.graph_capture_problem(64, 64, "lloyd", torch.float16) is not None
    model = kernel_qwen3()
    assert OscarCache(model, method="hadamard", scale_dtype="compact", encoder="sigma").can_compile
