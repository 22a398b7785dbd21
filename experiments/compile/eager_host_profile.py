"""Where the eager decode path's host time goes, per attention call (issue 22's "<= 150 us per attention call").

    python -m experiments.compile.eager_host_profile [--layers 4] [--context 4096] [--calls 400] [--top 35]
        [--no-eager-graphs]

A random Qwen3 with Qwen3-8B's attention shapes (32 query / 8 KV heads, head_dim 128) but `--layers` layers and a
small MLP, an OscarCache filled to `--context` tokens (`bench.harness.fill_oscar`), then eager counted decode
calls: one layer's `cache.update` + `oscar_attention_forward` (+ the demotion its close issues), as
`bench.generate --host-profile` times them; `--no-eager-graphs`: the attention's kernels launched directly every
call instead of replayed from a CUDA graph (`kernels.replay`). Prints the median host microseconds per call (device synchronized
before each), the kernels one call launches (torch.profiler), and cProfile's top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from bench import harness
from bench.harness import QWEN3_8B, fill_oscar, random_qwen3, sync
from oscar_hf import use_oscar_attention
from oscar_hf.attention import oscar_attention_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--no-eager-graphs", action="store_true")
    args = parser.parse_args()
    if args.no_eager_graphs:
        from oscar_hf.kernels.triton.backend import TritonBackend

        harness.OSCAR_BACKEND = TritonBackend(eager_graphs=False)
    options = dict(QWEN3_8B, num_hidden_layers=args.layers, intermediate_size=256, vocab_size=1024, bos_token_id=1,
                   eos_token_id=2)
    model = random_qwen3(options, harness.DEVICE)
    use_oscar_attention(model)
    cfg = model.config
    cache = fill_oscar(model, 1, args.context)
    modules = [layer.self_attn for layer in model.model.layers]
    q = torch.randn(1, cfg.num_attention_heads, 1, cfg.head_dim, device=harness.DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, cfg.num_key_value_heads, 1, cfg.head_dim, device=harness.DEVICE, dtype=torch.bfloat16)

    def call(i):
        keys, values = cache.update(k, k, i)
        oscar_attention_forward(modules[i], q, keys, values, None, scaling=modules[i].scaling)

    for step in range(3):  # counted decode starts, kernels compile
        for i in range(args.layers):
            call(i)
    sync()
    times = []
    for n in range(args.calls):
        sync()
        t0 = time.perf_counter()
        call(n % args.layers)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"host us per attention call: median {1e6 * times[len(times) // 2]:.0f}, "
          f"p10 {1e6 * times[len(times) // 10]:.0f}, p90 {1e6 * times[9 * len(times) // 10]:.0f}")

    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for n in range(8 * args.layers):
            call(n % args.layers)
        sync()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0) + 1
    calls = 8 * args.layers
    print(f"kernels per call: {sum(kernels.values()) / calls:.1f}")
    for name, count in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"  {count / calls:5.2f}  {name[:110]}")

    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    for n in range(args.calls):
        call(n % args.layers)
    profiler.disable()
    sync()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
