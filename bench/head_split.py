"""Decode attention of one layer whose history is split by KV heads (`OscarConfig.high_precision_heads`) against the
same layer stored uniformly, on the GPU.

    python -m bench.head_split --out head_split.json [--contexts 100000] [--batches 8]

Shape: Qwen3-8B's layer (32 query / 8 KV heads, head_dim 128), bf16, Hadamard rotations, oscar-next's row format
(sigma rows, one-byte scale and zero; 4-bit runs: min-max, unclipped, float16 pairs), against the default format (min-max rows,
float16 pairs). The cache is filled with random K/V through its own update and demotion path
(`bench.harness.fill_oscar`), then counted decode starts and the layer's decode attention
(`segment.backend.decode_attention`, what a step runs) is captured in a CUDA graph and timed by
`triton.testing.do_bench` (median, L2 flushed). "target ms" is the issue's bandwidth bound: 1.15 x the default
layer's time x (the layer's history bytes / the default layer's). "CUDA runs" counts the runs of KV heads whose
history the CUDA history kernel read in one eager call (the others went through Triton).
"""

from __future__ import annotations

import argparse
import datetime
import json
from unittest import mock

import torch
import transformers
from triton.testing import do_bench

from bench import harness
from bench.harness import graphed
from oscar_hf import OscarCache
from oscar_hf.kernels.cuda import history as cuda_history
from oscar_hf.kernels.triton.backend import TritonBackend
from oscar_hf.rotations.rotations import Rotations

FORMAT = dict(scale_dtype="compact", encoder="sigma", key_clip_ratio=None, value_clip_ratio=None)
# (label, high-precision KV heads of the layer, or "all" for a 4-bit layer, row format); the first is the base
VARIANTS = (("2-bit, min-max rows, float16 pairs (the default)", (), {}), ("2-bit", (), FORMAT),
            ("2-bit, keys smoothed (a key and a query matrix per KV head)", (), {**FORMAT, "smoothed": True}),
            ("1 head 4-bit (runs 0-2 | 3 | 4-7)", (3,), FORMAT), ("2 heads 4-bit (runs 0-1 | 2-7)", (0, 1), FORMAT),
            ("4-bit", "all", FORMAT))


def layer_config():
    return transformers.Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    num_hidden_layers=1, intermediate_size=128, vocab_size=128)


def time_variant(heads, row_format: dict, batch: int, context: int, split_waves: int | None = None) -> dict:
    config = layer_config()
    options = dict(row_format)
    rotations = "hadamard"
    if options.pop("smoothed", False):  # random scales: the cost of per-head matrices, not a quality point
        scales = 4.0 ** (2 * torch.rand(config.num_key_value_heads, config.head_dim) - 1)
        rotations = Rotations.hadamard([0], config.head_dim).with_key_smoothing({0: scales}, "random, for a benchmark")
        options["method"] = "hadamard"
    if heads == "all":
        options["high_precision_layers"] = (0,)
    elif heads:
        options["high_precision_heads"] = tuple((0, h) for h in heads)
    backend = TritonBackend(split_waves=split_waves) if split_waves else None
    cache = OscarCache(config, rotations=rotations, backend=backend, **options)

    harness.fill_layers(cache, batch, config.num_key_value_heads, config.head_dim, context)
    layer = cache.layers[0]
    layer.start_counted_decode()
    segment = layer.open_segment()
    query = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)

    def call():
        segment.backend.decode_attention(segment.decode_call(query, layer.keys_buffer, layer.values_buffer,
                                                             128 ** -0.5))

    with (mock.patch.object(cuda_history, "history_partials", wraps=cuda_history.history_partials) as per_run,
          mock.patch.object(cuda_history, "history_runs_partials", wraps=cuda_history.history_runs_partials) as all_runs):
        call()
    ms = do_bench(graphed(call), warmup=25, rep=200)
    cuda_runs = per_run.call_count + sum(len(c.args[1]) for c in all_runs.call_args_list)
    return dict(history_bytes=layer.history.nbytes(), ms=ms, history_tokens=layer.history_length,
                cuda_runs=cuda_runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="100000")
    p.add_argument("--batches", default="8")
    p.add_argument("--out", default=None)
    p.add_argument("--split-waves", type=lambda text: [int(x) for x in text.split(",")], default=[],
                   help="also time the split layers with TritonBackend(split_waves=...) for each of these")
    args = p.parse_args()
    rows = []
    print("| context / batch | layer | history MB | CUDA runs | ms | target ms | within |", flush=True)
    print("|---|---|---:|---:|---:|---:|---|", flush=True)
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            base = None
            variants = [(label, heads, row_format, None) for label, heads, row_format in VARIANTS]
            variants += [(f"{label}, split_waves={waves}", heads, row_format, waves) for waves in args.split_waves
                         for label, heads, row_format in VARIANTS if heads and heads != "all"]
            for label, heads, row_format, waves in variants:
                row = dict(context=context, batch=batch, layer=label,
                           **time_variant(heads, row_format, batch, context, waves))
                base = base or row
                row["target_ms"] = 1.15 * base["ms"] * row["history_bytes"] / base["history_bytes"]
                rows.append(row)
                print(f"| {context} / {batch} | {label} | {row['history_bytes'] / 1e6:.1f} | {row['cuda_runs']} | "
                      f"{row['ms']:.3f} | "
                      f"{row['target_ms']:.3f} | {'yes' if row['ms'] <= row['target_ms'] else 'no'} |", flush=True)
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                           device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
