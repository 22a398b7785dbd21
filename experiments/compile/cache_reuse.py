"""Does a second process reuse the first one's compiled decode step? (issue 45: compile once per machine)

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python -m experiments.compile.cache_reuse [--cache oscar|static] [--device cpu]
    (run it twice with the same TORCHINDUCTOR_CACHE_DIR: the second run is the "later process")

A random-weight model (Qwen3-8B's family; the tiny shape of `bench.harness.build_model(smoke=True)` on the CPU, where
`generate` is told to compile), a prompt, and one `generate` call that compiles its decode step. Prints the call's
seconds, the compile stages' seconds (`torch._dynamo.utils.compile_times`) and torch's on-disk cache counters:
inductor's FX-graph cache and AOTAutograd's cache, hits, misses and bypasses (a bypass names a graph torch would
not cache, and then every process compiles it again).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import StaticCache

from bench import harness
from bench.harness import build_model, set_attention, sync
from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name, compile_config_anywhere


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default="oscar", choices=["oscar", "static"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args()
    harness.DEVICE = args.device
    model = build_model(smoke=args.device == "cpu")
    set_attention(model, args.cache)
    ids = torch.randint(10, 1000, (1, args.context), device=args.device)
    config = compile_config_anywhere(fullgraph=True)
    cache = (OscarCache(model, method="hadamard", compile_decode=True) if args.cache == "oscar"
             else StaticCache(config=model.config, max_cache_len=args.context + args.new_tokens))
    sync()
    began = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                   min_new_tokens=args.new_tokens, do_sample=False, compile_config=config,
                   **{cache_argument_name(model): cache})
    sync()
    print(f"{args.cache}: first generate call {time.perf_counter() - began:.1f} s")
    counters = torch._dynamo.utils.counters
    for group in ("inductor", "aot_autograd"):
        wanted = {k: v for k, v in counters[group].items() if "cache" in k or "bypass" in k}
        print(group, dict(sorted(wanted.items())))
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
