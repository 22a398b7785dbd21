"""A decode step over a layer split by KV heads (`high_precision_heads`) served by the Triton backend in one call:
one query rotation, one launch of the BF16 tiers' splits, the history's splits into the same partial buffers (one
launch per run of KV heads, or one for all of them), one merge (`TritonBackend._run_split`), against the reference
backend run by run.

Runs on CPU through Triton's interpreter and on a CUDA device (where the runs of a large enough history go to the
CUDA history kernel in one launch: the GPU case checks that too). Outputs and scratch are poisoned, and the reference
fallbacks raise while the kernels are under test.
"""

import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import HeadSplitHistory  # noqa: E402
from oscar_hf.kernels.interface import DecodeCall, decode_by_runs  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.reference.quantize import COMPACT  # noqa: E402
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402

DEVICE = kernel_device()
ON_GPU = DEVICE.type == "cuda"

from oscar_hf.kernels.cuda import history as cuda_history  # noqa: E402
from oscar_hf.kernels.triton import backend as triton_backend  # noqa: E402

from conftest import poisoned_output_backend  # noqa: E402

BATCH, KV_HEADS, GROUPS, DIM = (3, 8, 4, 128) if ON_GPU else (2, 4, 2, 64)
# GPU: every 2-bit run above the CUDA kernel's minimum; CPU: long enough for the 4-bit runs to take more splits
HISTORY, DENSE = (40000, 330) if ON_GPU else (600, 40)
TOLERANCE = 1.5e-2  # bfloat16 decode over the BF16 tiers and the history (`test_kernels_compact`'s "dense")
REFERENCE_OPS = ("dense_attention", "history_attention", "tiered_attention", "decode_attention")


def _orthogonal(heads, dim):
    q, _ = torch.linalg.qr(torch.randn(heads, dim, dim, dtype=torch.float64))
    return q.float().to(DEVICE)


def _split_layer(high_heads):
    """A filled split history (sigma rows with compact pairs, the given KV heads at 4 bits) with per-head
    rotations, a bfloat16 decode query and BF16 rows."""
    config = OscarConfig(scale_dtype="compact", encoder="sigma", key_clip_ratio=None, value_clip_ratio=None,
                         high_precision_heads=tuple((0, h) for h in high_heads))
    history = HeadSplitHistory(BATCH, KV_HEADS, DIM, DIM, config, DEVICE)
    rotations = (_orthogonal(KV_HEADS, DIM), _orthogonal(KV_HEADS, DIM))
    keys = (torch.randn(BATCH, KV_HEADS, HISTORY, DIM, device=DEVICE) * 1.5).to(torch.bfloat16)
    values = torch.randn(BATCH, KV_HEADS, HISTORY, DIM, device=DEVICE).to(torch.bfloat16)
    history.append(keys, values, *rotations, ReferenceBackend())
    split = history.counted_view(torch.tensor([HISTORY], dtype=torch.int32, device=DEVICE))
    query = (torch.randn(BATCH, KV_HEADS * GROUPS, 1, DIM, device=DEVICE) * 1.5).to(torch.bfloat16)
    dense_keys = torch.randn(BATCH, KV_HEADS, DENSE + 3, DIM, device=DEVICE).to(torch.bfloat16)
    dense_values = torch.randn(BATCH, KV_HEADS, DENSE + 3, DIM, device=DEVICE).to(torch.bfloat16)
    dense_length = torch.tensor([DENSE], dtype=torch.int32, device=DEVICE)
    return split, rotations, query, dense_keys, dense_values, dense_length


def _assert_close(out, ref, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= TOLERANCE, f"{what}: relative error {err:.2e} > {TOLERANCE:.1e}"


@pytest.mark.parametrize("high_heads,padded", [((1,), False), ((0, KV_HEADS - 1), True)])
def test_a_split_layer_decodes_in_one_call_like_the_reference_run_by_run(high_heads, padded, monkeypatch):
    """Three runs (a 4-bit head between 2-bit ones: every later run writes at a head offset) and two runs at the
    ends with left padding (dense and history row starts: the history runs then go through Triton)."""
    split, rotations, query, keys, values, dense_length = _split_layer(high_heads)
    assert [r.history.bits for r in split.runs] == [4 if r.start in high_heads else 2 for r in split.runs]
    assert {r.history.key_scale_zero.dtype for r in split.runs if r.history.bits == 4} == {torch.float16}
    assert {r.history.key_scale_zero.dtype for r in split.runs if r.history.bits == 2} == {COMPACT}
    dense_start = history_start = None
    if padded:
        dense_start = torch.tensor([0, 3] + [1] * (BATCH - 2), dtype=torch.int32, device=DEVICE)
        history_start = torch.tensor([0, 37] + [0] * (BATCH - 2), dtype=torch.int32, device=DEVICE)
    scaling = DIM ** -0.5
    reference = ReferenceBackend()
    call = DecodeCall(query, keys, values, dense_length, split, *rotations, scaling, None, dense_start, history_start)
    ref = decode_by_runs(reference.decode_attention, call)

    launches = Counter()
    run_splits = {}  # code width -> the history splits its runs' launches were cut into

    def counting(name, fn, kind=None):
        def wrapped(*args, **kwargs):
            launches[name if kind is None else kind(*args, **kwargs)] += 1
            if name == "cuda runs":
                for run, plan in zip(args[1], args[2]):
                    run_splits.setdefault(run.history.bits, set()).add(plan.history_splits)
            elif name == "cuda" or kwargs.get("history_only"):
                history, plan = (args[1], args[2]) if name == "cuda" else (args[3], args[6])
                run_splits.setdefault(history.bits, set()).add(plan.history_splits)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(triton_backend, "rotate_query", counting("rotation", triton_backend.rotate_query))
    monkeypatch.setattr(triton_backend, "merge_splits", counting("merge", triton_backend.merge_splits))
    monkeypatch.setattr(triton_backend, "attention_partials", counting(
        "dense", triton_backend.attention_partials,
        lambda *a, **k: "dense" if k.get("dense_only") else "history" if k.get("history_only") else "whole"))
    monkeypatch.setattr(cuda_history, "history_partials", counting("cuda", cuda_history.history_partials))
    monkeypatch.setattr(cuda_history, "history_runs_partials",
                        counting("cuda runs", cuda_history.history_runs_partials))
    for name in REFERENCE_OPS:
        monkeypatch.setattr(ReferenceBackend, name,
                            lambda *a, _name=name, **k: pytest.fail(f"the Triton backend handed {_name} to the reference"))
    backend = poisoned_output_backend(target_programs=256, min_dense_tokens=16, min_history_tokens=32,
                                      eager_graphs=False, compile_threads=0)  # counts its launches
    for buffer in backend._workspace(DEVICE, 1 << 22, 1 << 16, 1 << 16):
        buffer.fill_(float("nan"))
    got = backend.decode_attention(call)
    _assert_close(got, ref, "split decode step")
    runs = len(split.runs)
    assert launches["rotation"] == 1 and launches["dense"] == 1 and launches["merge"] == 1
    assert "whole" not in launches
    if ON_GPU and not padded and all(cuda_history.available(cuda_history.device_index(DEVICE), bits=bits)
                                     for bits in cuda_history.CODE_BITS + (cuda_history.RUNS,)):
        assert launches["cuda runs"] == 1 and launches["history"] + launches["cuda"] == 0, \
            "the 2- and 4-bit runs go to the CUDA history kernel, in one launch"
    else:
        assert launches["history"] + launches["cuda"] == runs and launches["cuda runs"] == 0
    # the layer's programs shared by bytes: a 4-bit row is twice a 2-bit one's bytes, so its run takes more splits
    assert len(run_splits[2]) == len(run_splits[4]) == 1 and min(run_splits[4]) > max(run_splits[2]), run_splits


@pytest.mark.quick
def test_split_histories_go_whole_only_to_backends_that_take_them():
    """`HeadSplitBackend` calls a backend once per run unless it says it takes a split history whole."""
    from oscar_hf.head_groups import HeadSplitBackend

    split, rotations, query, keys, values, dense_length = _split_layer((1,))
    seen = []

    class Recording(ReferenceBackend):
        decodes_split_histories = False

        def decode_attention(self, call):
            seen.append(type(call.history).__name__)
            if type(call.history).__name__ == "HeadSplitTensors":
                return decode_by_runs(super().decode_attention, call)
            return super().decode_attention(call)

    class Whole(Recording):
        decodes_split_histories = True

    call = DecodeCall(query, keys, values, dense_length, split, *rotations, DIM ** -0.5)
    per_run = HeadSplitBackend(Recording()).decode_attention(call)
    assert seen == ["HistoryTensors"] * len(split.runs) and per_run.shape == (BATCH, 1, KV_HEADS * GROUPS, DIM)
    seen.clear()
    whole = HeadSplitBackend(Whole()).decode_attention(call)
    assert seen == ["HeadSplitTensors"] and torch.equal(whole, per_run)
    assert triton_backend.TritonBackend.decodes_split_histories
