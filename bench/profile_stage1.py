"""Three OSCAR decode-attention calls at 100k context, batch 8, d=128, for `ncu` to profile (bench/gpu_run.sh):

    ncu -k regex:_attention_partials ... python -m bench.profile_stage1
"""

import torch

from bench.harness import Case
from oscar_hf.kernels.triton.backend import TritonBackend


def main():
    backend = TritonBackend()
    case = Case(8, 100_000, 128, backend)
    for _ in range(3):
        case.oscar(backend)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
