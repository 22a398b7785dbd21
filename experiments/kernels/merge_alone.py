"""The stage-2 merge kernel alone (`merge.merge_splits`), graph-timed with the L2 flushed (`do_bench`) and with the
partials L2-resident (written just before, as in a decode call), for decode shapes: 32 query / 8 KV heads, d=128,
one query position. Varies the split count, R_Vᵀ on/off and the launch options, to see what a merge costs.
GPU only.

    python -m experiments.kernels.merge_alone
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from bench.harness import KV_HEADS, Q_HEADS, graphed
from oscar_hf.kernels.triton.merge import merge_splits

DIM = 128


def time_merge(batch: int, splits: int, plain: int, rotate: bool, **options) -> tuple[float, float]:
    rows = batch * Q_HEADS
    partial_out = torch.randn(rows * splits * DIM, device="cuda")
    partial_lse = torch.randn(rows * splits, device="cuda")
    out = torch.empty(batch, 1, Q_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    rotation = torch.linalg.qr(torch.randn(DIM, DIM, device="cuda"))[0] if rotate else None
    touch = torch.empty_like(partial_out)

    def call():
        merge_splits(partial_out, partial_lse, splits, out, "blhd", rotation, plain, KV_HEADS, **options)

    def warm_call():  # the partials rewritten first (L2-resident, as after stage 1), then the merge
        touch.copy_(partial_out)
        call()

    cold, warm, copy = (do_bench(graphed(fn), warmup=20, rep=100, return_mode="median") * 1e3
                        for fn in (call, warm_call, lambda: touch.copy_(partial_out)))
    return cold, warm - copy


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: merge alone, us (graph replay; 'warm' = "
          "after rewriting the partials, the rewrite's own time subtracted)")
    cells = [(1, 70, 11), (1, 35, 11), (1, 18, 2), (1, 130, 2), (8, 18, 2), (32, 6, 2)]
    variants = [dict(rotate=True), dict(rotate=False), dict(rotate=True, batch_rows=2), dict(rotate=True, batch_rows=4),
                dict(rotate=True, batch_rows=4, column_programs=4), dict(rotate=True, batch_rows=2, column_programs=4)]
    print("| bs | splits (plain) | " + " | ".join(json.dumps(v) + " cold / warm" for v in variants) + " |")
    print("|---:|---:|" + "---|" * len(variants))
    for batch, splits, plain in cells:
        cols = []
        for variant in variants:
            cold, warm = time_merge(batch, splits, plain, **variant)
            cols.append(f"{cold:.1f} / {warm:.1f}")
        print(f"| {batch} | {splits} ({plain}) | " + " | ".join(cols) + " |", flush=True)


if __name__ == "__main__":
    main()
