"""Calls of the CUDA history kernel (variants `stages:min_warps:magic_planes` from argv, splits filling one wave)
and of the Triton stage 1 on the same 100k-token / batch-8 / d=128 history, for `ncu` to profile:

    ncu -k regex:int2_history --section WarpStateStats ... python3 experiments/kernels/cuda_history_profile.py 4:8:13
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from cuda_history_ab import run_both, wave_plan  # noqa: E402

from oscar_hf.kernels.cuda.history import CudaHistoryConfig  # noqa: E402

for variant in sys.argv[1:] or ["4:8:13"]:
    stages, warps, magic = (int(x) for x in variant.split(":"))
    config = CudaHistoryConfig(stages, warps, magic)
    *_, triton_call, cuda_call = run_both(8, 100_000, 128, programs_per_sm=20,
                                          plan=wave_plan(8, 100_000, 128, config), config=config)
    for _ in range(2):
        cuda_call()
triton_call()
torch.cuda.synchronize()
