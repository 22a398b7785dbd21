"""Calls of the CUDA history kernel (variants `stages:min_warps:magic_planes`, splits filling one wave of its
resident programs) and of the Triton stage 1 on the same random 100k-token / batch-8 / d=128 history (the
history tier alone, no BF16 tiers), for `ncu` to profile. GPU only.

    ncu -k regex:int2_history --section WarpStateStats ... python -m experiments.kernels.cuda_history_profile 4:8:13
"""

import argparse

import torch

from bench.harness import KV_HEADS, Q_HEADS
from oscar_hf.kernels.cuda.history import CudaHistoryConfig, history_partials, plan_history, resident_slots
from oscar_hf.kernels.interface import HistoryTensors
from oscar_hf.kernels.triton.stage1 import attention_partials
from oscar_hf.kernels.triton.backend import TritonBackend
from oscar_hf.kernels.triton.common import multiprocessors
from oscar_hf.kernels.triton.launch_plan import default_launch

BATCH, LENGTH, DIM = 8, 100_000, 128
TRITON_PROGRAMS_PER_SM = 20  # the Triton stage 1's split plan


def random_history(batch: int, length: int, dim: int) -> HistoryTensors:
    """Random 2-bit codes and float16 (scale, zero) of K and V, as a QuantizedHistory stores them."""
    shape = (batch, KV_HEADS, length)

    def scale_zero():
        scale = torch.rand(*shape, 1, device="cuda") * 0.2 + 0.02
        zero = torch.randint(0, 4, (*shape, 1), device="cuda").float() + torch.rand(*shape, 1, device="cuda") - 0.5
        return torch.cat([scale, zero], dim=-1).half()

    def codes():
        return torch.randint(0, 256, (*shape, dim // 4), dtype=torch.uint8, device="cuda")

    return HistoryTensors(codes(), codes(), scale_zero(), scale_zero(), length, 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", default=["4:8:13"], help="stages:min_warps_per_sm:magic_planes")
    args = parser.parse_args()
    torch.manual_seed(0)
    history = random_history(BATCH, LENGTH, DIM)
    rotated = torch.randn(BATCH, Q_HEADS, 1, DIM, device="cuda") * 2.0  # the query after R_K, float32
    query = rotated.to(torch.bfloat16)
    launch = default_launch(DIM)
    backend = TritonBackend(target_programs=TRITON_PROGRAMS_PER_SM * multiprocessors(query.device))
    triton_plan = backend.plan(query.device, BATCH, KV_HEADS, Q_HEADS // KV_HEADS, 0, LENGTH, launch)
    scaling = DIM**-0.5
    variants = []
    for variant in args.variants:
        stages, warps, magic = (int(x) for x in variant.split(":"))
        config = CudaHistoryConfig(stages, warps, magic)
        slots = resident_slots(torch.cuda.current_device(), DIM, config)
        variants.append((config, plan_history(triton_plan, LENGTH, BATCH * KV_HEADS, slots, config)))
    rows = BATCH * Q_HEADS * max([triton_plan.total_splits] + [plan.total_splits for _, plan in variants])
    partial_out = torch.empty(rows * DIM, device="cuda")
    partial_lse = torch.empty(rows, device="cuda")
    for config, plan in variants:
        for _ in range(2):
            history_partials(rotated, history, plan, scaling, KV_HEADS, partial_out, partial_lse, config)
    attention_partials(query, None, None, history, rotated, None, triton_plan, scaling, None, False, 0, 0,
                       partial_out, partial_lse, KV_HEADS, launch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
