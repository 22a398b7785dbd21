"""Where a chunked-prefill `generate` with an OscarCache spends its time (random-weight Qwen3-8B): every step's time
inside one call, chunked and whole prompts alike (a stopping criterion stamps each step), the backend's replay and
scratch state after each, then torch.profiler over decode steps alone (a continuation `generate` over the cache
a prefill filled) and over one whole chunked call: CUDA kernels by total time.

    python -m experiments.prefill.profile_chunked [--context 16384] [--batch 4] [--chunk 4096] [--steps 12] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import StoppingCriteriaList

from bench import harness
from bench.harness import StepTimer, build_model, set_attention
from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name


def backend_state(cache) -> str:
    """Layer 0's backend: its CUDA-graph replays (`kernels.replay`) and its scratch sizes."""
    backend = cache.layers[0].backend
    graphs = getattr(backend, "graphs", None)
    sizes = [tuple(b.numel() for b in v) for v in getattr(backend, "_scratch", {}).values()]
    if graphs is None:
        return f"{type(backend).__name__}: no graphs; scratch {sizes}"
    return (f"{type(backend).__name__}: graphs {len(graphs)}, captures {graphs.captures}, seen {len(graphs._seen)}, "
            f"failed {len(graphs._failed)}; scratch floats {sizes}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        harness.DEVICE = "cpu"
    model = build_model(smoke=args.smoke)
    set_attention(model, "oscar")
    name = cache_argument_name(model)
    ids = torch.randint(10, 1000, (args.batch, args.context), device=harness.DEVICE)

    def run(chunk, steps, cache=None, prompt=ids):
        """(cache, output ids, [prefill + first token s, then each step's s])."""
        cache = cache or OscarCache(model, compile_decode=False)
        timer = StepTimer()
        harness.sync()
        began = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, prefill_chunk_size=chunk,
                             stopping_criteria=StoppingCriteriaList([timer]), **{name: cache})
        return cache, out, [timer.times[0] - began] + [b - a for a, b in zip(timer.times, timer.times[1:])]

    for chunk in (args.chunk, None, args.chunk, None):  # the first two calls include Triton's compiles
        cache, _, times = run(chunk, args.steps)
        steps = [t * 1e3 for t in times[1:]]
        print(f"chunk {chunk}: prefill + first token {times[0]:.2f} s; steps ms: "
              f"{' '.join(f'{s:.1f}' for s in steps)} (median {statistics.median(steps):.1f})", flush=True)
        print("   ", backend_state(cache), flush=True)
        del cache
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    for chunk in (args.chunk, None):
        cache, out, _ = run(chunk, 1)
        with profile(activities=activities) as prof:
            _, _, times = run(None, 6, cache=cache, prompt=out)
            harness.sync()
        print(f"== decode steps after chunk {chunk}: {' '.join(f'{t * 1e3:.1f}' for t in times)} ms")
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
        del cache
    with profile(activities=activities) as prof:
        run(args.chunk, 4)
        harness.sync()
    print(f"== one chunked call, 4 new tokens\n"
          f"{prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60)}")


if __name__ == "__main__":
    main()
