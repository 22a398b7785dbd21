"""Where the time of a latency-bound decode attention call goes (GPU; d=128, Qwen3-8B heads): the floor of one and
two graphed launches, the query rotation's share (the same call with R_K left out), the merge's loop over splits
(`merge_splits(split_chunk, num_warps)` alone), programmatic dependent launches on and off, register caps and the
two-warp 128-token launch, against SDPA and its kernels. Run 29 timed the in-kernel rotation, run 30 the rotation
kernel (`kernels/query_rotation.py`).

    python experiments/diag/small_grid.py
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from attention import Case, bench, error_vs_reference, graphed, profiled  # noqa: E402

from oscar_hf.kernels.triton.launch_plan import LaunchConfig, default_launch  # noqa: E402
from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402
from oscar_hf.kernels.triton.merge import merge_splits  # noqa: E402

TWO_WARP = LaunchConfig(num_warps=2, programs_per_sm=6, block_n_dense=32, block_m=8, token_major=True,
                        fold_key_offsets=True)
CAPPED = {r: LaunchConfig(**{**default_launch(128).__dict__, "max_registers": r}) for r in (168, 192)}
CELLS = [(1, 4096), (1, 32768), (1, 100_000), (8, 4096), (8, 32768), (8, 100_000), (32, 32768)]


@triton.jit
def _empty(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


def floors():
    x = torch.zeros(1024, device="cuda")
    one = bench(graphed(lambda: _empty[(1,)](x)))
    two = bench(graphed(lambda: (_empty[(1,)](x), _empty[(1,)](x))))
    print(f"floor: one empty launch {1e3 * one:.1f} us, two {1e3 * two:.1f} us (graphed, L2 flushed)", flush=True)


def breakdown(fn, calls=30):
    prof = profiled(fn, calls)
    return {e.key[:40]: round(e.self_device_time_total / calls, 1) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0}


def call(case, backend, key_rotation=True):
    return case.oscar(backend, key_rotation)


def merge_variants(case, backend):
    """The merge alone on this cell's plan, per (split_chunk, num_warps)."""
    q = case.query
    plan = backend.plan(q.device, case.batch, 8, 4, case.dense_keys.shape[2], case.history_len,
                        backend.launch_for(case.dim))
    rows = case.batch * 32 * plan.total_splits
    part_out = torch.randn(rows * case.dim, device="cuda")
    part_lse = torch.randn(rows, device="cuda")
    out = torch.empty(case.batch, 1, 32, case.dim, device="cuda", dtype=torch.bfloat16)
    res = []
    for chunk in (None, 8, 16):
        for warps in (4,):
            ms = bench(graphed(lambda: merge_splits(part_out, part_lse, plan.total_splits, out, "blhd", case.rotation,
                                                    plan.dense_splits, 8, split_chunk=chunk, num_warps=warps)))
            res.append(f"chunk {chunk or 'default'}/{warps}w {1e3 * ms:.1f}")
    return f"{plan.dense_splits}+{plan.history_splits} splits: " + ", ".join(res) + " us"


def merge_not_dependent(backend):
    """`backend` with the merge launched plainly (stage 1 still a programmatic dependent of the rotation)."""
    import oscar_hf.kernels.triton.backend as kb

    real = kb.merge_splits

    def run(*args, **kwargs):
        kb.merge_splits = lambda *a, **k: real(*a, **{**k, "after_stage1": False})
        try:
            return call(*args, **kwargs)
        finally:
            kb.merge_splits = real
    return run


def dependent_launch_ab(rounds=3):
    """Dependent launches all on / all but the merge / off, interleaved `rounds` times per cell (run 32; run 31
    had a variant without the rotation's early trigger instead, and run 32 one whose stage 1 let the merge launch
    only after its stores: both no better than all on)."""
    for batch, context in CELLS:
        modes = {"all": (TritonBackend(), call), "merge plain": (TritonBackend(), merge_not_dependent),
                 "off": (TritonBackend(dependent_launches=False), call)}
        case = Case(batch, context, 128, modes["off"][0])
        fns = {}
        for name, (backend, fn) in modes.items():
            run = fn if fn is call else fn(backend)
            fns[name] = graphed(lambda run=run, backend=backend: run(case, backend))
        times = {name: [] for name in modes}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(1e3 * bench(fn))
        print(f"dependent launches bs={batch} ctx={context}: " + "; ".join(
            f"{name} " + "/".join(f"{t:.1f}" for t in ts) + f" (min {min(ts):.1f})" for name, ts in times.items())
            + " us", flush=True)
        del case, fns
        torch.cuda.empty_cache()


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if "--ab" in sys.argv:
        return dependent_launch_ab()
    floors()
    for batch, context in CELLS:
        variants = {
            "default (rotation kernel, dependent launches)": (TritonBackend(), True),
            "no dependent launches": (TritonBackend(dependent_launches=False), True),
            "no R_K (query not rotated)": (TritonBackend(), False),
            "168 registers": (TritonBackend(launch=CAPPED[168]), True),
            "192 registers": (TritonBackend(launch=CAPPED[192]), True),
        }
        if batch == 1:
            variants["two-warp 128 tiles"] = (TritonBackend(launch=TWO_WARP), True)
            variants["two-warp 128 tiles, 168 registers"] = (
                TritonBackend(launch=LaunchConfig(**{**TWO_WARP.__dict__, "max_registers": 168})), True)
        case = Case(batch, context, 128, variants["no R_K (query not rotated)"][0])
        sdpa = bench(graphed(case.sdpa))
        print(f"\ncell bs={batch} ctx={context}: SDPA {1e3 * sdpa:.1f} us, kernels {breakdown(case.sdpa)}", flush=True)
        for name, (backend, rot) in variants.items():
            ms = bench(graphed(lambda: call(case, backend, rot)))
            err = error_vs_reference(case, backend) if rot else float("nan")
            print(f"  {name}: {1e3 * ms:.1f} us ({sdpa / ms:.2f}x SDPA), error vs reference {err:.1e}", flush=True)
        plain = variants["no dependent launches"][0]
        print("  kernels (no dependent launches):", breakdown(lambda: call(case, plain)), flush=True)
        if batch == 1:
            print("  merge alone:", merge_variants(case, plain), flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
