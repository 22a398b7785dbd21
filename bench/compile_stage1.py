"""Compile the stage-1 attention kernel for an H200 (sm_90) without a GPU and print what each launch configuration
costs in resources: registers per thread, shared memory per block, the blocks per SM these allow, and static
SASS counts (MMA, shared-memory and global loads, barriers).

    python -m bench.compile_stage1 [--dim 128] [--sweep | --launch '{"block_n_dense": 32}'] [--loops]

The kernel is specialized as a decode step of Qwen3-8B at 100k tokens / batch 8 specializes it (bf16 query, its
float32 rotation from `rotate_query`, 2-bit history with fp16 scale/zero, no mask, dependent launches), with the
integer arguments' divisibility and value-1 specialization that a real launch gets. An earlier version of the
kernel compiled here to the registers and shared memory that Nsight Compute reported for it on an H200 (168 and
71,680 bytes). It needs Triton's bundled ptxas and cuobjdump only.
It gives resources, not time: time is measured with `python -m bench.attention --sweep` on the GPU.
"""

from __future__ import annotations

import argparse
import json
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.harness import MAX_BLOCKS, REGISTERS_PER_SM, SHARED_PER_SM, SWEEP_CONFIGS, disassemble_cubin, loop_mixes
from oscar_hf.kernels.triton.stage1 import _attention_partials_kernel
from oscar_hf.kernels.triton.launch_plan import LaunchConfig, default_launch

H200 = GPUTarget("cuda", 90, 32)
POINTERS = dict(q_ptr="*bf16", qr_ptr="*fp32", k_ptr="*bf16", v_ptr="*bf16", hk_ptr="*u8", hkz_ptr="*i32",
                hv_ptr="*u8", hvz_ptr="*i32", m_ptr="*bf16", o_ptr="*fp32", lse_ptr="*fp32",
                n_ptr="*i32", ds_ptr="*i32")
SASS_OPS = ("HMMA", "HGMMA", "LDSM", "LDS", "STS", "LDG", "LDGSTS", "BAR", "MUFU", "PRMT", "LOP3")


def decode_arguments(dim: int, batch: int = 8, kv_heads: int = 8, capacity: int = 112_000, dense: int = 336):
    """Integer and float arguments of a decode step (strides of HF's query view, the BF16 buffers, the history)."""
    codes = dim // 4
    return dict(
        sqb=32 * dim, sqh=dim, sql=32 * dim, srb=32 * dim, srh=dim, srl=dim,
        skb=kv_heads * dense * dim, skh=dense * dim, skt=dim, svb=kv_heads * dense * dim, svh=dense * dim, svt=dim,
        shkb=kv_heads * capacity * codes, shkh=capacity * codes, shkt=codes, shzb=kv_heads * capacity,
        shzh=capacity, shzt=1, shvb=kv_heads * capacity * codes, shvh=capacity * codes, shvt=codes,
        shwb=kv_heads * capacity, shwh=capacity, shwt=1, smb=0, sml=0, smc=0,
        Lq=1, Ld=321, N=100_000, G=4, Hkv=kv_heads, gap_start=64, hist_col0=64, dense_splits=2,
        dense_split_len=192, hist_split_len=1536, total_splits=67, scaling=dim**-0.5, softcap=1.0,
    )


def compile_stage1(dim: int, launch: LaunchConfig):
    kernel = _attention_partials_kernel
    constexprs = dict(D=dim, BITS=2, HIST_QUANT=True, N_FROM_PTR=False, HAS_DENSE_START=False, BLOCK_M=16,
                      BLOCK_N=launch.block_n_dense, BLOCK_NQ=launch.block_n_history, HAS_MASK=False, MASK_BOOL=True,
                      IS_CAUSAL=False, HAS_SOFTCAP=False, DT=tl.float16, UPCAST_DOTS=False,
                      ASM_UNPACK=launch.asm_unpack, SZ_DT=tl.float16, TOKEN_MAJOR=launch.token_major,
                      FOLD_K=launch.fold_key_offsets and launch.token_major, WAIT_ROTATION=True, LAUNCH_DEPENDENTS=True,
                      WAIT_AT_END=False)
    constexprs["BLOCK_M"] = launch.block_m  # decode rows: a GQA group of 4 fits any block
    values = decode_arguments(dim)
    unspecialized = set(kernel.do_not_specialize)
    signature, constants, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(values[name], float):
            signature[name] = "fp32"
        elif values[name] == 1 and index not in unspecialized and name not in unspecialized:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if values[name] % 16 == 0 and index not in unspecialized and name not in unspecialized:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=H200,
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages,
                                       **({} if launch.max_registers is None else dict(maxnreg=launch.max_registers))))


def disassemble(compiled) -> tuple[str, str]:
    """`cuobjdump -res-usage` and `-sass` of a compiled Triton kernel."""
    return disassemble_cubin(compiled.asm["cubin"])


def resources(compiled, num_warps: int, disassembly: tuple[str, str] | None = None) -> dict:
    """Registers, stack, shared memory, the blocks and warps per SM these allow, and SASS opcode counts."""
    usage, sass = disassembly or disassemble(compiled)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spilled = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = compiled.metadata.shared
    threads = 32 * num_warps
    blocks = min(REGISTERS_PER_SM // (registers * threads), SHARED_PER_SM // max(shared, 1), MAX_BLOCKS)
    ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in SASS_OPS}
    return dict(registers=registers, stack=spilled, shared_bytes=shared, blocks_per_sm=blocks,
                warps_per_sm=blocks * num_warps, sass=ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--launch", default=None, help="LaunchConfig fields as JSON, over the head_dim's default")
    parser.add_argument("--sweep", action="store_true", help="the candidates of python -m bench.attention --sweep")
    parser.add_argument("--loops", action="store_true", help="also print each loop's SASS count and opcode mix")
    args = parser.parse_args()
    base = default_launch(args.dim)
    if args.sweep:
        launches = [LaunchConfig(**fields) for fields in SWEEP_CONFIGS[args.dim]]
    else:
        launches = [LaunchConfig(**{**base.__dict__, **json.loads(args.launch or "{}")})]
    print(f"stage 1, d={args.dim}, sm_90 (decode, bf16 query, 2-bit history)")
    print("| history tile / warps / stages / dense tile | registers | stack | shared KB | blocks/SM | warps/SM | "
          + " | ".join(SASS_OPS) + " |")
    print("|---" * (6 + len(SASS_OPS)) + "|")
    for launch in launches:
        compiled = compile_stage1(args.dim, launch)
        disassembly = disassemble(compiled)
        r = resources(compiled, launch.num_warps, disassembly)
        name = (f"{launch.block_n_history} / {launch.num_warps} / {launch.num_stages} / {launch.block_n_dense}"
                + (f" / token-major {launch.block_m}" if launch.token_major else "")
                + (" / fold" if launch.fold_key_offsets else "")
                + (f" / {launch.max_registers} registers" if launch.max_registers else "")
                + f" ({launch.programs_per_sm} programs/SM: same compile)")
        print(f"| {name} | {r['registers']} | {r['stack']} | {r['shared_bytes'] / 1024:.1f} | {r['blocks_per_sm']} | "
              f"{r['warps_per_sm']} | " + " | ".join(str(r["sass"][op]) for op in SASS_OPS) + " |", flush=True)
        if args.loops:
            for count, ops in loop_mixes(disassembly[1]):
                print(f"  loop: {count} instructions per warp-tile, {ops}")


if __name__ == "__main__":
    main()
