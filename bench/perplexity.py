"""Perplexity and next-token KL vs BF16 through KV caches (default: OscarCache presets on SmolLM2-135M), as a
markdown table.

    python -m bench.perplexity [--model smollm2] [--text lear_gut.txt] [--tokens 2048] [--prefill 512] [--chunk 64]
                               [--methods none,hadamard,quarot,clip,identity] [--rotations FOLDER]

Methods are named as in every oscar-hf command line (`oscar_hf.eval.diagnostics.methods`: the `OscarConfig` presets,
`hadamard4`, `oscar4`, the peer caches); `oscar`, `oscar4`, `oscar-hifi` and `oscar-next` need `--rotations`. The
BF16 reference (`DynamicCache`) is always the first row. Every scored token is predicted by a chunked forward that
attends to the quantized history of all tokens before its chunk (see `oscar_hf.eval.perplexity`).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache
from transformers.utils import logging

from oscar_hf import OscarCache
from oscar_hf.eval.assets import load_model, play_tokens
from oscar_hf.eval.cli_options import (
    add_logging_argument,
    add_model_arguments,
    add_oscar_options_argument,
    add_progress_argument,
    configure_logging,
    resolve_device,
    resolve_dtype,
    timed,
)
from oscar_hf.eval.diagnostics.methods import ROTATION_METHODS, select_methods
from oscar_hf.eval.perplexity import compare_caches

logger = logging.get_logger(__name__)
REFERENCE = "bf16"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.perplexity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, default_model="smollm2")
    p.add_argument("--text", "--play", dest="text", default="lear_gut.txt",
                   help="held-out play (oscar_hf.assets.EVALUATION_PLAYS)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--methods", nargs="+", default=["none,hadamard,quarot,clip,identity"],
                   help="method names, comma- or space-separated (default: none,hadamard,quarot,clip,identity)")
    p.add_argument("--rotations", default=None,
                   help=f"rotations for {', '.join(ROTATION_METHODS)} (oscar-mixed, oscar-hifi and oscar-next "
                        "need a retrieval ranking)")
    p.add_argument("--encoder", default="minmax", help="OscarConfig.encoder of every OSCAR method")
    p.add_argument("--compile", action="store_true",
                   help="score the OSCAR caches through torch.compile(model.forward, fullgraph=True) (with --chunk 1: "
                        "compiled decode steps, demotions included)")
    add_oscar_options_argument(p)
    add_progress_argument(p)
    add_logging_argument(p)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    configure_logging(args.verbosity)
    options = dict(args.oscar_options) if args.encoder == "minmax" else {**args.oscar_options, "encoder": args.encoder}
    try:
        methods = [m for m in select_methods(args.methods, args.rotations, **options) if m.name != REFERENCE]
    except ValueError as error:
        raise SystemExit(str(error)) from error

    with timed(f"loading {args.model}", logger):
        model, tokenizer = load_model(args.model, resolve_dtype(args.dtype), resolve_device(args.device))
    ids = play_tokens(tokenizer, args.text, args.tokens)
    caches: dict[str, object] = {}

    def factory(method):
        def make():
            caches[method.name] = method.build(model)
            return caches[method.name]
        return make

    makers = {REFERENCE: lambda: DynamicCache(config=model.config)}
    makers.update({m.name: factory(m) for m in methods})
    start = time.perf_counter()
    forwards = {}
    if args.compile:
        compiled = torch.compile(model.forward, fullgraph=True)
        forwards = {m.name: compiled for m in methods if m.oscar}
    results = compare_caches(model, ids, makers, prefill=args.prefill, chunk=args.chunk,
                             progress=not args.no_progress, forwards=forwards)
    seconds = time.perf_counter() - start

    dense = results[REFERENCE].perplexity
    print(f"\n{args.model} ({args.dtype}), {args.text}, {args.tokens} tokens, prefill {args.prefill}, "
          f"chunks of {args.chunk}{', OSCAR compiled' if args.compile else ''}, {results[REFERENCE].tokens} scored "
          f"tokens, {seconds:.0f} s\n")
    print("| method | perplexity | vs BF16 | next-token KL vs BF16 | top-1 agreement | history bits/element |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        cache = caches.get(name)
        if cache is None:
            bits = f"{8 * model.dtype.itemsize} (DynamicCache)"
        else:
            bits = f"{history_bits(cache):.2f}" if isinstance(cache, OscarCache) else "n/a"
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
