"""Which Triton kernels a machine's first `generate` call compiles, how long each takes, and whether compiling
them on threads would pay (issue 45: "a machine's very first call").

    python -m experiments.compile.triton_census --context 32768 --batch 4 --new-tokens 16 --chunk 8192

Runs `bench.first_answer`'s call twice with `OscarCache(model)` while Triton's compilation listener
(`triton.knobs.compilation.listener`, a public knob) records every kernel it compiles in this process. Prints:
- each call's wall time;
- per kernel function: variants compiled, seconds, and what tells the variants apart (constexprs and the
  specialization attributes);
- the same kernels compiled again into empty cache folders, one after another and on `--threads` threads
  (`triton.compile` on `ASTSource`s, what `JITFunction` calls), to see what parallel compilation would save;
- the NVRTC compile of the CUDA history kernel (compiled per process, no disk cache).

`--compile-threads N` builds the caches with `TritonBackend(compile_threads=N)` (0: each kernel compiles at its
launch, as before `kernels.triton.precompile`; default: the backend's default). `--no-recompile` skips the
recompilation. `--manifest FILE` writes each variant's specialization data as JSON lines (module, kernel name, the data
`JITFunction.preload` takes).

Run it on a machine whose Triton cache is empty (a fresh one, or `TRITON_CACHE_DIR` pointed at an empty folder),
else the first call compiles nothing and the census is empty.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
from triton import knobs
from triton.compiler.compiler import make_backend

from bench.first_answer import one_call
from bench.harness import build_model
from oscar_hf.kernels.triton.precompile import default_threads


class Census:
    """The compilation listener: one record per kernel compiled (cache hits are counted apart)."""

    def __init__(self):
        self.records: list[dict] = []
        self.hits = 0
        self.stages: dict[str, float] = defaultdict(float)

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.hits += 1
            return
        if not hasattr(src, "fn"):  # an IR source, not a JIT function
            return
        seconds = times.total / 1e6
        for stage, us in times.lowering_stages:
            self.stages[stage] += us / 1e6
        self.stages["make_ir"] += times.ir_initialization / 1e6
        self.records.append(dict(name=src.fn.__name__, module=src.fn.module, src=src, metadata=dict(metadata),
                                 seconds=seconds, constexprs={str(k): _short(v) for k, v in src.constants.items()},
                                 attrs={str(k): v for k, v in src.attrs.items()}))


class Specializations:
    """The post-compile hook: each compiled variant's specialization data, which `JITFunction.preload` takes."""

    def __init__(self):
        self.rows: list[dict] = []

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        self.rows.append(dict(module=fn.module, name=fn.name, data=compile["specialization_data"]))
        return None


def _short(value):
    return value if isinstance(value, (int, float, bool, str)) else str(value)


def options_of(metadata: dict, target) -> dict:
    """The backend options a record was compiled with, read back from its metadata."""
    fields = make_backend(target).parse_options({}).__dict__.keys()
    return {k: metadata[k] for k in fields if k in metadata}


def recompile(records: list[dict], threads: int) -> float:
    """Seconds to compile every record's source into an empty cache folder, on `threads` threads."""
    target = triton.runtime.driver.active.get_current_target()
    jobs = [(r["src"], options_of(r["metadata"], target)) for r in records]
    with tempfile.TemporaryDirectory() as folder:
        previous = knobs.cache.dir
        knobs.cache.dir = folder
        try:
            began = time.perf_counter()
            if threads == 1:
                for src, options in jobs:
                    triton.compile(src, target=target, options=options)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda job: triton.compile(job[0], target=target, options=job[1]), jobs))
            return time.perf_counter() - began
        finally:
            knobs.cache.dir = previous


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--kind", default="oscar", help="bench.first_answer's cache kind")
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--manifest", default=None, help="write the variants' specialization data here (JSON lines)")
    p.add_argument("--compile-threads", type=int, default=None, help="TritonBackend(compile_threads=...)")
    p.add_argument("--no-recompile", action="store_true", help="skip compiling the variants again")
    args = p.parse_args()
    census, specializations = Census(), Specializations()
    knobs.compilation.listener = census
    knobs.runtime.jit_post_compile_hook = specializations
    model = build_model()
    options = None
    if args.compile_threads is not None:
        from oscar_hf.kernels.triton.backend import TritonBackend

        options = {"backend": TritonBackend(compile_threads=args.compile_threads)}
    for call in (1, 2):
        row = one_call(model, args.kind, args.batch, args.context, args.new_tokens, args.chunk, seed=call,
                       cache_options=options)
        print(f"call {call}: {row.get('seconds', row)} s; Triton kernels compiled so far: {len(census.records)}, "
              f"cache hits {census.hits}", flush=True)
    knobs.compilation.listener = None
    knobs.runtime.jit_post_compile_hook = None
    if args.manifest:
        with open(args.manifest, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in specializations.rows)

    by_name = defaultdict(list)
    for r in census.records:
        by_name[(r["module"], r["name"])].append(r)
    print("\n| kernel | variants | compile s | what differs between variants |\n|---|---:|---:|---|")
    for (module, name), rs in sorted(by_name.items(), key=lambda kv: -sum(r["seconds"] for r in kv[1])):
        differs = []
        for field in ("constexprs", "attrs"):
            keys = set().union(*(r[field] for r in rs))
            for key in sorted(keys):
                values = {repr(r[field].get(key)) for r in rs}
                if len(values) > 1:
                    differs.append(f"{key}: {' / '.join(sorted(values))}")
        print(f"| {module.split('.')[-1]}.{name} | {len(rs)} | {sum(r['seconds'] for r in rs):.1f} | "
              f"{'; '.join(differs)[:300]} |")
    total = sum(r["seconds"] for r in census.records)
    print(f"\n{len(census.records)} variants, {total:.1f} s of compilation in this process; by stage: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in census.stages.items()))

    if census.records and not args.no_recompile:
        serial = recompile(census.records, 1)
        parallel = recompile(census.records, args.threads)
        print(f"recompiled into empty folders: one after another {serial:.1f} s, on {args.threads} threads "
              f"{parallel:.1f} s")

    from oscar_hf.kernels.cuda import history

    major, minor = torch.cuda.get_device_capability()
    began = time.perf_counter()
    history.compile_cubin(major * 10 + minor)
    print(f"NVRTC compile of the CUDA history kernel: {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
