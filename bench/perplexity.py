"""Perplexity and next-token KL vs BF16 through OscarCache on SmolLM2-135M (CPU), as a markdown table.

    python -m bench.perplexity [--play lear_gut.txt] [--tokens 2048] [--prefill 512] [--chunk 64]
                               [--methods none hadamard quarot clip identity] [--rotations FOLDER]

Every scored token is predicted by a chunked forward that attends to the quantized history of all tokens before
its chunk (see `oscar_hf.eval.perplexity`).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.eval.assets import load_smollm2, play_tokens
from oscar_hf.eval.perplexity import compare_caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--play", default="lear_gut.txt")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["none", "hadamard", "quarot", "clip", "identity"])
    parser.add_argument("--rotations", default=None,
                        help="rotations for the methods oscar, oscar-hifi and oscar-next (the last two need a "
                             "retrieval ranking)")
    parser.add_argument("--encoder", default="minmax", help="OscarConfig.encoder of every OSCAR method")
    args = parser.parse_args()

    model, tokenizer = load_smollm2(dtype=torch.float32)
    ids = play_tokens(tokenizer, args.play, args.tokens)
    caches: dict[str, OscarCache] = {}

    def factory(method):
        def make():
            rotations = args.rotations if method in ("oscar", "oscar-hifi", "oscar-next") else None
            options = {} if args.encoder == "minmax" else {"encoder": args.encoder}
            caches[method] = OscarCache(model, rotations=rotations, method=method, **options)
            return caches[method]
        return make

    makers = {"dense": lambda: DynamicCache(config=model.config)}
    makers.update({method: factory(method) for method in args.methods})
    start = time.perf_counter()
    results = compare_caches(model, ids, makers, prefill=args.prefill, chunk=args.chunk)
    seconds = time.perf_counter() - start

    dense = results["dense"].perplexity
    print(f"\nSmolLM2-135M-Instruct (float32), {args.play}, {args.tokens} tokens, prefill {args.prefill}, "
          f"chunks of {args.chunk}, {results['dense'].tokens} scored tokens, {seconds:.0f} s\n")
    print("| method | perplexity | vs dense | next-token KL vs dense | top-1 agreement | history bits/element |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        cache = caches.get(name)
        bits = "32 (DynamicCache)" if cache is None else f"{history_bits(cache):.2f}"
        print(f"| {name} | {r.perplexity:.3f} | {100 * (r.perplexity / dense - 1):+.1f}% | {max(r.kl, 0.0):.4f} | "
              f"{r.top1_agreement:.3f} | {bits} |")


def history_bits(cache: OscarCache) -> float:
    """Stored bits per element of the history tier alone (codes + scale/zero), averaged over layers."""
    stored = elements = 0
    for layer in cache.layers:
        history = getattr(layer, "history", None)
        if history is None or not history.length:
            continue
        stored += 8 * history.nbytes()
        elements += history.length * history.batch * history.num_heads * (history.key_dim + history.value_dim)
    return stored / elements if elements else float("nan")


if __name__ == "__main__":
    main()
