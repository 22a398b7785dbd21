"""The guards of a compiled decode step, OscarCache vs StaticCache, on CPU.

    TORCH_LOGS=guards python -m experiments.compile.guard_cost [--layers 36] 2>&1 | grep -c TENSOR_MATCH

A tiny Qwen3 (hidden 128, head_dim 64) with many layers; the forward is compiled (fullgraph, default mode), the
cache prefilled eagerly, then compiled single-token steps are timed (CPU: the step times compare nothing but the
graphs' CPU code; the guard logs are the point).
"""
import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, StaticCache

from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name


def build(layers):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=65536)
    return Qwen3ForCausalLM(cfg).eval()


@torch.no_grad()
def measure(model, kind, steps=20, prompt=400):
    torch._dynamo.reset()
    name = cache_argument_name(model)
    if kind == "oscar":
        cache = OscarCache(model, method="hadamard", sink_tokens=4, recent_tokens=64, demote_block=8)
    else:
        cache = StaticCache(config=model.config, max_cache_len=prompt + steps + 40)
    ids = torch.randint(1, 200, (1, prompt))
    model(input_ids=ids, **{name: cache}, cache_position=torch.arange(prompt))
    compiled = torch.compile(model.forward, fullgraph=True)
    token = ids[:, -1:]

    def step(t):
        pos = torch.tensor([t])
        return compiled(input_ids=token, **{name: cache}, cache_position=pos, position_ids=pos[None])

    for t in range(prompt, prompt + 3):
        step(t)
    start = time.perf_counter()
    for t in range(prompt + 3, prompt + 3 + steps):
        step(t)
    return (time.perf_counter() - start) / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=36)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build(args.layers)
    print("| cache | layers | step ms (CPU) |")
    print("|---|---:|---:|")
    for kind in ("static", "oscar"):
        print(f"| {kind} | {args.layers} | {measure(model, kind) * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
