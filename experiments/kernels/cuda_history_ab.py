"""The CUDA history kernel (`oscar_hf/kernels/int2_history.cu`) against the Triton stage 1 on the history tier
alone: same random codes, same split plan; partials compared (and merged outputs), then both timed from CUDA-graph
replays (L2 flushed by `do_bench`). GPU only.

    python3 experiments/kernels/cuda_history_ab.py [--check-only] [--programs 8,20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from triton.testing import do_bench  # noqa: E402

from oscar_hf.kernels.triton.attention import HistoryTensors, attention_partials  # noqa: E402
from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402
from oscar_hf.kernels.cuda.history import (
    CudaHistoryConfig,
    history_bytes,
    history_partials,
    plan_history,
    resident_slots,
)
from oscar_hf.kernels.triton.launch_plan import SplitPlan, default_launch  # noqa: E402
from oscar_hf.kernels.triton.merge import merge_splits  # noqa: E402

KV_HEADS = 8


def random_history(batch, length, dim, capacity=None, pinned=False, device="cuda"):
    capacity = capacity or length
    shape = (batch, KV_HEADS, capacity)

    def scale_zero():
        scale = torch.rand(*shape, 1, device=device) * 0.2 + 0.02
        zero = torch.randint(0, 4, (*shape, 1), device=device).float() + torch.rand(*shape, 1, device=device) - 0.5
        return torch.cat([scale, zero], dim=-1).half()

    codes = lambda: torch.randint(0, 256, (*shape, dim // 4), dtype=torch.uint8, device=device)  # noqa: E731
    length_ptr = torch.tensor([length], dtype=torch.int32, device=device) if pinned else None
    return HistoryTensors(codes(), codes(), scale_zero(), scale_zero(), length, 2, length_ptr)


def wave_plan(batch, length, dim, config):
    """History splits for the CUDA kernel so that its programs fill `config.waves` waves of the resident slots."""
    return plan_history(SplitPlan(8, 1, 64, 0, 16, 0, 64), length, batch * KV_HEADS, resident_slots(0, dim, config),
                        config)


def run_both(batch, length, dim, q_heads=32, q_len=1, capacity=None, pinned=False, programs_per_sm=None,
             plan=None, config=None, **fields):
    """`config` (default `CudaHistoryConfig()`) with `fields` replaced (e.g. magic_planes=13, narrow_rows=False)."""
    config = replace(config or CudaHistoryConfig(), **fields)
    history = random_history(batch, length, dim, capacity, pinned)
    rotated = torch.randn(batch, q_heads, q_len, dim, device="cuda") * 2.0
    query = rotated.to(torch.bfloat16)
    launch = default_launch(dim)
    backend = TritonBackend()
    if programs_per_sm:
        backend.target_programs = programs_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    rows = (q_heads // KV_HEADS) * q_len
    triton_plan = backend.plan(query.device, batch, KV_HEADS, rows, 0, history.plan_length, launch)
    plan = plan or triton_plan
    n = batch * q_heads * q_len * max(plan.total_splits, triton_plan.total_splits)
    buffers = [(torch.full((n * dim,), float("nan"), device="cuda"), torch.full((n,), float("nan"), device="cuda"))
               for _ in range(2)]
    scaling = dim**-0.5

    def triton_call():
        attention_partials(query, None, None, history, rotated, None, triton_plan, scaling, None, False, 0, 0,
                           buffers[0][0], buffers[0][1], KV_HEADS, launch)

    def cuda_call():
        history_partials(rotated, history, plan, scaling, KV_HEADS, buffers[1][0], buffers[1][1],
                         config)

    return history, rotated, plan, buffers, triton_call, cuda_call


def compare(batch, length, dim, **kw):
    history, rotated, plan, buffers, triton_call, cuda_call = run_both(batch, length, dim, **kw)
    triton_call()
    cuda_call()
    torch.cuda.synchronize()
    q_heads, q_len = rotated.shape[1], rotated.shape[2]
    shape = (batch, q_heads, q_len, plan.total_splits)
    (ot, lt), (oc, lc) = [(o[: batch * q_heads * q_len * plan.total_splits * dim].view(*shape, dim),
                           lse[: batch * q_heads * q_len * plan.total_splits].view(shape)) for o, lse in buffers]
    finite = torch.isfinite(lt)
    same_inf = bool(((lt == float("-inf")) == (lc == float("-inf"))).all())
    nan_c = int(torch.isnan(oc).sum() + torch.isnan(lc).sum())
    out_err = ((oc - ot).norm() / ot.norm()).item()
    lse_err = (lc[finite] - lt[finite]).abs().max().item() if finite.any() else 0.0
    merged = []
    for o, lse in ((ot, lt), (oc, lc)):
        out = torch.empty(batch, q_heads, q_len, dim, device="cuda")
        merge_splits(o.reshape(-1), lse.reshape(-1), plan.total_splits, out, "bhld")
        merged.append(out)
    merged_err = ((merged[1] - merged[0]).norm() / merged[0].norm()).item()
    return dict(out=out_err, lse=lse_err, merged=merged_err, same_inf=same_inf, nan=nan_c,
                splits=plan.total_splits)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--config", default="{}", help="CudaHistoryConfig fields (JSON) for the checks")
    parser.add_argument("--programs", default="20", help="programs per SM to plan splits for (CUDA kernel)")
    parser.add_argument("--variants", default="4:8:0:0", help="CUDA kernel stages:min warps:magic planes:waves, ...")
    parser.add_argument("--end-to-end", default=None,
                        help="time whole decode calls (bench/attention.py's Case) for these CudaHistoryConfig "
                             "variants, 'stages:warps:magic:overlap_dense[:narrow_rows[:key_chains]];...', against the "
                             "Triton-only backend")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.end_to_end:
        return end_to_end([tuple(int(x) for x in v.split(":")) for v in args.end_to_end.split(";")])
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    print("| check | splits | partial out rel err | lse max abs err | merged rel err | -inf agree | NaN |")
    print("|---|---:|---:|---:|---:|---|---:|")
    checks = [
        ("d128 B2 N5000", dict(batch=2, length=5000, dim=128)),
        ("d64 B2 N5000", dict(batch=2, length=5000, dim=64)),
        ("d128 B1 N64", dict(batch=1, length=64, dim=128)),
        ("d128 B1 N100", dict(batch=1, length=100, dim=128)),
        ("d128 B2 N3001 Lq2 (8 rows)", dict(batch=2, length=3001, dim=128, q_len=2)),
        ("d128 B2 G2 (16q/8kv)", dict(batch=2, length=3001, dim=128, q_heads=16)),
        ("d128 B2 pinned N3001 cap 8192", dict(batch=2, length=3001, dim=128, capacity=8192, pinned=True)),
        ("d64 B3 pinned N777 cap 4096", dict(batch=3, length=777, dim=64, capacity=4096, pinned=True)),
        ("d128 B8 N100000", dict(batch=8, length=100_000, dim=128)),
        ("d128 B2 N5000, 8-row kernel", dict(batch=2, length=5000, dim=128, narrow_rows=False)),
        ("d64 B3 N3001 G3 (24q/8kv)", dict(batch=3, length=3001, dim=64, q_heads=24)),
        ("d128 B8 N100000, 8-row kernel", dict(batch=8, length=100_000, dim=128, narrow_rows=False)),
    ]
    base = CudaHistoryConfig(**json.loads(args.config))
    print(f"checked config: {base}")
    for name, kw in checks:
        r = compare(**kw, config=base)
        print(f"| {name} | {r['splits']} | {r['out']:.2e} | {r['lse']:.2e} | {r['merged']:.2e} | {r['same_inf']} | "
              f"{r['nan']} |", flush=True)
    for magic in (12, 13, 15):
        for name, kw in checks[:2] + checks[8:9]:
            r = compare(**kw, config=base, magic_planes=magic)
            print(f"| magic planes {magic:04b}: {name} | {r['splits']} | {r['out']:.2e} | {r['lse']:.2e} | "
                  f"{r['merged']:.2e} | {r['same_inf']} | {r['nan']} |", flush=True)
    if args.check_only:
        return
    print()
    # variants "stages:min_warps:magic_planes:waves" (waves 0: the Triton plan, `--programs` per SM)
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
    print("| d | ctx | bs | Triton us (splits) | " + " | ".join(f"CUDA {v[0]}st/{v[1]}w/m{v[2]}/W{v[3]} us (splits)"
                                                                   for v in variants) + " | best speedup | best GB/s |")
    print("|---:|---:|---:|---:|" + "---:|" * len(variants) + "---:|---:|")
    for dim, batch, length in [(128, 1, 4096), (128, 1, 100_000), (128, 8, 32768), (128, 8, 100_000),
                               (128, 32, 32768), (128, 32, 100_000), (64, 8, 100_000), (64, 32, 100_000)]:
        calls, splits = [], []
        history = None
        for stages, warps, magic, waves in variants:
            config = CudaHistoryConfig(stages, warps, magic, waves)
            plan = wave_plan(batch, length, dim, config) if waves else None
            history, rotated, plan, buffers, triton_call, cuda_call = run_both(
                batch, length, dim, programs_per_sm=int(args.programs), config=config, plan=plan)
            calls.append(cuda_call)
            splits.append(plan.total_splits)
        times = []
        for fn in [triton_call] + calls:
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            times.append(do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3)
        nbytes = history_bytes(batch, KV_HEADS, length, dim)
        best = min(times[1:])
        print(f"| {dim} | {length} | {batch} | {times[0]:.1f} | "
              + " | ".join(f"{x:.1f} ({n})" for x, n in zip(times[1:], splits))
              + f" | {times[0] / best:.2f}x | {nbytes / best / 1e3:.0f} |", flush=True)
        del history, buffers, calls
        torch.cuda.empty_cache()


def end_to_end(variants):
    """Whole decode calls (BF16 tiers, rotation, history, merge) on bench/attention.py's cases, graph-timed."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from attention import Case, graphed  # noqa: E402

    backends = [("Triton only", TritonBackend(cuda_history=False))] + [
        (f"CUDA {s}st/{w}w/m{m}/overlap{o}/narrow{n}/chains{k}", TritonBackend(
            cuda_history=True, overlap_dense=bool(o),
            cuda_history_config=CudaHistoryConfig(s, w, m, min_history_bytes=0, narrow_rows=bool(n), key_chains=k)))
        for s, w, m, o, n, k in (v + (1, 4)[len(v) - 4:] for v in variants)]
    print("| d | ctx | bs | " + " | ".join(f"{name} us" for name, _ in backends) + " | error vs reference |")
    print("|---:|---:|---:|" + "---:|" * len(backends) + "---|")
    for dim in (128, 64):
        for context in (4096, 32768, 100_000):
            for batch in (1, 8, 32):
                case = Case(batch, context, dim, backends[0][1])
                times = [do_bench(graphed(lambda b=b: case.oscar(b)), warmup=10, rep=50, return_mode="median") * 1e3
                         for _, b in backends]
                errors = ""
                if (context, batch) in ((4096, 8), (100_000, 8)):
                    ref = case.reference()
                    errors = ", ".join(f"{((case.oscar(b).float() - ref).norm() / ref.norm()).item():.1e}"
                                       for _, b in backends)
                print(f"| {dim} | {context} | {batch} | " + " | ".join(f"{x:.1f}" for x in times) + f" | {errors} |",
                      flush=True)
                del case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
