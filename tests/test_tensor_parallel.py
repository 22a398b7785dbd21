"""Tensor parallelism (transformers tp_plan="auto", gloo on CPU): per-KV-head rotations are sliced to each rank's
heads, and every rank's logits match the single-process run."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from oscar_hf import Rotations

from conftest import tiny_model

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.quick
def test_tensor_parallel_ranks_match_single_process(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    gen = torch.Generator().manual_seed(1)
    per_head = {i: torch.linalg.qr(torch.randn(2, 16, 16, generator=gen))[0] for i in (0, 1)}
    Rotations(per_head, {i: r.flip(0) for i, r in per_head.items()}).save_pretrained(tmp_path / "rotations")
    args = [str(tmp_path / "model"), str(tmp_path / "rotations"), str(tmp_path)]
    run([sys.executable, WORKER, *args])
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         WORKER, *args])
    single = torch.load(tmp_path / "rank-single.pt")
    assert single["local_heads"] == 2 and single["history"] > 30
    for rank in (0, 1):
        ranked = torch.load(tmp_path / f"rank-{rank}.pt")
        assert ranked["local_heads"] == 1
        torch.testing.assert_close(ranked["logits"], single["logits"], atol=1e-4, rtol=1e-4)
