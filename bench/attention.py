"""Decode attention of one layer: OSCAR (BF16 sink + recent, INT2 history, merge) vs PyTorch SDPA over BF16 K/V.

    python -m bench.attention --out attention.json [--sweep] [--sweep-splits] [--breakdown]
                              [--dims 128,64]

`--sweep` times each head_dim's launch candidates (`bench.harness.SWEEP_CONFIGS`) and uses the best for its table;
`--sweep-splits` times the shortest dense / history splits the backend may cut; `--breakdown` prints each kernel's
GPU time per call (torch.profiler).

Shape: 32 query / 8 KV heads (Qwen3-8B), head_dim 128 and 64; context 4k, 32k, 100k; batch 1, 8, 32. OSCAR's
layer holds 64 sink + 256 recent + 1 new token in BF16 and the rest as 2-bit codes with float16 (scale, zero)
per row, Hadamard-rotated. Both sides read the same random K/V (the history is demoted from it by the demotion
kernel, timed too). Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed before every call) over
CUDA-graph replays of the call (GPU time; "eager" columns time the plain calls, host launch overhead included, and
"host us" is the Python/launch time per call). "folded" times the same call for a model whose value rotation is
folded into v_proj/o_proj (`OscarCache(..., fold_value_rotation=True)`): the merge then applies no R_Vᵀ.

"GB/s" counts the bytes that must be read once: OSCAR = codes + scale/zero of K and V for the history, plus the
BF16 tiers; SDPA = BF16 K and V. "% copy" divides that by the device-to-device copy bandwidth measured in the same
process (bytes read + written by `Tensor.copy_`). "INT2 %copy" is the history bytes alone over the OSCAR time. `--bits 2,4` also times 4-bit histories.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import torch
import triton
from triton.testing import do_bench

from bench.harness import KV_HEADS, SWEEP_CONFIGS, Case, graphed
from oscar_hf.kernels.triton.backend import TritonBackend
from oscar_hf.kernels.triton.launch_plan import LaunchConfig, default_launch

CONTEXTS = (4096, 32768, 100_000)
BATCHES = (1, 8, 32)


def bench(fn, rep=60):
    return do_bench(fn, warmup=15, rep=rep, return_mode="median")


def profiled(fn, calls: int, warmup: int = 3):
    """torch.profiler (CUDA activity) over `calls` calls of `fn` after `warmup` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def host_us(fn, calls=200) -> float:
    """Host microseconds per call of `fn` (launches queued, not waited for)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(1 << 31, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep=200)
    nbytes = 2 * src.numel() * src.element_size()
    src = dst = None  # freed before the allocator's cache is emptied
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)


def check(case: Case, backend: TritonBackend) -> float:
    """Relative error of OSCAR's output against SDPA over the same (unquantized) K/V: quantization error, a sanity
    check that both attend to the same tokens (not a kernel-correctness test: tests/ does that)."""
    a = case.oscar(backend).float().transpose(1, 2)
    b = case.sdpa().float()
    return ((a - b).norm() / b.norm()).item()


def error_vs_reference(case: Case, backend: TritonBackend, folded: bool = False) -> float:
    """Relative error of the kernels' output against the reference backend on the same tiers: a kernel error
    (tests/ bound it by 1.5e-2 at bf16), unlike `check`. `folded`: of `oscar_folded`'s output times R_Vᵀ."""
    a = case.oscar_folded(backend).float() @ case.rotation.T if folded else case.oscar(backend).float()
    b = case.reference()
    return ((a - b).norm() / b.norm()).item()


# a sweep candidate whose output is further than this from the reference is reported and never chosen
MAX_KERNEL_ERROR = 1.5e-2


def run_cell(batch, context, dim, backend, copy_bw, with_dense, bits=2):
    case = Case(batch, context, dim, backend, bits)
    row = dict(batch=batch, context=context, dim=dim, bits=bits, history=case.history_len)
    row["oscar_eager_ms"] = bench(lambda: case.oscar(backend))
    row["sdpa_eager_ms"] = bench(case.sdpa)
    row["oscar_ms"] = bench(graphed(lambda: case.oscar(backend)))
    row["folded_ms"] = bench(graphed(lambda: case.oscar_folded(backend)))
    row["sdpa_ms"] = bench(graphed(case.sdpa))
    row["oscar_host_us"] = host_us(lambda: case.oscar(backend))
    row["sdpa_host_us"] = host_us(case.sdpa)
    row["speedup"] = row["sdpa_ms"] / row["oscar_ms"]
    row["speedup_eager"] = row["sdpa_eager_ms"] / row["oscar_eager_ms"]
    row["folded_speedup"] = row["sdpa_ms"] / row["folded_ms"]
    total = case.bytes_history() + case.bytes_dense()
    row["oscar_GBps"] = total / (row["oscar_ms"] * 1e-3) / 1e9
    row["oscar_copy_frac"] = total / (row["oscar_ms"] * 1e-3) / copy_bw
    row["int2_copy_frac"] = case.bytes_history() / (row["oscar_ms"] * 1e-3) / copy_bw
    row["sdpa_GBps"] = case.bytes_sdpa() / (row["sdpa_ms"] * 1e-3) / 1e9
    row["sdpa_copy_frac"] = case.bytes_sdpa() / (row["sdpa_ms"] * 1e-3) / copy_bw
    row["rel_err_vs_sdpa"] = check(case, backend)
    row["rel_err_vs_reference"] = error_vs_reference(case, backend)
    row["folded_rel_err_vs_reference"] = error_vs_reference(case, backend, folded=True)
    demote_ms = bench(lambda: backend.demote_kv(case.demotion), rep=30)
    rows = 2 * batch * KV_HEADS * case.history_len
    row["demote_ms"] = demote_ms
    row["demote_Mrows_per_s"] = rows / (demote_ms * 1e-3) / 1e6
    if with_dense:
        row["dense_triton_ms"] = bench(graphed(lambda: case.dense_triton(backend)))
        row["dense_torch_ms"] = bench(graphed(case.dense_torch))
    return row


LAUNCH_OVERRIDES: dict = {}  # --launch: LaunchConfig fields over each head_dim's default


def base_launch(dim: int) -> LaunchConfig:
    """The head_dim's default launch configuration with the `--launch` fields over it."""
    return LaunchConfig(**{**default_launch(dim).__dict__, **LAUNCH_OVERRIDES})


def sweep(copy_bw, dim=128):
    """Stage-1 launch configurations on a few cells (pick the default for LaunchConfig at this head_dim)."""
    configs = [LaunchConfig(**fields) for fields in SWEEP_CONFIGS[dim]]
    out = []
    for batch, context in [(1, 100_000), (8, 100_000), (32, 32768), (1, 4096)]:
        case = Case(batch, context, dim, TritonBackend())
        for cfg in configs:
            backend = TritonBackend(launch=cfg)
            name = (f"{cfg.block_n_history}/{cfg.num_warps}/{cfg.num_stages}/{cfg.programs_per_sm}/{cfg.block_n_dense}"
                    f"{'/token-major/' + str(cfg.block_m) if cfg.token_major else ''}"
                    f"{'/fold' if cfg.fold_key_offsets else ''}"
                    f"{'/regs' + str(cfg.max_registers) if cfg.max_registers else ''}")
            try:
                ms = bench(graphed(lambda: case.oscar(backend)))
                frac = case.bytes_history() / (ms * 1e-3) / copy_bw
                err = error_vs_reference(case, backend)
                out.append(dict(dim=dim, batch=batch, context=context, config=cfg.__dict__, ms=ms,
                                int2_copy_frac=frac, rel_err_vs_reference=err))
                print(f"sweep d={dim} bs={batch} ctx={context} {name}: {ms:.3f} ms, INT2 {100 * frac:.0f}% of copy, "
                      f"error vs reference {err:.1e}", flush=True)
            except Exception as exc:  # a configuration that does not compile or fit
                print(f"sweep {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        case = None
        torch.cuda.empty_cache()
    return out


# (dense, history; None: the launch's min_history_tokens); the first is the default
SPLIT_MINIMUMS = [(256, None), (256, 256), (256, 512), (128, 256), (64, 128)]


def sweep_split_minimums(copy_bw, dim=128):
    """The shortest dense / history split (TritonBackend's min_dense_tokens / min_history_tokens; where they leave a
    small grid, the backend cuts shorter ones anyway) with the default launch, on the cells where few splits leave
    SMs idle (batch 1 and short contexts)."""
    out = []
    for batch, context in [(1, 4096), (8, 4096), (1, 32768), (1, 100_000), (8, 100_000)]:
        case = Case(batch, context, dim, TritonBackend())
        for dense_min, hist_min in SPLIT_MINIMUMS:
            backend = TritonBackend(min_dense_tokens=dense_min, min_history_tokens=hist_min, launch=base_launch(dim))
            ms = bench(graphed(lambda: case.oscar(backend)))
            err = error_vs_reference(case, backend)
            out.append(dict(dim=dim, batch=batch, context=context, min_dense_tokens=dense_min,
                            min_history_tokens=hist_min, ms=ms, rel_err_vs_reference=err))
            print(f"split minimums d={dim} bs={batch} ctx={context} dense>={dense_min} "
                  f"history>={hist_min or 'launch default'}: {ms:.3f} ms, error vs reference {err:.1e}", flush=True)
        case = None
        torch.cuda.empty_cache()
    return out


def kernel_breakdown(dim=128, calls=50):
    """GPU time per call of each kernel of an OSCAR decode attention call (torch.profiler), for the cells where the
    fixed costs show: batch 1 at 4k and 100k, batch 8 at 100k."""
    out = []
    for batch, context in [(1, 4096), (1, 100_000), (8, 100_000)]:
        backend = TritonBackend(launch=base_launch(dim))
        case = Case(batch, context, dim, backend)
        prof = profiled(lambda: case.oscar(backend), calls, warmup=5)
        times = {}
        for event in prof.key_averages():
            if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
                times[event.key[:60]] = event.self_device_time_total / calls
        row = dict(dim=dim, batch=batch, context=context, kernels_us=times)
        out.append(row)
        print(f"kernel breakdown d={dim} bs={batch} ctx={context}: "
              + ", ".join(f"{k} {v:.1f} us" for k, v in sorted(times.items(), key=lambda kv: -kv[1])), flush=True)
        case = None
        torch.cuda.empty_cache()
    return out


def best_config(rows) -> LaunchConfig:
    """The configuration with the lowest sum over the sweep cells of time / best time of the cell."""
    bad = {json.dumps(r["config"], sort_keys=True) for r in rows if not r["rel_err_vs_reference"] <= MAX_KERNEL_ERROR}
    rows = [r for r in rows if json.dumps(r["config"], sort_keys=True) not in bad]
    best_ms = {}
    for r in rows:
        key = (r["batch"], r["context"])
        best_ms[key] = min(best_ms.get(key, math.inf), r["ms"])
    scores = {}
    for r in rows:
        name = json.dumps(r["config"], sort_keys=True)
        scores.setdefault(name, []).append(r["ms"] / best_ms[(r["batch"], r["context"])])
    complete = {k: sum(v) for k, v in scores.items() if len(v) == len(best_ms)}
    return LaunchConfig(**json.loads(min(complete, key=complete.get))) if complete else LaunchConfig()


CUDA_HISTORY = True  # --no-cuda-history: the Triton history kernel for every call


def usable_backend(launch: LaunchConfig | None) -> TritonBackend:
    """`launch` (None: the per-head_dim defaults), or the same without inline PTX if that does not compile here."""
    backend = TritonBackend(launch=launch, cuda_history=CUDA_HISTORY)
    try:
        case = Case(1, 4096, 128, backend)
        case.oscar(backend)
        torch.cuda.synchronize()
        return backend
    except Exception as exc:
        print(f"launch config {launch} failed ({type(exc).__name__}: {str(exc)[:300]}); without inline PTX",
              flush=True)
        return TritonBackend(launch=LaunchConfig(**{**(launch or LaunchConfig()).__dict__, "asm_unpack": False}),
                             cuda_history=CUDA_HISTORY)


def table(rows, copy_bw):
    columns = ["d", "bits", "ctx", "bs", "OSCAR ms", "SDPA ms", "speedup", "folded ms", "folded speedup", "OSCAR GB/s",
               "OSCAR %copy", "INT2 %copy", "SDPA GB/s", "SDPA %copy", "OSCAR eager ms", "SDPA eager ms",
               "eager speedup", "OSCAR host us", "SDPA host us", "dense Triton ms", "dense torch ms",
               "demote Mrows/s", "rel err vs SDPA", "rel err vs reference", "folded rel err vs reference"]
    lines = [f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s", "",
             "| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dim']} | {r.get('bits', 2)} | {r['context']} | {r['batch']} | {r['error']} |")
            continue
        lines.append(
            f"| {r['dim']} | {r.get('bits', 2)} | {r['context']} | {r['batch']} | {r['oscar_ms']:.3f} | {r['sdpa_ms']:.3f} | "
            f"{r['speedup']:.2f}x | {r['folded_ms']:.3f} | {r['folded_speedup']:.2f}x | {r['oscar_GBps']:.0f} | "
            f"{100 * r['oscar_copy_frac']:.0f}% | "
            f"{100 * r['int2_copy_frac']:.0f}% | {r['sdpa_GBps']:.0f} | {100 * r['sdpa_copy_frac']:.0f}% | "
            f"{r['oscar_eager_ms']:.3f} | {r['sdpa_eager_ms']:.3f} | {r['speedup_eager']:.2f}x | "
            f"{r['oscar_host_us']:.0f} | {r['sdpa_host_us']:.0f} | "
            f"{r.get('dense_triton_ms', math.nan):.3f} | {r.get('dense_torch_ms', math.nan):.3f} | "
            f"{r['demote_Mrows_per_s']:.0f} | {r['rel_err_vs_sdpa']:.3f} | {r['rel_err_vs_reference']:.1e} | "
            f"{r['folded_rel_err_vs_reference']:.1e} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time stage-1 launch configurations")
    parser.add_argument("--sweep-splits", action="store_true", help="time the split minimums first (default launch)")
    parser.add_argument("--breakdown", action="store_true", help="kernel times per call (torch.profiler) first")
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--bits", default="2", help="history code widths, comma-separated (2, 4)")
    parser.add_argument("--no-cuda-history", action="store_true", help="Triton history kernel only")
    parser.add_argument("--launch-out", default=None, help="write the launch configs used (JSON) here")
    parser.add_argument("--launch", default=None,
                        help="LaunchConfig fields (JSON) over each head_dim's default, for the table without --sweep, "
                             "the split minimums and the breakdown")
    parser.add_argument("--contexts", default=None, help="table contexts (default: all)")
    parser.add_argument("--batches", default=None, help="table batches (default: all)")
    args = parser.parse_args()
    global CUDA_HISTORY
    CUDA_HISTORY = not args.no_cuda_history
    dims = [int(d) for d in args.dims.split(",")]
    LAUNCH_OVERRIDES.update(json.loads(args.launch or "{}"))
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else CONTEXTS
    batches = [int(b) for b in args.batches.split(",")] if args.batches else BATCHES
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    breakdown = [r for dim in dims for r in kernel_breakdown(dim)] if args.breakdown else []
    split_rows = [r for dim in dims for r in sweep_split_minimums(copy_bw, dim)] if args.sweep_splits else []
    sweep_rows, backends = [], {}
    for dim in dims:  # with --sweep, each head_dim's table uses the best of its candidates
        rows_dim = sweep(copy_bw, dim) if args.sweep and dim in SWEEP_CONFIGS else []
        sweep_rows += rows_dim
        backends[dim] = usable_backend(best_config(rows_dim) if rows_dim else base_launch(dim))
        print(f"launch config for d={dim}: {backends[dim].launch_for(dim)}", flush=True)
    launches = {str(dim): backend.launch_for(dim).__dict__ for dim, backend in backends.items()}
    if args.launch_out:
        with open(args.launch_out, "w") as f:
            json.dump(launches, f)
    rows = []
    cells = [(dim, bits, context, batch) for dim in dims for bits in (int(b) for b in args.bits.split(","))
             for context in contexts for batch in batches]
    for dim, bits, context, batch in cells:
        try:
            row = run_cell(batch, context, dim, backends[dim], copy_bw, with_dense=dim == 128 and bits == 2, bits=bits)
        except Exception as exc:
            row = dict(batch=batch, context=context, dim=dim, bits=bits, error=f"{type(exc).__name__}: {exc}"[:200])
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    text = table(rows, copy_bw)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                           device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           copy_bandwidth=copy_bw, launch=launches, rows=rows, sweep=sweep_rows,
                           split_sweep=split_rows, breakdown=breakdown,
                           table=text), f, indent=1)


if __name__ == "__main__":
    main()
