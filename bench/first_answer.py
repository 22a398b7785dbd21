"""A whole `generate` call with a real prefill, as a user's first question meets it: wall time of each call (the
first call of the process includes `generate`'s compile), the peak memory the call adds over the weights, and the
cache it leaves. Random-weight Qwen3-8B (bf16), a random prompt, a new cache for every call.

    python -m bench.first_answer --context 32768 --batch 8 --new-tokens 256 --caches dynamic,oscar [--calls 2]
    python -m bench.first_answer --context 100000 --batch 4 --new-tokens 16 --caches dynamic,oscar --chunk 8192

Kinds: `dynamic` (DynamicCache, eager), `static` (StaticCache, compiled by `generate`), `oscar` (`OscarCache(model)`:
the default a user gets: it decodes eagerly until its eager steps have cost what a compile is expected to,
`oscar_hf.compile_policy`), `oscar-compiled` (`compile_decode=True`: generate compiles from the first call),
`oscar-eager` (`disable_compile=True`). `--chunk N` passes
`prefill_chunk_size=N` to `generate`. Run the script twice on one machine to see a second process's first call:
torch keeps its compiled artifacts on disk (`TORCHINDUCTOR_CACHE_DIR`, by default under /tmp) between processes.
Prints a table and, with `--out`, appends JSON lines.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache

from bench import harness
from bench.generate import cache_bytes
from bench.harness import GB, allocated, build_model, empty_cache, peak, reset_peak, set_attention, sync
from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name, compile_config_anywhere
from oscar_hf.compile_policy import ledger_of


def one_call(model, kind: str, batch: int, context: int, new_tokens: int, chunk: int | None, seed: int,
             compile_config=None, cache_options: dict | None = None) -> dict:
    """One `generate` call with a fresh `kind` cache over a random `[batch, context]` prompt (`compile_config`:
    `generate`'s, when it compiles; `cache_options`: more arguments of an `OscarCache`)."""
    set_attention(model, kind)
    empty_cache()
    base = allocated()
    generator = torch.Generator(device=harness.DEVICE).manual_seed(seed)
    ids = torch.randint(10, 1000, (batch, context), device=harness.DEVICE, generator=generator)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   attention_mask=torch.ones_like(ids))
    if chunk:
        options["prefill_chunk_size"] = chunk
    if kind == "static":
        options["cache_implementation"] = "static"
    else:
        cache = (DynamicCache(config=model.config) if kind == "dynamic" else
                 OscarCache(model, compile_decode=True if kind == "oscar-compiled" else None, **(cache_options or {})))
        options[cache_argument_name(model)] = cache
    if kind == "oscar-eager":
        options["disable_compile"] = True
    elif compile_config is not None:
        options["compile_config"] = compile_config
    reset_peak()
    sync()
    began = time.perf_counter()
    out = model.generate(ids, **options)
    sync()
    seconds = time.perf_counter() - began
    row = dict(cache=kind, context=context, batch=batch, new_tokens=new_tokens, chunk=chunk or 0,
               seconds=seconds, peak_over_weights_GB=(peak() - base) / GB,
               cache_GB=cache_bytes(options[cache_argument_name(model)]) / GB if kind != "static" else float("nan"),
               generated=int(out.shape[1] - context))
    if kind.startswith("oscar"):  # what the compile policy has counted so far, and whether it lets generate compile
        ledger = ledger_of(model)
        row.update(eager_decode_seconds=ledger.eager_seconds, policy_compiles=ledger.compiles)
    del out, options
    empty_cache()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| cache | ctx | bs | new tokens | prefill chunk | call | seconds | peak over weights GB | cache GB | "
             "eager decode s so far (policy) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cache']} | {r['context']} | {r['batch']} | {r['new_tokens']} | {r['chunk']} | "
                         f"{r['call']} | {r['error']} | | | |")
            continue
        lines.append(f"| {r['cache']} | {r['context']} | {r['batch']} | {r['new_tokens']} | {r['chunk'] or '-'} | "
                     f"{r['call']} | {r['seconds']:.1f} | {r['peak_over_weights_GB']:.1f} | {r['cache_GB']:.2f} | "
                     + (f"{r['eager_decode_seconds']:.1f} ({'compiles' if r['policy_compiles'] else 'eager'}) |"
                        if "eager_decode_seconds" in r else "- |"))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--caches", default="dynamic,oscar")
    p.add_argument("--calls", type=int, default=1, help="calls per cache kind in this process (fresh cache each)")
    p.add_argument("--chunk", type=int, default=None, help="generate(prefill_chunk_size=...)")
    p.add_argument("--compile-backend", default=None,
                   help="generate's torch.compile backend instead of its default (inductor, reduce-overhead): e.g. "
                        "cudagraphs (the eager graph replayed from CUDA graphs, no code generation)")
    p.add_argument("--out", default=None, help="append the rows as JSON lines to this file")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script, times nothing)")
    args = p.parse_args()
    if args.smoke:
        harness.DEVICE = "cpu"
    model = build_model(smoke=args.smoke)
    compile_config = None
    if args.compile_backend:
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=True, backend=args.compile_backend, mode=None)
    elif args.smoke:  # generate compiles on the CPU too, where a cache lets it: the policy's choice shows there
        compile_config = compile_config_anywhere(fullgraph=True)
    rows = []
    for kind in args.caches.split(","):
        for call in range(1, args.calls + 1):
            try:
                row = one_call(model, kind, args.batch, args.context, args.new_tokens, args.chunk, seed=call,
                               compile_config=compile_config)
            except torch.OutOfMemoryError:
                empty_cache()
                row = dict(cache=kind, context=args.context, batch=args.batch, new_tokens=args.new_tokens,
                           chunk=args.chunk or 0, error="OOM")
            row["call"] = call
            row["compile_backend"] = args.compile_backend or "default"
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))
    # where a compile's seconds went (dynamo tracing, AOT, inductor, CUDA-graph recording), when one ran
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
