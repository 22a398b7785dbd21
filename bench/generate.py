"""`generate` decode speed and memory of a random-weight Qwen3-8B: OscarCache vs DynamicCache (vs HF QuantizedCache).

    python -m bench.generate --out generate.json [--contexts 32768,100000] [--batches 1,8]

The model is built from Qwen3-8B's public config (no download) with random bf16 weights. Each cache is filled with
random K/V for `context` tokens (OscarCache through its own update + demotion path, i.e. the demotion kernel; no
prefill forward), then `model.generate` continues from it with greedy decoding: a 6-token warm-up call, then
a call whose 16 decode steps are timed one by one (a stopping criterion that synchronizes and stamps the time
after each step; `generate` synchronizes every step anyway); step ms = the median; tokens/s = batch / step time.
Peak GB = `torch.cuda.max_memory_allocated` during the decode calls (weights included); cache GB = memory the
filled cache holds (OscarCache: allocated capacity, including spare room).

"Max batch at budget": the largest batch whose predicted peak (weights + activations + per-sequence cache, from
the measured points) fits `--budget-gb`, then measured at that batch (stepping down on out-of-memory); job
throughput = batch / step time at that batch.

Kinds (`--caches`): `oscar` (greedy, uniform 2-bit rows: `method="hadamard"`), `oscar-default` (greedy, what
`OscarCache(model)` stores: `oscar-next` on the model's data-free profile), `oscar-topp` (top-p sampling), `oscar-eager` (greedy, `disable_compile`),
`oscar-noguards` (an experiment: the compiled step without dynamo's guards), `oscar-compact` (oscar-next's row
format), `dynamic`, `static` (StaticCache, compiled by `generate`), `quanto`, and `oscar-prefill` / `dynamic-prefill`
(the prompt goes through `generate` in chunks of 8,192 instead of `update()`: their peak includes the prefill's, as
a job's sequences need it, so `--max-batch` gives the sequences per GPU of a job that serves real prompts).
Today's numbers, with their commands, dates and GPUs: `docs/performance.md`.

`--host-profile` also times the eager decode path's host side (`host_profile`): microseconds per attention call
(cache update + attention) and a whole eager forward's host and wall time, OscarCache against DynamicCache + SDPA.

HF QuantizedCache (quanto, 2-bit) is measured with `quanto` in `--caches` (needs optimum-quanto).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import torch

from bench import harness
from bench.harness import FILLERS, GB, allocated, build_model, empty_cache, safe_measure, set_attention, sync
from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name


def cache_bytes(cache) -> int:
    if isinstance(cache, OscarCache):
        return sum(layer.allocated_nbytes() for layer in cache.layers)
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def max_batch(model, kind, context, rows, budget):
    """Largest batch predicted to fit, measured, stepping down on OOM."""
    points = sorted((r["batch"], r["peak_GB"]) for r in rows
                    if r["cache"] == kind and r["context"] == context and "error" not in r)
    if len(points) < 2:
        return None
    (b0, p0), (b1, p1) = points[0], points[-1]
    per_seq = (p1 - p0) / (b1 - b0)
    if per_seq <= 0:
        return None
    fixed = p0 - b0 * per_seq
    batch = int((budget - fixed) / per_seq)
    print(f"{kind} {context}: fixed {fixed:.1f} GB + {per_seq:.2f} GB/seq -> predicted max batch {batch}", flush=True)
    while batch > b1:
        row = safe_measure(model, kind, batch, context)
        if "error" not in row and row["peak_GB"] <= budget:
            row["max_batch_at_budget"] = True
            return row
        outcome = row.get("error") or "peak {:.1f} GB".format(row["peak_GB"])
        print(f"  batch {batch}: {outcome}", flush=True)
        batch = int(batch * 0.9)
    return None


def host_profile(model, steps=24, context=4096, batch=1):
    """Host time of the eager decode path, OscarCache (device-counted steps, what runs without compiling) against
    DynamicCache + SDPA. Returns, per kind:
    - `us_per_attention_call`: one layer's `cache.update` + attention (+ the demotion its close issues), from the
      call to its return, with the device synchronized before it (so neither earlier GPU work nor a full launch
      queue is counted); the median over layers and steps;
    - `step_host_ms` / `step_wall_ms`: a whole eager forward of one token (the model's own code included), until it
      returns and until the device is done, medians over steps."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oscar_hf.attention import oscar_attention_forward

    cfg, device = model.config, harness.DEVICE
    name = cache_argument_name(model)
    out = {}
    for kind in ("oscar", "dynamic"):
        set_attention(model, kind)
        cache = FILLERS[kind](model, batch, context)
        modules = [layer.self_attn for layer in model.model.layers]
        q = torch.randn(batch, cfg.num_attention_heads, 1, cfg.head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, cfg.num_key_value_heads, 1, cfg.head_dim, device=device, dtype=torch.bfloat16)
        calls = []
        for step in range(steps + 3):  # the first steps start counted decode and compile its kernels
            for i, module in enumerate(modules):
                sync()
                t0 = time.perf_counter()
                keys, values = cache.update(k, k, i)
                if kind == "oscar":
                    oscar_attention_forward(module, q, keys, values, None, scaling=module.scaling)
                else:
                    sdpa_attention_forward(module, q, keys, values, None, scaling=module.scaling)
                if step >= 3:
                    calls.append(time.perf_counter() - t0)
        host, wall = [], []
        token = torch.randint(10, 1000, (batch, 1), device=device)
        with torch.no_grad():
            for step in range(steps + 3):
                sync()
                t0 = time.perf_counter()
                model(token, **{name: cache}, use_cache=True, logits_to_keep=1)
                t1 = time.perf_counter()
                sync()
                if step >= 3:
                    host.append(t1 - t0)
                    wall.append(time.perf_counter() - t0)
        out[kind] = dict(us_per_attention_call=1e6 * _median(calls), step_host_ms=1e3 * _median(host),
                         step_wall_ms=1e3 * _median(wall))
        del cache
        empty_cache()
    return out


def _median(values):
    return sorted(values)[len(values) // 2]


def table(rows):
    lines = ["| cache | ctx | bs | step ms (median) | step ms (mean) | tokens/s | peak GB | cache GB "
             "| peak - weights - cache GB | allocations / step | DynamicCache step / this step | first call s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dyn = {(r["context"], r["batch"]): r["step_ms"] for r in rows if r["cache"] == "dynamic" and "error" not in r}
    for r in rows:
        tag = " (max batch)" if r.get("max_batch_at_budget") else ""
        if "error" in r:
            lines.append(f"| {r['cache']}{tag} | {r['context']} | {r['batch']} | {r['error']} | | | | | | | | |")
            continue
        ref = dyn.get((r["context"], r["batch"]))
        ratio = f"{ref / r['step_ms']:.2f}x" if ref else ""
        lines.append(f"| {r['cache']}{tag} | {r['context']} | {r['batch']} | {r['step_ms']:.1f} | "
                     f"{r.get('mean_step_ms', math.nan):.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['peak_GB']:.1f} | {r['cache_GB']:.2f} | "
                     f"{r['peak_GB'] - r.get('weights_GB', math.nan) - r['cache_GB']:.2f} | "
                     f"{r.get('allocations_per_step', math.nan):.1f} | {ratio} | "
                     f"{'' if r.get('first_call_s') is None else format(r['first_call_s'], '.1f')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--contexts", default="32768,100000")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--oscar-batches", default="1,8,32", help="batches for the OscarCache kinds")
    parser.add_argument("--caches", default="oscar,static,dynamic")
    parser.add_argument("--budget-gb", type=float, default=140.0)
    parser.add_argument("--max-batch", action="store_true")
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script, times nothing)")
    parser.add_argument("--launch-config", default=None, help="stage-1 LaunchConfig as JSON (python -m "
                        "bench.attention --launch-out writes the one it measured best)")
    parser.add_argument("--hifi-layers", type=int, default=0,
                        help="keep this many layers (spread evenly) at 4 bits, as oscar-hifi does for its ranked ones")
    parser.add_argument("--hifi-heads", type=int, default=0,
                        help="keep this many KV heads (spread evenly over the layers' heads) at 4 bits, as oscar-next "
                             "does for its ranked ones")
    args = parser.parse_args()
    if args.smoke:
        harness.DEVICE = "cpu"
    if args.launch_config and os.path.exists(args.launch_config):
        from oscar_hf.kernels.triton.backend import TritonBackend
        from oscar_hf.kernels.triton.launch_plan import LaunchConfig

        with open(args.launch_config) as f:
            launch = LaunchConfig(**json.load(f))
        harness.OSCAR_BACKEND = TritonBackend(launch=launch)
        print(f"launch config: {launch}", flush=True)
    model = build_model(args.smoke)
    if args.hifi_layers:
        layers = model.config.num_hidden_layers
        harness.OSCAR_OPTIONS["high_precision_layers"] = tuple(sorted({i * layers // args.hifi_layers
                                                                       for i in range(args.hifi_layers)}))
        print(f"4-bit layers: {harness.OSCAR_OPTIONS['high_precision_layers']}", flush=True)
    if args.hifi_heads:
        layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
        picked = sorted({i * layers * heads // args.hifi_heads for i in range(args.hifi_heads)})
        harness.OSCAR_OPTIONS["high_precision_heads"] = tuple(divmod(p, heads) for p in picked)
        print(f"4-bit KV heads: {harness.OSCAR_OPTIONS['high_precision_heads']}", flush=True)
    name = torch.cuda.get_device_name() if harness.DEVICE == "cuda" else "cpu"
    print(f"device {name}, weights {allocated() / GB:.1f} GB", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    kinds = [kind for kind in args.caches.split(",") if kind]  # "" with --host-profile: the profile alone
    rows = []
    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=name,
                  torch=torch.__version__, rows=rows)
    if args.host_profile:
        result["host_profile"] = host_profile(model)
        print("eager host profile (4k context, batch 1):", json.dumps(result["host_profile"]), flush=True)
    for kind in kinds:
        batches = args.oscar_batches if kind.startswith("oscar") else args.batches
        for context in contexts:
            for batch in [int(b) for b in batches.split(",")]:
                row = safe_measure(model, kind, batch, context)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.max_batch:
        for kind in kinds:
            context = max(contexts)
            row = max_batch(model, kind, context, rows, args.budget_gb)
            if row is not None:
                rows.append(row)
                print(json.dumps(row), flush=True)
        best = {}
        for r in rows:
            if "error" not in r and r["context"] == max(contexts):
                best[r["cache"]] = max(best.get(r["cache"], 0.0), r["tokens_per_s"]) if r["peak_GB"] <= args.budget_gb else best.get(r["cache"], 0.0)
        result["best_tokens_per_s_at_budget"] = best
        if best.get("dynamic"):
            result["throughput_ratio_vs_dynamic"] = {k: v / best["dynamic"] for k, v in best.items()}
        print("job throughput at the budget:", best, flush=True)
    result["table"] = table(rows)
    print(result["table"])
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
