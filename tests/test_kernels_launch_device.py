"""Triton launches on the current CUDA device, not on its tensors' device: every kernel launcher makes the device of
the tensors it writes current first, so layers that a `device_map` put on cuda:1 run their kernels there."""

import contextlib
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import QuantizedHistory  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.triton import common, demote, merge, stage1  # noqa: E402
from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402
from oscar_hf.rotations.math import hadamard_matrix  # noqa: E402


@pytest.mark.quick
def test_launch_device_switches_only_to_another_cuda_device(monkeypatch):
    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered.append(device) or contextlib.nullcontext())
    on = lambda kind, index=None: types.SimpleNamespace(device=torch.device(kind, index))  # noqa: E731
    with common.launch_device(on("cuda", 1)):
        pass
    for same_or_cpu in (on("cuda", 0), on("cpu")):
        with common.launch_device(same_or_cpu):
            pass
    assert entered == [torch.device("cuda", 1)]


def _layer_inputs(device, dtype=torch.float32, tokens=40, dim=64):
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, tokens, dim, generator=gen).to(device, dtype) for _ in range(2))
    rotation = hadamard_matrix(dim, torch.float32).to(device)
    return keys, values, rotation


def _demote_and_attend(backend, device):
    """Demote 32 tokens into a history, then attend one query over 8 BF16 tokens + that history."""
    keys, values, rotation = _layer_inputs(device)
    history = QuantizedHistory(1, 2, 64, 64, OscarConfig.from_method("hadamard"), device)
    history._reserve(32)
    history.append(keys[:, :, :32], values[:, :, :32], rotation, rotation, backend)
    query = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(1)).to(device)
    return backend.tiered_attention(query, keys[:, :, 32:], values[:, :, 32:], None, history.kernel_view(), 0,
                                    rotation, rotation, 0.125)


@pytest.mark.quick
def test_every_kernel_launch_is_guarded_by_its_tensors_device(monkeypatch):
    device = kernel_device()
    guarded = []
    recorder = lambda tensor: guarded.append(tensor.device) or contextlib.nullcontext()  # noqa: E731
    for module in (demote, stage1, merge):
        monkeypatch.setattr(module, "launch_device", recorder)
    out = _demote_and_attend(TritonBackend(compile_threads=0), device)  # no compile-only pass: it counts launches
    assert out.shape == (1, 1, 4, 64)
    assert len(guarded) == 3 and set(guarded) == {out.device}  # demotion, stage-1 partials, merge


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_on_the_second_gpu_match_the_reference_while_the_first_is_current():
    torch.cuda.set_device(0)
    second = torch.device("cuda", 1)
    got = _demote_and_attend(TritonBackend(), second)
    expected = _demote_and_attend(ReferenceBackend(), second)
    assert got.device == second
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
