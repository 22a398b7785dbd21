"""Where a chunked-prefill `generate` with an OscarCache spends its time: torch.profiler over one call (random-weight
Qwen3-8B), CUDA kernels by total time and host ops by self time. Per-step times of the decode after a chunked
prefill: `experiments.prefill.decode_after_chunks`.

    python -m experiments.prefill.profile_chunked [--context 16384] [--batch 2] [--chunk 4096] [--new-tokens 4]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench import harness
from bench.harness import build_model, set_attention
from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        harness.DEVICE = "cpu"
    model = build_model(smoke=args.smoke)
    set_attention(model, "oscar")
    ids = torch.randint(10, 1000, (args.batch, args.context), device=harness.DEVICE)

    def call(chunk=args.chunk, new_tokens=args.new_tokens):
        cache = OscarCache(model, compile_decode=False)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=chunk,
                       **{cache_argument_name(model): cache})
        return cache

    call()  # Triton's compiles
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        cache = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    layer = cache.layers[0]
    history = layer.history_length  # first: under counted decode, reading it brings the host's counts up to date
    print(f"layer 0 after the profiled call: {layer.length} tokens, {history} in the history, "
          f"{layer.bf16_length} in BF16", file=sys.stderr)
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
