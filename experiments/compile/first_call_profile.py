"""Where the first `generate` call's time goes (issue 22's "first-call compile or capture time"): compile stages.

    python -m experiments.compile.first_call_profile [--cache oscar|static] [--context 4096] [--batch 1]

A random Qwen3-8B, a cache filled to `--context` tokens (`bench.harness`'s fillers), then the first `generate`
call of 6 tokens (what `bench.generate` reports as "first call s") under cProfile. Prints the total and the
`--top` functions by cumulative time (the compile stages: dynamo, inductor, Triton's JIT, CUDA-graph recording;
work in inductor's compile workers is not seen, only the wait for it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from bench import harness
from bench.harness import FILLERS, build_model, set_attention, sync
from oscar_hf.compat import cache_argument_name

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default="oscar", choices=["oscar", "static"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    model = build_model()
    set_attention(model, args.cache)
    cache = FILLERS[args.cache](model, args.batch, args.context)
    start = int(cache.get_seq_length())
    ids = torch.randint(10, 1000, (args.batch, start + 1), device=harness.DEVICE)
    profiler = cProfile.Profile()
    sync()
    began = time.perf_counter()
    profiler.enable()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                   **{cache_argument_name(model): cache})
    sync()
    profiler.disable()
    total = time.perf_counter() - began
    print(f"{args.cache} {args.context}/{args.batch}: first call {total:.1f} s (under cProfile)")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
