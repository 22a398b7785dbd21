"""Three OSCAR decode-attention calls at 100k context, batch 8, d=128, for `ncu` to profile (bench/gpu_run.sh)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attention import Case  # noqa: E402

from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402

backend = TritonBackend()
case = Case(8, 100_000, 128, backend)
for _ in range(3):
    case.oscar(backend)
torch.cuda.synchronize()
