"""Where a compiled `generate` decode step with an OscarCache spends its GPU time (random-weight Qwen3-8B).

    python -m bench.profile_generate [--context 32768] [--batch 8] [--rows 20] [--cache static]

Fills an OscarCache (bench.harness.fill_oscar; `--cache oscar-default`: what `OscarCache(model)` stores; `--cache
static`: a StaticCache, the speed anchor, to compare with), runs a 6-token `generate` (compilation, CUDA-graph
recording), then profiles a 9-token call and prints the CUDA kernels by total time (`--cprofile`: the host's Python
functions).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import FILLERS, build_model, set_attention
from oscar_hf.compat import cache_argument_name


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--cache", default="oscar", choices=["oscar", "oscar-default", "static"],
                   help="oscar: uniform 2-bit rows; oscar-default: what OscarCache(model) stores")
    p.add_argument("--eager", action="store_true", help="generate without its compile (disable_compile=True)")
    p.add_argument("--timeline", action="store_true", help="also print each kernel's share of the GPU's busy time "
                   "(overlapping kernels share it) and the idle time between kernels, from the profiler's trace")
    p.add_argument("--cprofile", action="store_true", help="profile the host (Python) side instead: cProfile, "
                   "functions by own time")
    args = p.parse_args()
    model = build_model()
    set_attention(model, args.cache)
    cache = FILLERS[args.cache](model, args.batch, args.context)
    name = cache_argument_name(model)

    def run(n):
        ids = torch.randint(10, 1000, (args.batch, int(cache.get_seq_length()) + 1), device="cuda")
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, disable_compile=args.eager, **{name: cache})
        torch.cuda.synchronize()

    run(6)
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        run(9)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.rows)
        return
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run(9)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.timeline:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                print_timeline(json.load(f)["traceEvents"], rows=args.rows)


def print_timeline(events, rows: int) -> None:
    """Over the replayed CUDA graphs' kernels (the compiled steps; generate's first forward runs eagerly), per step:
    per kernel name, calls, summed durations, and its share of the time the GPU was busy (a span where k kernels run
    at once counts 1/k to each); then the idle time between kernels. Kernel durations alone overstate a kernel
    launched as a programmatic dependent: it starts while its predecessor still runs."""
    launches = [e for e in events if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch"]
    replayed = {e.get("args", {}).get("correlation") for e in launches}
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") == "kernel" and e.get("ph") == "X"
                     and e.get("args", {}).get("correlation") in replayed)
    steps = len(launches)
    if not kernels:
        print("no replayed kernels in the trace (an eager run: --timeline reads compiled steps)")
        return
    cuts = sorted({t for start, end, _ in kernels for t in (start, end)})
    share, summed, calls = {}, {}, {}
    for start, end, name in kernels:
        summed[name] = summed.get(name, 0.0) + end - start
        calls[name] = calls.get(name, 0) + 1
    active, busy, idle, i = [], 0.0, 0.0, 0
    for left, right in zip(cuts, cuts[1:]):
        while i < len(kernels) and kernels[i][0] <= left:
            active.append(kernels[i])
            i += 1
        active = [k for k in active if k[1] > left]
        if not active:
            idle += right - left
            continue
        busy += right - left
        for _, _, name in active:
            share[name] = share.get(name, 0.0) + (right - left) / len(active)
    span = kernels[-1][1] - kernels[0][0]
    print(f"\nGPU timeline over {steps} steps: span {span / 1e3 / steps:.2f} ms/step, busy {busy / 1e3 / steps:.2f}, "
          f"idle between kernels {idle / 1e3 / steps:.2f}")
    print("| kernel | calls/step | summed ms/step | share of busy ms/step |\n|---|---:|---:|---:|")
    for name in sorted(share, key=share.get, reverse=True)[:rows]:
        print(f"| {name[:70]} | {calls[name] / steps:.0f} | {summed[name] / 1e3 / steps:.3f} | "
              f"{share[name] / 1e3 / steps:.3f} |")


if __name__ == "__main__":
    main()
