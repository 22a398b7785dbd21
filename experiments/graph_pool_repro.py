"""Why `GraphReplay.clear` drops its memory pools: capture a call into a pool, drop the
graph, empty the allocator's cache, capture again into the same pool. On torch 2.11 (H200) the second capture fails
inside PyTorch (`it->second->use_count > 0 INTERNAL ASSERT FAILED`, CachingHostAllocator.h) and leaves the RNG in
capture state; with a fresh pool after each clear, every capture succeeds.

    python experiments/graph_pool_repro.py 0   # as the package does now: 4 of 4 captures succeed
    python experiments/graph_pool_repro.py 1   # the old clear, which kept the pools: the second capture fails
"""

import sys

import torch

from oscar_hf.kernels.replay import GraphReplay


def old_clear(self):
    self._graphs.clear()
    self._seen.clear()


def main() -> None:
    keep_pools = sys.argv[1:] == ["1"]
    replay = GraphReplay()
    if keep_pools:
        replay.clear = old_clear.__get__(replay)
    for size in (1 << 12, 1 << 16, 1 << 12, 1 << 18):
        x = torch.randn(size, device="cuda")
        for _ in range(3):  # direct, captured, replayed
            replay(("step", size), x, lambda x: (x * 2).relu() + x.sum())
        replay.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(f"{'pools kept' if keep_pools else 'pools reset'}: {replay.captures} of 4 captures succeeded")


if __name__ == "__main__":
    main()
