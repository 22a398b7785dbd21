"""Host time of one layer's eager decode step: `update`, `open_segment` and the segment's `close`, no attention.

    python -m bench.host_step [--steps 5000] [--rounds 3]
    PYTHONPATH=.before:. python -m bench.host_step     # the same on an earlier package (bench/gpu_before_after.sh)

What the layer's own Python costs per step, the part a compiled step does not run: one `OscarLayer` (2 KV heads of
64, batch 1, the reference backend, on the CPU) filled with 200 tokens, then single-token steps, counted on the
device after the first close (`counted_decode`) or on the host with `allow_counted_decode=False`. Every eighth
step demotes a block. Prints the median and the mean of the fastest half over `--steps` steps, per round; compare
trees in alternating runs, since a busy machine moves the numbers more than small changes do.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from oscar_hf.config import OscarConfig
from oscar_hf.layer import OscarLayer


def step_times(counted: bool, steps: int) -> list[float]:
    torch.manual_seed(0)
    config = OscarConfig.from_method("hadamard", sink_tokens=4, recent_tokens=32, demote_block=8)
    layer = OscarLayer(0, config, None, None)
    layer.allow_counted_decode = counted
    prompt, token = torch.randn(1, 2, 200, 64), torch.randn(1, 2, 1, 64)
    layer.update(prompt, prompt)
    layer.open_segment().close(None)
    times = []
    for i in range(steps + 50):  # the first steps warm up
        start = time.perf_counter()
        layer.update(token, token)
        layer.open_segment().close(None)
        if i >= 50:
            times.append(time.perf_counter() - start)
    if counted != (layer.counted is not None):
        raise RuntimeError(f"expected {'counted' if counted else 'host-counted'} steps")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("| round | steps | median us | fastest half, mean us |")
    print("|---|---|---:|---:|")
    for round_ in range(1, args.rounds + 1):
        for counted in (True, False):
            times = step_times(counted, args.steps)
            fastest = sorted(times)[: len(times) // 2]
            print(f"| {round_} | {'counted' if counted else 'host-counted'} | {1e6 * statistics.median(times):.1f} | "
                  f"{1e6 * statistics.mean(fastest):.1f} |")


if __name__ == "__main__":
    main()
