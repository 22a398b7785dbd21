"""Compile the CUDA history kernel (`oscar_hf/kernels/cuda/int2_history.cu`) for an H200 (sm_90) without a GPU and
print what each configuration costs: registers, stack, the programs per SM that registers and shared memory allow,
and the SASS of its tile loop (instructions per 64-token warp-tile, most common opcodes).

    python -m bench.compile_cuda_history [--configs 4:8:12,3:12:12]   # stages:min warps per SM:magic planes

Needs libnvrtc (`pip install nvidia-cuda-nvrtc`; PyTorch's CUDA wheels ship it) and Triton's bundled cuobjdump.
Resources, not time: whole calls are timed on the GPU by `python -m experiments.kernels.merge_sweep` with
`{"backend": {"cuda_history_config": {...}}}` variants.
"""

from __future__ import annotations

import argparse
import itertools
import re

from bench.harness import SHARED_PER_SM, disassemble_cubin, loop_mixes
from oscar_hf.config import SCALE_DTYPE_NAMES
from oscar_hf.kernels.cuda.history import PAIR_DTYPES, CudaHistoryConfig, compile_cubin, kernel_name, stage_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="4:8:12", help="stages:min_warps_per_sm:magic_planes, comma-separated")
    args = parser.parse_args()
    print("| config | d | rows | pairs | registers | stack | programs/SM | instructions per tile | top opcodes |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---|")
    for spec in args.configs.split(","):
        stages, warps, magic = (int(x) for x in spec.split(":"))
        config = CudaHistoryConfig(stages, warps, magic)
        usage, sass = disassemble_cubin(compile_cubin(90, config))
        for (dim, rows), pairs in itertools.product(((128, 4), (128, 8), (64, 4), (64, 8)), PAIR_DTYPES):
            name = kernel_name(dim, rows, pairs)
            registers, stack = (int(x) for x in re.search(rf"{name}:\s+REG:(\d+) STACK:(\d+)", usage).groups())
            body = sass.split(f"Function : {name}")[1].split("Function :")[0]
            count, ops = max(loop_mixes(body), key=lambda loop: loop[0])
            per_warp_registers = -(-registers // 8) * 8 * 32  # each of the 4 schedulers has 16k registers
            programs = min(4 * (16384 // per_warp_registers), SHARED_PER_SM // ((stages + 1) * stage_bytes(dim) + 1024), 32)
            top = ", ".join(f"{op} {n}" for op, n in list(ops.items())[:8])
            print(f"| {spec} | {dim} | {rows} | {SCALE_DTYPE_NAMES[pairs]} | {registers} | {stack} | {programs} | {count} | {top} |", flush=True)


if __name__ == "__main__":
    main()
