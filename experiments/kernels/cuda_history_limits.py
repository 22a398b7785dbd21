"""What bounds a decode attention call: the CUDA history kernel with its attention taken out, and where a small
call's time goes. GPU only.

    python3 experiments/kernels/cuda_history_limits.py [--cases 8:100000,32:100000] [--stages 4,5]
        [--configs '[{}, {"magic_planes": 15}]'] [--modes attend,arithmetic] [--timeline 1:4096,8:100000]

Bandwidth table (d=128, history splits filling one wave): the history kernel alone, graph-timed (L2 flushed by
`do_bench`), as the default kernel ("attend"), with `CudaHistoryConfig.diagnostic=1` ("copies": the tiles staged
in shared memory, nothing attended), `diagnostic=2` ("copies + reads": every lane's words also read back) and
`diagnostic=3` ("arithmetic": every tile attended from the first staged buffer, no copies after the prologue);
history bytes (codes + scale/zero of K and V) over the time, and that over the copy bandwidth of the same process.
`--configs`: CudaHistoryConfig fields over the default, one table block each.

`--timeline`: the kernels of one decode call (bench/attention.py's case: BF16 tiers, rotation, history, merge), start
and end relative to the first kernel's start, from torch.profiler over eager calls and over CUDA-graph replays,
beside SDPA's; then both calls graph-timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from triton.testing import do_bench  # noqa: E402

from attention import Case, copy_bandwidth, graphed, profiled  # noqa: E402
from cuda_history_ab import KV_HEADS, run_both, wave_plan  # noqa: E402

from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402
from oscar_hf.kernels.cuda.history import CudaHistoryConfig, history_bytes  # noqa: E402

MODES = (("attend", 0), ("copies", 1), ("copies + reads", 2), ("arithmetic", 3))


def kernel_us(batch: int, length: int, dim: int, config: CudaHistoryConfig) -> float:
    plan = wave_plan(batch, length, dim, config)
    *_, cuda_call = run_both(batch, length, dim, plan=plan, config=config)
    us = do_bench(graphed(cuda_call), warmup=10, rep=60, return_mode="median") * 1e3
    del cuda_call
    torch.cuda.empty_cache()
    return us


def bandwidth_table(cases, stages_list, dim, copy_bw, configs=({},), modes=MODES):
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + written)")
    print("| bs | ctx | config | stages | mode | kernel us | history GB/s | % copy |")
    print("|---:|---:|---|---:|---|---:|---:|---:|")
    for batch, length in cases:
        nbytes = history_bytes(batch, KV_HEADS, length, dim)
        for fields in configs:
            label = json.dumps(fields)
            for stages in stages_list:
                for name, diagnostic in modes:
                    config = replace(CudaHistoryConfig(), **fields, stages=stages, diagnostic=diagnostic)
                    try:
                        us = kernel_us(batch, length, dim, config)
                    except RuntimeError as error:  # e.g. shared memory for these stages
                        print(f"| {batch} | {length} | {label} | {stages} | {name} | failed: {error} | | |",
                              flush=True)
                        continue
                    rate = nbytes / (us * 1e-6)
                    print(f"| {batch} | {length} | {label} | {stages} | {name} | {us:.1f} | {rate / 1e9:.0f} | "
                          f"{100 * rate / copy_bw:.0f}% |", flush=True)


def kernel_spans(fn, calls: int = 20):
    """(name, start us, end us) of the GPU kernels of the last of `calls` calls, relative to its first kernel."""
    prof = profiled(fn, calls, sync_each=True)
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA"), key=lambda k: k[0])
    per_call = len(kernels) // calls
    last = kernels[-per_call:] if per_call else []
    if not last:
        return []
    t0 = last[0][0]
    return [(name[:48], start - t0, end - t0) for start, end, name in last]


def timeline(cases, dim=128):
    backend = TritonBackend()
    for batch, context in cases:
        case = Case(batch, context, dim, backend)
        calls = (("OSCAR", functools.partial(case.oscar, backend)), ("SDPA", case.sdpa))
        for label, fn in calls:
            for mode, call in (("eager", fn), ("graph", graphed(fn))):
                spans = kernel_spans(call)
                print(f"{label} {mode} (ctx {context}, bs {batch}, d={dim}): "
                      + "; ".join(f"{n} {s:.1f}-{e:.1f}" for n, s, e in spans), flush=True)
        for label, fn in calls:
            us = do_bench(graphed(fn), warmup=20, rep=100, return_mode="median") * 1e3
            print(f"{label} graph replay (ctx {context}, bs {batch}), do_bench median: {us:.1f} us", flush=True)
        del case
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="8:100000,32:100000", help="batch:history tokens, ...")
    parser.add_argument("--stages", default="4,5")
    parser.add_argument("--configs", default="[{}]", help="JSON list of CudaHistoryConfig fields")
    parser.add_argument("--modes", default=",".join(name for name, _ in MODES))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--timeline", default="", help="batch:context, ... (e.g. 1:4096,8:100000)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    if args.cases:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
        modes = [mode for mode in MODES if mode[0] in args.modes.split(",")]
        bandwidth_table(cases, [int(s) for s in args.stages.split(",")], args.dim, copy_bandwidth(),
                        json.loads(args.configs), modes)
    if args.timeline:
        timeline([tuple(int(x) for x in c.split(":")) for c in args.timeline.split(",")], args.dim)


if __name__ == "__main__":
    main()
