"""Decode step and memory of the architectures users move to, random weights in bf16, prompts through `generate`:

    python -m bench.architectures --models qwen3_5,gpt_oss --rows 32768x1,32768x8,100000x8 --caches oscar,dynamic

- `qwen3_5`: Qwen3.5's text model at transformers' default config (32 layers, hidden 4096; gated-delta-rule linear
  attention in 3 of every 4 layers, full attention with 4 KV heads of 256 in the fourth), positions to 262,144;
- `qwen3_next`: Qwen3-Next-80B-A3B's layout (48 layers, the same 3:1 mix, 2 KV heads of 256, 512 experts);
- `gpt_oss`: gpt-oss-20b's shape (24 layers, 64 query and 8 KV heads of 64, learned sinks, sliding windows of 128
  in every other layer, 32 experts, bf16 instead of MXFP4).

Each row prefills `context` random tokens per sequence through `generate` in chunks of `--prefill-chunk` (8,192;
the linear layers' states and the attention layers' K/V, as a job fills them; gpt-oss's eager attention holds a
chunk's float32 scores for every head, 16 GiB at 8,192 tokens against 32k, which an 80 GB card cannot spare), then times 16 decode steps of a second `generate` call
after a 6-token warm-up (`harness.decode_step`: median ms per step). Caches (`--caches`): `oscar`
(`OscarCache(model, compile_decode=True)`, the data-free default: `generate` compiles its step where every layer of
the model's plan allows it), `dynamic` (`DynamicCache(config=...)`, eager, SDPA), `static` (`StaticCache`, which
`generate` compiles). Cache GB: what the filled cache holds; peak GB: the most allocated over the weights.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from bench import harness
from bench.harness import GB, allocated, decode_step, empty_cache, fill_by_prefill, peak, random_model, reset_peak, sync
from oscar_hf import OscarCache

SHAPES = {
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(max_position_embeddings=262144),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(max_position_embeddings=262144),
    "gpt_oss": lambda: transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32,
                                                 layer_types=["sliding_attention", "full_attention"] * 12),
}


SMOKE = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, num_local_experts=4, num_experts=4,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=4096)


def cache_gb(cache) -> float:
    """GB of tensors the cache's layers hold (OscarCache: allocated capacity; recurrent states included)."""
    seen, total = set(), 0
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        history = getattr(layer, "history", None)
        if history is not None:
            total += history.allocated_nbytes()
    return total / GB


def new_cache(kind: str, model, context: int):
    if kind == "oscar":
        return OscarCache(model, compile_decode=True)
    model.set_attn_implementation("eager" if model.config.model_type == "gpt_oss" else "sdpa")
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=context + 64)


def row(model, name: str, kind: str, context: int, batch: int, chunk: int) -> dict:
    torch._dynamo.reset()
    empty_cache()
    base = allocated()
    reset_peak()
    began = time.perf_counter()
    cache = new_cache(kind, model, context)
    fill_by_prefill(model, cache, batch, context, chunk)
    sync()
    prefill_s = time.perf_counter() - began
    held = cache_gb(cache)
    (step_ms, _), peak_bytes, first_s, _ = decode_step(model, cache, batch, context)
    result = dict(model=name, cache=kind, context=context, batch=batch, step_ms=step_ms, cache_GB=held,
                  peak_GB=(max(peak_bytes, 0) - base) / GB, prefill_s=prefill_s, first_call_s=first_s)
    del cache
    empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3_5,gpt_oss")
    parser.add_argument("--rows", default="32768x1,32768x8,100000x8", help="context x batch, comma-separated")
    parser.add_argument("--caches", default="oscar,dynamic")
    parser.add_argument("--prefill-chunk", type=int, default=harness.PREFILL_CHUNK,
                        help="tokens per prefill chunk (generate's prefill_chunk_size)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (checks the script only)")
    args = parser.parse_args()
    harness.DEVICE = "cpu" if args.smoke else "cuda"
    rows = [tuple(int(x) for x in r.split("x")) for r in args.rows.split(",")]
    device = "CPU" if args.smoke else torch.cuda.get_device_name()
    print(f"# {datetime.date.today()} {device} torch {torch.__version__} "
          f"transformers {transformers.__version__}", flush=True)
    print("| model | cache | context / batch | step ms | cache GB | peak GB over weights | prefill s | first call s |")
    print("|---|---|---|---:|---:|---:|---:|---:|", flush=True)
    for name in args.models.split(","):
        config = SHAPES[name]()
        if args.smoke:
            config = config.__class__(**SMOKE, **({"layer_types": config.layer_types[:4]} if name != "qwen3_5" else {}))
        model = random_model(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config, harness.DEVICE)
        model.generation_config.pad_token_id = 0
        for context, batch in rows:
            for kind in args.caches.split(","):
                try:
                    r = row(model, name, kind, context, batch, args.prefill_chunk)
                    print(f"| {name} | {kind} | {context // 1024}k / {batch} | {r['step_ms']:.2f} | "
                          f"{r['cache_GB']:.2f} | {r['peak_GB']:.1f} | {r['prefill_s']:.1f} | "
                          f"{r['first_call_s']:.1f} |", flush=True)
                except Exception as error:  # out of memory, or a path the model does not take
                    empty_cache()
                    print(f"| {name} | {kind} | {context // 1024}k / {batch} | {type(error).__name__}: "
                          f"{str(error).splitlines()[0][:90]} | | | | |", flush=True)
        del model
        empty_cache()


if __name__ == "__main__":
    main()
