"""Where a decode step's time goes: plain forwards (no `generate`) through a filled cache, timed, then profiled.

    python -m bench.profile_step [--contexts 32768] [--batches 1,8,32] [--steps 12] [--smoke]

Prints per (context, batch): median ms of a bare forward step and of a `generate` step (`bench.generate`'s
method), then torch.profiler's top operations by self device time and by host time for the bare forward.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench import harness
from oscar_hf.compat import cache_argument_name


def bare_steps(model, cache, batch, steps):
    """Median ms of single-token forwards continuing `cache`."""
    name = cache_argument_name(model)
    times = []
    ids = torch.randint(10, 1000, (batch, 1), device=harness.DEVICE)
    for _ in range(steps):
        harness.sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache})
        harness.sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def profile(model, cache, batch, steps=4, rows=12):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    name = cache_argument_name(model)
    ids = torch.randint(10, 1000, (batch, 1), device=harness.DEVICE)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if harness.DEVICE == "cuda" else [])
    with torch_profile(activities=activities) as prof, torch.no_grad():
        for _ in range(steps):
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache})
        harness.sync()
    averages = prof.key_averages()
    device_key = "self_cuda_time_total" if harness.DEVICE == "cuda" else "self_cpu_time_total"
    print(averages.table(sort_by=device_key, row_limit=rows, max_name_column_width=60))
    print(averages.table(sort_by="cpu_time_total", row_limit=rows, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        harness.DEVICE = "cpu"
    model = harness.build_model(smoke=args.smoke)
    harness.set_attention(model, "oscar")
    summary = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            cache = harness.fill_oscar(model, batch, context)
            bare_steps(model, cache, batch, 3)  # warm-up: compilation, allocator
            bare = bare_steps(model, cache, batch, args.steps)
            (step, _), *_ = harness.decode_step(model, cache, batch, context, warmup=4, steps=args.steps)
            summary.append((context, batch, bare, step))
            print(f"ctx {context} bs {batch}: bare forward {bare:.1f} ms, generate step {step:.1f} ms", flush=True)
            if not args.no_profile:
                profile(model, cache, batch)
            del cache
            harness.empty_cache()
    print("| ctx | bs | bare forward ms | generate step ms |\n|---:|---:|---:|---:|")
    for row in summary:
        print("| {} | {} | {:.1f} | {:.1f} |".format(*row))


if __name__ == "__main__":
    main()
