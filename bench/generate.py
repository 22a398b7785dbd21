"""`generate` decode speed and memory of a random-weight Qwen3-8B: OscarCache vs DynamicCache (vs HF QuantizedCache).

    python bench/generate.py --out bench/results/generate.json [--contexts 32768,100000] [--batches 1,8]

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

`graphs` (in `--caches`) is OscarCache decoded by `oscar_hf.graph_decode.graphed_generate`: greedy steps replayed
from CUDA graphs (one per demotion phase); step ms = the replays' synchronized wall time / their count (40 steps
after the eager steps up to a cycle start, the warm-up cycle and the captures, none of which are timed).

`--host-profile` also times the Python side of the cache + attention per decode step (no model), for OscarCache
(Triton) and DynamicCache + SDPA, in microseconds per step over all layers.

HF QuantizedCache (quanto, 2-bit) is included when optimum-quanto is installed (`--quanto`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from oscar_hf import OscarCache, use_oscar_attention  # noqa: E402
from oscar_hf.compat import cache_argument_name  # noqa: E402
from oscar_hf.parallel import tensor_parallel_position  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, attention_bias=False,
                bos_token_id=151643, eos_token_id=151645)
GB = 1e9
DEVICE = "cuda"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak():
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def _allocated():
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def _empty_cache():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def build_model(smoke=False):
    options = dict(QWEN3_8B)
    if smoke:  # a tiny model on CPU, to check the script runs
        options.update(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return random_qwen3(options, DEVICE)


def random_qwen3(options: dict, device, dtype=torch.bfloat16, seed: int = 0):
    """A Qwen3ForCausalLM of `Qwen3Config(**options)` with random weights, built directly on `device` in `dtype`."""
    config = Qwen3Config(**options)
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly (no float32 copy of 8B weights)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.pad_token_id = config.eos_token_id
    return model


def fill_oscar(model, batch, context, chunk=8192):
    cache = OscarCache(model, rotations="hadamard")
    cfg = model.config
    heads = cfg.num_key_value_heads // tensor_parallel_position(model)[1]  # this rank's KV heads under TP
    shape = (batch, heads, chunk, cfg.head_dim)
    k = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    for layer in cache.layers:
        done = 0
        while done < context:
            n = min(chunk, context - done)
            layer.update(k[:, :, :n], v[:, :, :n])
            if done == 0:  # one exact allocation, as a one-shot prefill makes; room for the timed steps' demotions
                layer.history._reserve(context + 64)
            layer.settle(None)
            done += n
    return cache


def _fill_every_layer(cache, model, batch, context):
    """One `update` of `context` random BF16 tokens per layer (a one-shot prefill's K/V); returns `cache`."""
    cfg = model.config
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, device=DEVICE, dtype=torch.bfloat16),
                     torch.randn(shape, device=DEVICE, dtype=torch.bfloat16), i)
    return cache


def fill_dynamic(model, batch, context):
    return _fill_every_layer(DynamicCache(), model, batch, context)


def fill_quanto(model, batch, context):
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=model.config, nbits=2, q_group_size=64, residual_length=128)
    return _fill_every_layer(cache, model, batch, context)


FILLERS = {"oscar": fill_oscar, "graphs": fill_oscar, "dynamic": fill_dynamic, "quanto": fill_quanto}


def set_attention(model, kind):
    if kind in ("oscar", "graphs"):
        use_oscar_attention(model)
    else:
        model.set_attn_implementation("sdpa")


class StepTimer:
    """A stopping criterion that never stops generation and records when each decode step finished (after a
    device synchronization; `generate` synchronizes every step anyway for its own stopping check)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        _sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def decode_step(model, cache, batch, context, warmup=6, steps=16):
    """(median ms per decode step, peak bytes) over `steps` timed steps of one `generate` call that continues
    `cache`, after a `warmup`-token call (kernel compilation, allocator growth)."""
    from transformers import StoppingCriteriaList

    name = cache_argument_name(model)
    _reset_peak()
    result = None
    for n, timed in ((warmup, False), (steps + 1, True)):
        start_len = cache.get_seq_length()
        ids = torch.randint(10, 1000, (batch, start_len + 1), device=DEVICE)
        timer = StepTimer()
        _sync()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, stopping_criteria=StoppingCriteriaList([timer]), **{name: cache})
        if timed:
            deltas = sorted(b - a for a, b in zip(timer.times, timer.times[1:]))
            result = (1e3 * deltas[len(deltas) // 2], 1e3 * sum(deltas) / len(deltas))
        del ids
    return result, _peak()


def graph_decode_step(model, cache, batch, context, steps=40):
    """(ms per replayed decode step, same) and peak bytes for `graphed_generate` continuing `cache`."""
    from oscar_hf.graph_decode import graphed_generate

    _reset_peak()
    period = cache.layers[0].config.demote_block
    ids = torch.randint(10, 1000, (batch, cache.get_seq_length() + 1), device=DEVICE)
    stats = {}
    graphed_generate(model, ids, cache, max_new_tokens=1 + 2 * period + steps, stats=stats,
                     use_graphs=DEVICE == "cuda")
    ms = 1e3 * stats["graph_seconds"] / stats["graph_steps"] if stats["graph_steps"] else math.nan
    return (ms, ms), _peak()


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


def measure(model, kind, batch, context):
    set_attention(model, kind)
    _empty_cache()
    base = _allocated()
    t0 = time.perf_counter()
    cache = FILLERS[kind](model, batch, context)
    _sync()
    fill_s = time.perf_counter() - t0
    held = _allocated() - base
    timing = graph_decode_step if kind == "graphs" else decode_step
    (step_ms, mean_ms), peak = timing(model, cache, batch, context)
    row = dict(cache=kind, context=context, batch=batch, step_ms=step_ms, mean_step_ms=mean_ms,
               tokens_per_s=batch / step_ms * 1e3, peak_GB=peak / GB, cache_GB=held / GB, fill_s=fill_s)
    del cache
    _empty_cache()
    return row


def safe_measure(model, kind, batch, context):
    try:
        return measure(model, kind, batch, context)
    except torch.OutOfMemoryError:
        _empty_cache()
        return dict(cache=kind, context=context, batch=batch, error="OOM")
    except Exception as exc:
        _empty_cache()
        return dict(cache=kind, context=context, batch=batch, error=f"{type(exc).__name__}: {exc}"[:300])


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


def host_profile(model, steps=50, context=4096, batch=1):
    """Python-side microseconds per decode step in cache.update + attention + settle, all layers (GPU work is
    queued, not waited for)."""
    from oscar_hf.attention import oscar_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg = model.config
    out = {}
    for kind in ("oscar", "dynamic"):
        set_attention(model, kind)
        cache = FILLERS[kind](model, batch, context)
        modules = [layer.self_attn for layer in model.model.layers]
        q = torch.randn(batch, cfg.num_attention_heads, 1, cfg.head_dim, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(batch, cfg.num_key_value_heads, 1, cfg.head_dim, device=DEVICE, dtype=torch.bfloat16)
        name = "kwargs"
        _sync()
        elapsed = []
        for step in range(steps + 5):
            t0 = time.perf_counter()
            for i, module in enumerate(modules):
                kwargs = {}
                keys, values = cache.update(k, k, i, **({name: kwargs} if kind == "oscar" else {}))
                if kind == "oscar":
                    oscar_attention_forward(module, q, keys, values, None, scaling=module.scaling, **kwargs)
                else:
                    sdpa_attention_forward(module, q, keys, values, None, scaling=module.scaling)
            elapsed.append(time.perf_counter() - t0)
            _sync()
        out[kind] = 1e6 * sorted(elapsed[5:])[len(elapsed[5:]) // 2]
        del cache
        _empty_cache()
    return out


def table(rows):
    lines = ["| cache | ctx | bs | step ms (median) | step ms (mean) | tokens/s | peak GB | cache GB "
             "| DynamicCache step / this step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dyn = {(r["context"], r["batch"]): r["step_ms"] for r in rows if r["cache"] == "dynamic" and "error" not in r}
    for r in rows:
        tag = " (max batch)" if r.get("max_batch_at_budget") else ""
        if "error" in r:
            lines.append(f"| {r['cache']}{tag} | {r['context']} | {r['batch']} | {r['error']} | | | | | |")
            continue
        ref = dyn.get((r["context"], r["batch"]))
        ratio = f"{ref / r['step_ms']:.2f}x" if ref else ""
        lines.append(f"| {r['cache']}{tag} | {r['context']} | {r['batch']} | {r['step_ms']:.1f} | "
                     f"{r.get('mean_step_ms', math.nan):.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['peak_GB']:.1f} | {r['cache_GB']:.2f} | {ratio} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--contexts", default="32768,100000")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--oscar-batches", default="1,8,32", help="batches for OscarCache (oscar and graphs)")
    parser.add_argument("--caches", default="oscar,graphs,dynamic")
    parser.add_argument("--budget-gb", type=float, default=140.0)
    parser.add_argument("--max-batch", action="store_true")
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script, times nothing)")
    parser.add_argument("--launch-config", default=None, help="stage-1 LaunchConfig as JSON (bench/attention.py "
                        "--launch-out writes the one it measured best)")
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    if args.launch_config and os.path.exists(args.launch_config):
        import oscar_hf.kernels.reference.backend
        from oscar_hf.kernels.triton.launch_plan import LaunchConfig
        from oscar_hf.kernels.triton.backend import TritonBackend

        with open(args.launch_config) as f:
            launch = LaunchConfig(**json.load(f))
        oscar_hf.backend._BACKENDS["triton:4096"] = TritonBackend(launch=launch)
        print(f"launch config: {launch}", flush=True)
    model = build_model(args.smoke)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"device {name}, weights {_allocated() / GB:.1f} GB", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    kinds = args.caches.split(",")
    rows = []
    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=name,
                  torch=torch.__version__, rows=rows)
    if args.host_profile:
        result["host_us_per_step"] = host_profile(model)
        print("host us/step (cache + attention, 36 layers):", result["host_us_per_step"], flush=True)
    for kind in kinds:
        batches = args.oscar_batches if kind in ("oscar", "graphs") else args.batches
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
