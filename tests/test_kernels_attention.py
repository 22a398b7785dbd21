"""Stage 1 + stage 2 attention kernels against the reference partials (`oscar_hf.partials`).

Runs on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there) and on a CUDA device at
real shapes. Fresh random inputs each run; the split scratch and the outputs are poisoned (NaN) before launch.

Tolerances (norm-wise relative error of the output, absolute error of the log-sum-exp), against the float32
reference on the same inputs:
- float32 queries: 2e-5 / 2e-5 (the kernels compute in float32 throughout);
- bfloat16, quantized history partial: 4e-3 / 4e-3 (float16 copies of the rotated query and of p*scale);
- bfloat16, dense tier and whole layer: 1.5e-2 / 4e-3 (bf16 P·V as in flash-attention, bf16 output).
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import FullPrecisionHistory, QuantizedHistory  # noqa: E402
from oscar_hf.kernels.interface import DecodeCall, HistoryTensors  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402

DEVICE = kernel_device()
ON_GPU = DEVICE.type == "cuda"

from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402

from conftest import poisoned_output_backend  # noqa: E402

# (batch, kv heads, history tokens, dense tokens): small under the interpreter, decode-sized on the GPU
BATCH, KV_HEADS, HISTORY, DENSE = (4, 8, 6000, 330) if ON_GPU else (2, 2, 150, 40)
SINK = 5
PREFILL = 200 if ON_GPU else 12

TOLERANCE = {torch.float32: (2e-5, 2e-5), "history": (4e-3, 4e-3), "dense": (1.5e-2, 4e-3)}


def _kernel_backend(launch=None):
    """A Triton backend that cuts even these small inputs into several splits, its scratch and output poisoned."""
    backend = poisoned_output_backend(target_programs=256, min_dense_tokens=16, min_history_tokens=32, launch=launch)
    for buffer in backend._workspace(DEVICE, 1 << 22, 1 << 16, 1 << 16):
        buffer.fill_(float("nan"))
    return backend


def _orthogonal(dim, heads=None):
    shape = (heads, dim, dim) if heads else (dim, dim)
    q, _ = torch.linalg.qr(torch.randn(shape, dtype=torch.float64))
    return q.float().to(DEVICE)


def _rotations(kind, dim):
    if kind is None:
        return None, None
    heads = KV_HEADS if kind == "per_head" else None
    return _orthogonal(dim, heads), _orthogonal(dim, heads)


def _history(dim, bits, scale_dtype, rotations, dtype, tokens=HISTORY, quantize=True):
    cfg = OscarConfig(bits=bits, scale_dtype=scale_dtype)
    if quantize:
        history = QuantizedHistory(BATCH, KV_HEADS, dim, dim, cfg, DEVICE)
    else:
        history = FullPrecisionHistory(BATCH, KV_HEADS, dim, dim, dtype, DEVICE)
    keys = (torch.randn(BATCH, KV_HEADS, tokens, dim, device=DEVICE) * 1.5).to(dtype)
    values = torch.randn(BATCH, KV_HEADS, tokens, dim, device=DEVICE).to(dtype)
    history.append(keys, values, rotations[0], rotations[1], ReferenceBackend())
    return history.kernel_view()


def _query(groups, q_len, dim, dtype):
    return (torch.randn(BATCH, KV_HEADS * groups, q_len, dim, device=DEVICE) * 1.5).to(dtype)


def _assert_close(out, ref, tolerance, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert err <= tolerance, f"{what}: relative error {err:.2e} > {tolerance:.1e}"


def _assert_lse(lse, ref, tolerance):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "fully masked rows differ"
    finite = torch.isfinite(ref)
    assert (lse[finite] - ref[finite]).abs().max().item() <= tolerance


@pytest.mark.parametrize(
    "dim,bits,scale_dtype,groups,rotation,dtype",
    [
        (128, 2, torch.float16, 4, "shared", torch.bfloat16),
        pytest.param(64, 2, torch.float16, 2, "per_head", torch.bfloat16, marks=pytest.mark.quick),
        (256, 2, torch.float32, 1, "shared", torch.bfloat16),
        (128, 4, torch.float16, 4, None, torch.bfloat16),
        (128, 2, torch.bfloat16, 2, "per_head", torch.float32),
        (64, 4, torch.float32, 4, "shared", torch.float32),
        (128, 3, torch.float16, 4, "shared", torch.bfloat16),
        (64, 3, torch.uint8, 2, None, torch.bfloat16),
        (64, 3, torch.float32, 2, "per_head", torch.float32),
    ],
)
def test_history_partial_matches_reference(dim, bits, scale_dtype, groups, rotation, dtype):
    _check_history_partial(dim, bits, scale_dtype, groups, rotation, dtype, None, "history partial")


def _check_history_partial(dim, bits, scale_dtype, groups, rotation, dtype, launch, what, masked=True):
    """One decode query per row over a quantized history, kernels vs reference; with `masked`, random padding
    and a row whose first half is padding."""
    rotations = _rotations(rotation, dim)
    history = _history(dim, bits, scale_dtype, rotations, dtype)
    query = _query(groups, 1, dim, dtype)
    mask = None
    if masked:
        mask = torch.rand(BATCH, 1, 1, HISTORY, device=DEVICE) > 0.2
        mask[0, ..., : HISTORY // 2] = False
    out, lse = _kernel_backend(launch).history_attention(query, history, *rotations, mask, dim**-0.5)
    ref, ref_lse = ReferenceBackend().history_attention(query, history, *rotations, mask, dim**-0.5)
    out_tol, lse_tol = TOLERANCE[torch.float32] if dtype == torch.float32 else TOLERANCE["history"]
    _assert_close(out, ref, out_tol, what)
    _assert_lse(lse, ref_lse, lse_tol)


@pytest.mark.parametrize("block_n,asm_unpack", [(64, False), (128, True)])
def test_history_partial_other_launch_configs(block_n, asm_unpack):
    """The unpacking without inline PTX (the GPU default uses it for 2-bit codes) and longer tiles."""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    launch = LaunchConfig(block_n_history=block_n, asm_unpack=asm_unpack)
    _check_history_partial(128, 2, torch.float16, 4, "shared", torch.bfloat16, launch, "history partial", False)


@pytest.mark.parametrize(
    "dim,bits,scale_dtype,groups,rotation,dtype,block_m,warps",
    [
        (128, 2, torch.float16, 4, "shared", torch.bfloat16, 8, 2),
        (128, 2, torch.float16, 4, "shared", torch.bfloat16, 8, 4),
        (64, 4, torch.float32, 4, "shared", torch.float32, 8, 2),
        (128, 2, torch.bfloat16, 2, "per_head", torch.float32, 16, 4),
        (256, 2, torch.float32, 1, None, torch.bfloat16, 8, 2),
        (64, 2, torch.float16, 4, "per_head", torch.bfloat16, 8, 1),
        (64, 2, torch.float16, 3, "per_head", torch.bfloat16, 8, 1),  # SmolLM2's GQA group of 3
        (128, 3, torch.float16, 4, "shared", torch.bfloat16, 8, 2),
        (64, 3, torch.bfloat16, 2, "per_head", torch.float32, 16, 4),
    ],
)
def test_token_major_history_partial_matches_reference(dim, bits, scale_dtype, groups, rotation, dtype, block_m,
                                                       warps):
    """The history path with the tokens as the dots' M dimension (`LaunchConfig.token_major`), 8- and 16-row
    blocks, 1 to 4 warps, with a padding mask."""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    launch = LaunchConfig(token_major=True, block_m=block_m, num_warps=warps)
    _check_history_partial(dim, bits, scale_dtype, groups, rotation, dtype, launch, "token-major history partial")


@pytest.mark.quick
def test_default_launch_follows_the_head_dim_and_rows_unless_one_is_given():
    from oscar_hf.kernels.triton.backend import TritonBackend
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    assert TritonBackend().launch_for(64) == LaunchConfig(num_warps=1, programs_per_sm=24, block_n_dense=32,
                                                          block_m=8, token_major=True, fold_key_offsets=True)
    d128 = TritonBackend().launch_for(128)
    assert d128.token_major and (d128.num_warps, d128.block_n_history, d128.block_n_dense) == (1, 64, 16)
    assert TritonBackend().launch_for(256) == LaunchConfig()
    # a decode step's GQA group keeps the decode launch; a chunk's rows get 64-row row-major blocks (d=128, measured)
    assert TritonBackend().launch_for(128, rows=8) == d128
    chunk = TritonBackend().launch_for(128, rows=4 * 8192)
    assert not chunk.token_major and (chunk.num_warps, chunk.many_rows_block_m) == (4, 64)
    plan = TritonBackend().plan(DEVICE, 4, 8, 4 * 8192, 8192 + 320, 32768, chunk)
    assert plan.block_m == 64 and plan.row_blocks == 4 * 8192 // 64
    assert TritonBackend().launch_for(128, rows=4 * 8192, masked=True) == d128  # padded rows: not measured
    assert TritonBackend().launch_for(64, rows=4 * 8192) == TritonBackend().launch_for(64)  # d=64: not measured
    given = LaunchConfig(block_n_history=64)
    assert TritonBackend(launch=given).launch_for(64) is given
    assert TritonBackend(launch=given).launch_for(128, rows=4 * 8192) is given


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_kind", [None, pytest.param("bool", marks=pytest.mark.quick), "additive"])
def test_dense_partial_matches_reference(dtype, mask_kind):
    dim, groups = 128, 4
    query = _query(groups, 1, dim, dtype)
    keys = torch.randn(BATCH, KV_HEADS, DENSE, dim, device=DEVICE).to(dtype)
    values = torch.randn(BATCH, KV_HEADS, DENSE, dim, device=DEVICE).to(dtype)
    mask = None
    if mask_kind is not None:
        allowed = torch.rand(BATCH, 1, 1, DENSE, device=DEVICE) > 0.3
        mask = allowed if mask_kind == "bool" else torch.where(allowed, 0.0, -1e4).to(dtype) * torch.rand_like(allowed, dtype=dtype)
    out, lse = _kernel_backend().dense_attention(query, keys, values, mask, dim**-0.5)
    ref, ref_lse = ReferenceBackend().dense_attention(query, keys, values, mask, dim**-0.5)
    out_tol, lse_tol = TOLERANCE[torch.float32] if dtype == torch.float32 else TOLERANCE["dense"]
    _assert_close(out, ref, out_tol, "dense partial")
    _assert_lse(lse, ref_lse, lse_tol)


@pytest.mark.quick
def test_merge_matches_reference_and_handles_empty_partials():
    shape = (BATCH, KV_HEADS * 2, 3, 64)
    parts = []
    for i in range(3):
        out = torch.randn(shape, device=DEVICE)
        lse = torch.randn(shape[:-1], device=DEVICE) * 3
        if i == 0:
            lse[0] = float("-inf")
            out[0] = 0.0
        parts.append((out, lse))
    parts[1][1][0, 0] = float("-inf")
    parts[2][1][0, 0] = float("-inf")
    parts[1][0][0, 0] = 0.0
    parts[2][0][0, 0] = 0.0
    out, lse = _kernel_backend().merge(parts)
    ref, ref_lse = ReferenceBackend().merge(parts)
    _assert_close(out, ref, 1e-6, "merge")
    _assert_lse(lse, ref_lse, 1e-5)
    assert (out[0, 0] == 0).all() and torch.isinf(lse[0, 0]).all()


@pytest.mark.parametrize("groups,q_len,splits,plain,columns,batch_rows", [
    (4, 1, 70, 3, 1, 1), (4, 1, 70, 3, 2, 1), (16, 1, 9, 2, None, 1), (3, 2, 33, 0, 2, 1), (4, 1, 5, 5, 1, 1),
    (4, 1, 9, 2, 1, 2), (3, 1, 9, 2, None, 5), (4, 1, 70, 3, 2, 4), (4, 1, 70, 70, 4, 1), (3, 2, 9, 9, 2, 1)])
def test_merge_splits_many_splits_with_rotation(groups, q_len, splits, plain, columns, batch_rows):
    """Stage 2 over many splits (several split chunks, more than 64 log-sum-exps) and rows per program from 4 to
    16: splits [plain, S) are un-rotated by a per-KV-head R_Vᵀ, the rest taken as they are (plain = S: no R_V);
    some splits empty. `columns`: programs sharing each row block's output columns (None: the default for the
    grid)."""
    from oscar_hf.kernels.reference.attention import merge_partials
    from oscar_hf.kernels.triton.merge import merge_splits

    dim, kv_heads = 64, 2
    heads = groups * kv_heads
    part_out = torch.randn(BATCH, heads, q_len, splits, dim, device=DEVICE)
    part_lse = torch.randn(BATCH, heads, q_len, splits, device=DEVICE) * 4
    part_lse[..., 1] = float("-inf")  # an empty split
    part_out[..., 1, :] = 0.0
    rotation = _orthogonal(dim, kv_heads)
    out = torch.full((BATCH, q_len, heads, dim), float("nan"), device=DEVICE)
    lse = torch.full((BATCH, heads, q_len), float("nan"), device=DEVICE)
    merge_splits(part_out, part_lse, splits, out, "blhd", rotation, plain, kv_heads, lse, column_programs=columns,
                 batch_rows=batch_rows)
    group_rotation = rotation.repeat_interleave(groups, dim=0)[None, :, None]  # [1, Hq, 1, D, D]
    parts = []
    for s in range(splits):
        o = part_out[:, :, :, s]
        if s >= plain:
            o = (o[..., None, :] @ group_rotation.transpose(-1, -2)).squeeze(-2)
        parts.append((o, part_lse[:, :, :, s]))
    ref, ref_lse = merge_partials(parts)
    _assert_close(out.transpose(1, 2), ref, 2e-5, "merge over many splits")
    _assert_lse(lse, ref_lse, 2e-5)


def _tiered_case(dim, groups, q_len, dtype, rotation, bits=2, scale_dtype=torch.float16, quantize=True):
    rotations = _rotations(rotation, dim)
    history = _history(dim, bits, scale_dtype, rotations, dtype, quantize=quantize)
    query = _query(groups, q_len, dim, dtype)
    dense_len = DENSE + q_len
    keys = torch.randn(BATCH, KV_HEADS, dense_len + 9, dim, device=DEVICE).to(dtype)[:, :, :dense_len]
    values = torch.randn(BATCH, KV_HEADS, dense_len + 9, dim, device=DEVICE).to(dtype)[:, :, :dense_len]
    return rotations, history, query, keys, values


def _left_padded_mask(q_len, kv_len, pads):
    """HF's bool mask for left padding: `pads[b]` leading columns masked, causal over the last `q_len` columns."""
    cols = torch.arange(kv_len, device=DEVICE)
    rows = torch.arange(kv_len - q_len, kv_len, device=DEVICE)
    causal = cols[None, :] <= rows[:, None]
    padded = cols[None, :] >= torch.tensor(pads, device=DEVICE)[:, None]
    return (causal[None] & padded[:, None, :])[:, None]


def _run_tiered(query, keys, values, mask, history, rotations, softcap=None, launch=None):
    scaling = query.shape[-1] ** -0.5
    batch, q_heads, q_len, dim = query.shape
    out = _kernel_backend(launch).tiered_attention(query, keys, values, mask, history, SINK, *rotations, scaling,
                                                   softcap)
    ref = ReferenceBackend().tiered_attention(query, keys, values, mask, history, SINK, *rotations, scaling, softcap)
    return out, ref


@pytest.mark.parametrize(
    "dim,groups,dtype,rotation,softcap",
    [
        (128, 4, torch.bfloat16, "shared", None),
        pytest.param(64, 2, torch.bfloat16, "per_head", None, marks=pytest.mark.quick),
        (256, 1, torch.bfloat16, None, None),
        (128, 4, torch.float32, "per_head", 30.0),
    ],
)
def test_decode_step_matches_reference(dim, groups, dtype, rotation, softcap):
    """One decode query per row over sink | history | recent, rows left-padded by different amounts (the pads
    of the second row reach into the history columns)."""
    rotations, history, query, keys, values = _tiered_case(dim, groups, 1, dtype, rotation)
    mask = _left_padded_mask(1, HISTORY + keys.shape[2], [0, SINK + 7] + [2] * (BATCH - 2))
    out, ref = _run_tiered(query, keys, values, mask, history, rotations, softcap)
    tol = TOLERANCE[torch.float32][0] if dtype == torch.float32 else TOLERANCE["dense"][0]
    _assert_close(out, ref, tol, "decode step")


@pytest.mark.parametrize("block_n_dense", [64, 32])
def test_decode_step_with_row_starts_instead_of_a_mask(block_n_dense):
    """`dense_start` (what graph decode passes instead of a mask) skips each row's leading dense keys exactly like a
    left-padding mask over the sink; also with 32-key dense tiles."""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    rotations, history, query, keys, values = _tiered_case(128, 4, 1, torch.bfloat16, "shared")
    pads = [0, SINK - 1] + [3] * (BATCH - 2)
    starts = torch.tensor(pads, dtype=torch.int32, device=DEVICE)
    scaling = 128**-0.5
    backend = _kernel_backend(LaunchConfig(block_n_dense=block_n_dense))
    got = backend.tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling, dense_start=starts)
    mask = _left_padded_mask(1, HISTORY + keys.shape[2], pads)
    ref = ReferenceBackend().tiered_attention(query, keys, values, mask, history, SINK, *rotations, scaling)
    ref_starts = ReferenceBackend().tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling,
                                                     dense_start=starts)
    _assert_close(ref_starts, ref, 1e-6, "reference: row starts vs mask")
    _assert_close(got, ref, TOLERANCE["dense"][0], "decode step, row starts")


@pytest.mark.parametrize("dim,groups", [(128, 4), (64, 3)])
def test_folded_key_offsets_match_reference(dim, groups):
    """`LaunchConfig.fold_key_offsets`: key codes keep the unpacking's magic numbers (1024 + code ...) and the
    scores subtract them per row; same tolerance as the exact path. (Under the interpreter the float16 products
    are summed exactly; on a GPU the tensor cores' accumulation is what this test measures.)"""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    launch = LaunchConfig(token_major=True, block_m=8, num_warps=2, fold_key_offsets=True)
    _check_history_partial(dim, 2, torch.float16, groups, "shared", torch.bfloat16, launch,
                           "history partial, folded key offsets")


def test_token_major_decode_step_and_prefill_chunk_match_reference():
    """Token-major history dots with 8-row blocks: a left-padded decode step (one block per GQA group) and a
    chunk of queries (rows beyond 8 fall back to blocks of 16)."""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    launch = LaunchConfig(token_major=True, block_m=8)
    scaling = 128**-0.5
    for q_len in (1, 3):
        rotations, history, query, keys, values = _tiered_case(128, 4, q_len, torch.bfloat16, "shared")
        mask = _left_padded_mask(q_len, HISTORY + keys.shape[2], [0, SINK + 7] + [2] * (BATCH - 2))
        got = _kernel_backend(launch).tiered_attention(query, keys, values, mask, history, SINK, *rotations, scaling)
        ref = ReferenceBackend().tiered_attention(query, keys, values, mask, history, SINK, *rotations, scaling)
        _assert_close(got, ref, TOLERANCE["dense"][0], f"token-major tiered attention, {q_len} queries")


@pytest.mark.parametrize("bits", [3, 4])
def test_decode_step_without_mask_and_with_a_wider_history(bits):
    rotations, history, query, keys, values = _tiered_case(128, 4, 1, torch.bfloat16, "shared", bits=bits)
    out, ref = _run_tiered(query, keys, values, None, history, rotations)
    _assert_close(out, ref, TOLERANCE["dense"][0], f"decode step, {bits} bits")


@pytest.mark.parametrize("explicit_mask", [False, True])
def test_chunked_prefill_matches_reference(explicit_mask):
    """A chunk of queries over the quantized history and the BF16 tiers, causal among the chunk's own tokens;
    with the explicit mask one row is left-padded so that its first queries see nothing at all."""
    rotations, history, query, keys, values = _tiered_case(128, 4, PREFILL, torch.bfloat16, "shared")
    mask = None
    if explicit_mask:
        kv_len = HISTORY + keys.shape[2]
        mask = _left_padded_mask(PREFILL, kv_len, [0] * (BATCH - 1) + [kv_len - PREFILL + 3])
    out, ref = _run_tiered(query, keys, values, mask, history, rotations)
    _assert_close(out, ref, TOLERANCE["dense"][0], "chunked prefill")
    if explicit_mask:
        assert (out[-1, :3] == 0).all()  # queries with no visible key give 0, not NaN


@pytest.mark.parametrize("token_major,block_m,warps", [(True, 64, 4), (False, 64, 4), (False, 32, 1)])
def test_chunked_prefill_in_larger_row_blocks_matches_reference(token_major, block_m, warps):
    """`LaunchConfig.many_rows_block_m`: a chunk's rows in blocks larger than 16 (fewer reads of the history), with
    the left-padded mask, in both history orientations."""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    rotations, history, query, keys, values = _tiered_case(128, 4, PREFILL, torch.bfloat16, "shared")
    kv_len = HISTORY + keys.shape[2]
    mask = _left_padded_mask(PREFILL, kv_len, [0] * (BATCH - 1) + [kv_len - PREFILL + 3])
    launch = LaunchConfig(token_major=token_major, block_m=8 if token_major else 16, num_warps=warps,
                          many_rows_block_m=block_m)
    out, ref = _run_tiered(query, keys, values, mask, history, rotations, launch=launch)
    _assert_close(out, ref, TOLERANCE["dense"][0], f"chunked prefill, {block_m}-row blocks")
    plan = _kernel_backend(launch).plan(DEVICE, BATCH, KV_HEADS, 4 * PREFILL, keys.shape[2], HISTORY, launch)
    assert plan.block_m == block_m and plan.row_blocks == -(-4 * PREFILL // block_m)


@pytest.mark.parametrize("dim,groups,dtype,rotation,bits,scale_dtype,softcap", [
    (128, 4, torch.bfloat16, "shared", 2, torch.float16, None),
    (64, 2, torch.bfloat16, "per_head", 4, torch.uint8, None),
    (128, 4, torch.float32, "per_head", 2, torch.float32, 30.0),
    (64, 2, torch.bfloat16, "shared", 3, torch.float16, None),
])
def test_chunked_prefill_over_a_history_dequantized_in_pieces_matches_reference(monkeypatch, dim, groups, dtype,
                                                                                  rotation, bits, scale_dtype,
                                                                                  softcap):
    """`TritonBackend(dequantize_from_rows=...)`: a chunk's history dequantized piece by piece (several pieces here)
    and attended to by the BF16 kernel, merged with the BF16 tiers' partial and un-rotated by R_Vᵀ."""
    from oscar_hf.kernels.triton import backend as triton_backend

    pieces = []
    dequantize = triton_backend.dequantize_history
    monkeypatch.setattr(triton_backend, "DEQUANTIZE_PIECE_TOKENS", 64)
    monkeypatch.setattr(triton_backend, "dequantize_history",
                        lambda history, start, keys, values: pieces.append(start) or dequantize(history, start, keys,
                                                                                               values))
    rotations, history, query, keys, values = _tiered_case(dim, groups, PREFILL, dtype, rotation, bits, scale_dtype)
    scaling = dim**-0.5
    backend = poisoned_output_backend(target_programs=256, min_dense_tokens=16, min_history_tokens=32,
                                      dequantize_from_rows=groups * PREFILL, compile_threads=0)  # counts its calls
    out = backend.tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling, softcap)
    ref = ReferenceBackend().tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling, softcap)
    piece = -(-max(groups * PREFILL, 64) // 64) * 64
    assert pieces == list(range(0, HISTORY, piece)) and len(pieces) > 1
    _assert_close(out, ref, TOLERANCE[dtype][0] if dtype == torch.float32 else TOLERANCE["dense"][0],
                  "chunked prefill, dequantized history")
    # a mask tensor, or one row fewer than the threshold, keeps the in-kernel unpacking
    mask = _left_padded_mask(PREFILL, HISTORY + keys.shape[2], [0] * BATCH)
    backend.tiered_attention(query, keys, values, mask, history, SINK, *rotations, scaling, softcap)
    backend.dequantize_from_rows = groups * PREFILL + 1
    backend.tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling, softcap)
    assert len(pieces) == -(-HISTORY // piece)


def test_unquantized_history_matches_reference():
    rotations, history, query, keys, values = _tiered_case(64, 2, 1, torch.float32, "shared", quantize=False)
    out, ref = _run_tiered(query, keys, values, None, history, rotations)
    _assert_close(out, ref, TOLERANCE[torch.float32][0], "unquantized history")


@pytest.mark.quick
def test_split_plan_covers_every_token_once():
    from oscar_hf.kernels.triton.launch_plan import plan_splits

    for tokens in (1, 63, 64, 65, 5000, 100_000):
        for batch in (1, 8, 32):
            plan = plan_splits(batch, 8, 4, 330, tokens, 528)
            assert plan.history_splits * plan.history_split_len >= tokens
            assert (plan.history_splits - 1) * plan.history_split_len < tokens
            assert plan.history_split_len % 64 == 0 and plan.total_splits <= 256
            assert batch * 8 * plan.history_splits >= min(528, batch * 8 * math.ceil(tokens / 512))


def test_split_plan_shortens_splits_only_below_min_programs():
    from oscar_hf.kernels.triton.launch_plan import plan_splits

    args = dict(min_dense_tokens=256, min_history_tokens=512, block_n_history=128, block_n_dense=32, small_block_m=8)
    # 4k tokens at batch 1: 8 heads x (2 + 8) splits = 80 programs < 132 -> one history tile, two dense tiles
    short = plan_splits(1, 8, 4, 321, 3775, 792, min_programs=132, **args)
    assert (short.history_split_len, short.history_splits) == (128, 30)
    assert (short.dense_split_len, short.dense_splits) == (64, 6)
    assert 8 * short.total_splits >= 132
    # grids that fill the GPU with the usual minimums keep them
    for batch, tokens in ((1, 32_000), (8, 3775)):
        plan = plan_splits(batch, 8, 4, 321, tokens, 792, min_programs=132, **args)
        assert plan == plan_splits(batch, 8, 4, 321, tokens, 792, **args)
        assert plan.history_split_len >= 512


def test_run_plans_share_a_layers_programs_by_bytes():
    """A layer of 8 KV heads at 100k tokens, one of them at 4 bits (twice a 2-bit row's bytes): the 4-bit run's
    programs read as many bytes as the others' (twice the splits, half as long), the layer keeps about its
    programs, every run covers every token once, and the partial rows hold the most splits any run takes."""
    from oscar_hf.kernels.triton.launch_plan import plan_runs, plan_splits

    plan = plan_splits(8, 8, 4, 330, 100_000, 2112, block_n_history=64)
    heads, row_bytes = (1, 1, 6), (34, 68, 34)
    plans, partial_splits = plan_runs(plan, 100_000, heads, row_bytes, 128)
    narrow, wide = plans[0].history_splits, plans[1].history_splits
    assert plans[2] == plans[0] and abs(wide - 2 * narrow) <= 1
    assert abs(sum(h * p.history_splits for h, p in zip(heads, plans)) - 8 * plan.history_splits) <= 8
    for p in plans:
        assert p.history_split_len % 64 == 0 and p.dense_splits == plan.dense_splits
        assert p.history_splits * p.history_split_len >= 100_000 > (p.history_splits - 1) * p.history_split_len
    assert partial_splits == plan.dense_splits + wide
    capped, _ = plan_runs(plan, 100_000, heads, row_bytes, narrow)  # no run beyond max_splits
    assert max(p.history_splits for p in capped) <= narrow
    assert plan_runs(plan, 100_000, (8,), (34,), 128) == ((plan,), plan.total_splits)  # one run: the layer's plan


def test_backend_takes_the_history_split_minimum_from_its_launch():
    from oscar_hf.kernels.triton.launch_plan import default_launch

    def history_splits(dim):
        backend = TritonBackend(target_programs=2640)
        launch = backend.launch_for(dim)
        return backend.plan(torch.device("cpu"), 1, 8, 4, 321, 32_447, launch).history_splits

    assert default_launch(128).min_history_tokens == 256 and default_launch(64).min_history_tokens == 512
    assert history_splits(128) == 127  # 256-token splits (measured: 0.027 vs 0.032 ms with 512 at 32k/bs1)
    assert history_splits(64) == 64  # 512-token splits
    assert TritonBackend(target_programs=2640, min_history_tokens=512).plan(
        torch.device("cpu"), 1, 8, 4, 321, 32_447, default_launch(128)).history_splits == 64


def test_merge_splits_rejects_bad_column_programs_and_batch_rows():
    from oscar_hf.kernels.triton.merge import merge_splits

    part_out = torch.zeros(1, 4, 1, 3, 64, device=DEVICE)
    part_lse = torch.zeros(1, 4, 1, 3, device=DEVICE)
    out = torch.empty(1, 1, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="column_programs=3"):
        merge_splits(part_out, part_lse, 3, out, "blhd", _orthogonal(64), 1, 1, column_programs=3)
    with pytest.raises(ValueError, match="column_programs=8"):  # 8-column blocks, without R_V
        merge_splits(part_out, part_lse, 3, out, "blhd", None, None, 1, column_programs=8)
    with pytest.raises(ValueError, match="column_programs=4"):  # 16-column blocks, with R_V
        merge_splits(part_out, part_lse, 3, out, "blhd", _orthogonal(64), 1, 1, column_programs=4)
    with pytest.raises(ValueError, match="batch_rows must be at least 1"):
        merge_splits(part_out, part_lse, 3, out, "blhd", _orthogonal(64), 1, 1, batch_rows=0)
    with pytest.raises(ValueError, match="exceed a 16-row block"):
        merge_splits(part_out, part_lse, 3, out, "blhd", _orthogonal(64), 1, 1, batch_rows=8)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("q_len", [1, 5])
def test_rotate_query_matches_float64_product(per_head, q_len):
    from oscar_hf.kernels.triton.query_rotation import rotate_query

    dim, groups = 64, 3
    query = torch.randn(2, KV_HEADS * groups, q_len, dim, device=DEVICE).to(torch.bfloat16)
    rotation = _orthogonal(dim, KV_HEADS if per_head else None)
    out = torch.full(query.shape, float("nan"), device=DEVICE)
    rotate_query(query, rotation, out)
    q = query.double().cpu().view(2, KV_HEADS, groups * q_len, dim)
    r = rotation.double().cpu()
    want = (q @ (r[None] if per_head else r)).view(query.shape)
    assert (out.double().cpu() - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_rotate_query_rejects_a_rotation_of_another_size():
    from oscar_hf.kernels.triton.query_rotation import rotate_query

    with pytest.raises(ValueError, match="does not fit"):
        rotate_query(torch.randn(1, 4, 1, 64, device=DEVICE), _orthogonal(128))


def _padded_layout_mask(dense_len, dense_start, history_start):
    """bool `[B, 1, 1, SINK + HISTORY + dense_len - SINK]` that masks each row's first `dense_start[b]` BF16 rows
    (sink slots, then the recent rows) and first `history_start[b]` history rows: what the row starts mean."""
    dense_cols = torch.arange(dense_len, device=DEVICE)[None] >= torch.tensor(dense_start, device=DEVICE)[:, None]
    hist_cols = torch.arange(HISTORY, device=DEVICE)[None] >= torch.tensor(history_start, device=DEVICE)[:, None]
    return torch.cat([dense_cols[:, :SINK], hist_cols, dense_cols[:, SINK:]], dim=1)[:, None, None]


@pytest.mark.parametrize("token_major,quantize", [(False, True), (True, True), (False, False)])
def test_decode_step_with_history_starts(token_major, quantize):
    """Left-padded rows of a cache skip leading BF16 rows (`dense_start`) and leading history rows
    (`history_start`, some inside a split, one past the whole history): the same attention as a mask over those
    rows, through `tiered_attention` and through the counted `decode_attention` (lengths on the device)."""
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    launch = LaunchConfig(token_major=True, block_m=8) if token_major else None
    rotations, history, query, keys, values = _tiered_case(128, 4, 1, torch.bfloat16, "shared", quantize=quantize)
    dense_pads = [0, 0, SINK] + [SINK + 3] * (BATCH - 3) if BATCH > 3 else [0, SINK + 3]
    history_pads = [0, 37, HISTORY] + [HISTORY] * (BATCH - 3) if BATCH > 3 else [37, HISTORY]
    dense_start = torch.tensor(dense_pads, dtype=torch.int32, device=DEVICE)
    history_start = torch.tensor(history_pads, dtype=torch.int32, device=DEVICE)
    scaling = 128**-0.5
    mask = _padded_layout_mask(keys.shape[2], dense_pads, history_pads)
    ref = ReferenceBackend().tiered_attention(query, keys, values, mask, history, SINK, *rotations, scaling)
    ref_starts = ReferenceBackend().tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling,
                                                     dense_start=dense_start, history_start=history_start)
    _assert_close(ref_starts, ref, 1e-6, "reference: row starts vs mask")
    got = _kernel_backend(launch).tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling,
                                                   dense_start=dense_start, history_start=history_start)
    _assert_close(got, ref, TOLERANCE["dense"][0], "tiered attention, row starts")
    # counted decode: sink slots then recent rows in one buffer, both lengths read on the device
    counted = HistoryTensors(history.keys, history.values, history.key_scale_zero, history.value_scale_zero,
                             history.length, history.bits, torch.tensor([HISTORY], dtype=torch.int32, device=DEVICE))
    dense_length = torch.tensor([keys.shape[2]], dtype=torch.int32, device=DEVICE)
    got = _kernel_backend(launch).decode_attention(DecodeCall(query, keys, values, dense_length, counted, *rotations,
                                                              scaling, None, dense_start, history_start))
    _assert_close(got, ref, TOLERANCE["dense"][0], "counted decode step, row starts")
