"""Whole decode calls with the stage-2 merge's launch options varied (`merge.merge_splits`' column_programs,
split_chunk, num_warps) or the backend's split plan (`TritonBackend` arguments under "backend"; "launch" and
"cuda_history_config" in it as the dataclasses' fields, "launch" over the head_dim's default), graph-timed on
`bench.harness.Case`s (d=128 unless --dim); `"folded": true` times the call of a model with R_V folded into
its weights (`Case.oscar_folded`, whose output times R_Vᵀ is compared). GPU only.

    python -m experiments.kernels.merge_sweep [--cells 1:4096,8:100000] [--variants '[{}, {"num_warps": 8},
        {"backend": {"min_history_tokens": 128}}, {"backend": {"cuda_history_config": {"min_history_bytes": 0}}}]']

The merge runs after the history's last split: its time after stage 1 is the call's tail.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import replace

import torch
from triton.testing import do_bench

from bench.harness import Case, graphed
from oscar_hf.kernels.cuda.history import CudaHistoryConfig
from oscar_hf.kernels.triton import backend as backend_module
from oscar_hf.kernels.triton.backend import TritonBackend
from oscar_hf.kernels.triton.launch_plan import default_launch

DEFAULT_VARIANTS = [{}, {"column_programs": 4}, {"column_programs": 2}, {"column_programs": 1},
                    {"num_warps": 8}, {"num_warps": 2}, {"split_chunk": 8}, {"split_chunk": 16},
                    {"column_programs": 4, "num_warps": 8}, {"column_programs": 4, "split_chunk": 16}]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", default="1:4096,8:4096,1:100000,8:32768,8:100000,32:100000")
    parser.add_argument("--variants", default=json.dumps(DEFAULT_VARIANTS))
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    variants = json.loads(args.variants)
    original = backend_module.merge_splits
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, d={args.dim}; whole calls, us (graph replays)")
    print("| ctx | bs | " + " | ".join(json.dumps(v) for v in variants) + " | max err vs first |")
    print("|---:|---:|" + "---:|" * len(variants) + "---:|")
    for cell in args.cells.split(","):
        batch, context = (int(x) for x in cell.split(":"))
        case = Case(batch, context, args.dim, TritonBackend())
        times, outs = [], []
        for variant in variants:
            variant = dict(variant)
            backend_args = dict(variant.pop("backend", {}))
            if "cuda_history_config" in backend_args:  # CudaHistoryConfig fields as JSON
                backend_args["cuda_history_config"] = CudaHistoryConfig(**backend_args["cuda_history_config"])
            if "launch" in backend_args:  # LaunchConfig fields over the head_dim's default
                backend_args["launch"] = replace(default_launch(args.dim), **backend_args["launch"])
            backend = TritonBackend(**backend_args)
            folded = variant.pop("folded", False)
            call = case.oscar_folded if folded else case.oscar
            backend_module.merge_splits = functools.partial(original, **variant)
            try:
                out = call(backend).float()
                outs.append(out @ case.rotation.T if folded else out)
                us = do_bench(graphed(lambda: call(backend)), warmup=20, rep=100, return_mode="median") * 1e3
                times.append(f"{us:.1f}")
            except Exception as error:  # a variant that does not compile or launch: reported, the sweep goes on
                times.append(f"{type(error).__name__}")
                print(f"variant {variant} failed: {str(error)[:200]}", flush=True)
            finally:
                backend_module.merge_splits = original
        err = max(((o - outs[0]).norm() / outs[0].norm()).item() for o in outs)
        print(f"| {context} | {batch} | " + " | ".join(times) + f" | {err:.1e} |", flush=True)
        case = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
