"""Where a compiled `generate` decode step with an OscarCache spends its GPU time (random-weight Qwen3-8B).

    python -m bench.profile_generate [--context 32768] [--batch 8] [--rows 20]

Fills an OscarCache (bench.harness.fill_oscar), runs a 6-token `generate` (compilation, CUDA-graph recording),
then profiles a 9-token call and prints the CUDA kernels by total time (`--cprofile`: the host's Python functions).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import build_model, fill_oscar, set_attention
from oscar_hf.compat import cache_argument_name


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="generate without its compile (disable_compile=True)")
    p.add_argument("--cprofile", action="store_true", help="profile the host (Python) side instead: cProfile, "
                   "functions by own time")
    args = p.parse_args()
    model = build_model()
    set_attention(model, "oscar")
    cache = fill_oscar(model, args.batch, args.context)
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


if __name__ == "__main__":
    main()
