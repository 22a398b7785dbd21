"""One layer's attention for a chunk of queries (chunked prefill) over a 2-bit history: OSCAR's kernels at several
launch configurations against PyTorch SDPA over the same K/V in BF16.

    python -m bench.prefill_attention [--contexts 32768,100000] [--batch 4] [--chunks 8192] [--mask] [--out F.json]
    python -m bench.prefill_attention --smoke      # tiny shapes on the CPU, through Triton's interpreter

A chunk's rows (query position x head of the GQA group) come in row blocks, and every block reads and dequantizes
the whole history again (`LaunchConfig.many_rows_block_m`), so the block size sets how often a chunked prefill
(`generate(..., prefill_chunk_size=N)`) reads the history; the winner is `launch_plan.MANY_ROWS_LAUNCH`. Shape:
Qwen3-8B's 32 query / 8 KV heads, head_dim 128; the layer holds 64 sink + 256 recent tokens in BF16, the rest of
`context` as history, and the chunk's own `chunk` tokens, causal among themselves. Times: medians of
`triton.testing.do_bench` (GPU time). `--smoke` checks each configuration's output against the reference backend
instead of timing it. `--mask` passes the causal mask as a `[B, 1, q, kv]` bool tensor, as transformers builds it for
a padded batch (an unpadded chunk gets none: `oscar_hf.attention.oscar_mask`). The row "the kernel over BF16 K/V"
runs the backend's own choice over the whole context in BF16 (no history to dequantize): against SDPA it is what the
Triton attention itself costs, and against the 2-bit rows what dequantizing them costs. `--quick` times that row and
the backend's choice only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: its interpreter runs the kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import harness  # noqa: E402
from bench.harness import KV_HEADS, Q_HEADS, SINK, Case  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.triton.backend import TritonBackend  # noqa: E402
from oscar_hf.kernels.triton.launch_plan import LaunchConfig, default_launch  # noqa: E402

DIM = 128
DEFAULT_ROW = "default (the backend's choice)"
DENSE_ROW = "the kernel over BF16 K/V (backend's choice)"  # `Chunk.dense`: no history to dequantize
UNPACKED_ROW = "history unpacked in every row block"  # the backend's launch, without dequantizing pieces first
DEQUANTIZED_ROW = "history dequantized in pieces first"  # whatever the chunk's length (`dequantize_from_rows=1`)


def candidates() -> dict[str, dict]:
    """name -> the `TritonBackend` options it runs with (none: the backend's own choice). Every row but the
    default's unpacks the history in each row block (`dequantize_from_rows=None`), at its launch configuration."""
    unpacked = dict(cuda_history=False, dequantize_from_rows=None)
    out = {DEFAULT_ROW: {}, UNPACKED_ROW: dict(dequantize_from_rows=None),
           DEQUANTIZED_ROW: dict(dequantize_from_rows=1),
           "decode launch (16-row blocks)": dict(unpacked, launch=default_launch(DIM))}
    for block in (32, 64, 128):
        for warps in (4, 8):
            for token_major in (False, True):
                name = f"rows {block}, {warps} warps, {'token' if token_major else 'row'}-major"
                out[name] = dict(unpacked, launch=LaunchConfig(
                    block_n_history=64, num_warps=warps, block_m=8 if token_major else 16, token_major=token_major,
                    many_rows_block_m=block))
    return out


class Chunk:
    """A `chunk`-query forward of one layer whose history holds `context` tokens (`bench.harness.Case`)."""

    def __init__(self, batch: int, context: int, chunk: int, backend: TritonBackend, mask: bool = False):
        self.case = Case(batch, context, DIM, backend)
        dev, bf16 = self.case.keys.device, torch.bfloat16
        self.query = torch.randn(batch, Q_HEADS, chunk, DIM, device=dev, dtype=bf16)
        new_k = torch.randn(batch, KV_HEADS, chunk, DIM, device=dev, dtype=bf16)
        new_v = torch.randn(batch, KV_HEADS, chunk, DIM, device=dev, dtype=bf16)
        # the dense tiers: sink + recent (Case's, less its one new token) + the chunk's own tokens
        self.keys = torch.cat([self.case.dense_keys[:, :, :-1], new_k], 2).contiguous()
        self.values = torch.cat([self.case.dense_values[:, :, :-1], new_v], 2).contiguous()
        self.all_keys = torch.cat([self.case.keys[:, :, :-1], new_k], 2)  # SDPA's: the history in BF16
        self.all_values = torch.cat([self.case.values[:, :, :-1], new_v], 2)
        self.mask = None
        if mask:
            from oscar_hf.kernels.reference.attention import causal_mask

            kv = self.all_keys.shape[2]
            self.mask = causal_mask(chunk, kv, dev).expand(batch, 1, chunk, kv)

    def oscar(self, backend):
        c = self.case
        return backend.tiered_attention(self.query, self.keys, self.values, self.mask, c.tensors, SINK, c.rotation,
                                        c.rotation, DIM**-0.5)

    def reference(self):
        c = self.case
        return ReferenceBackend().tiered_attention(self.query, self.keys, self.values, self.mask, c.tensors, SINK,
                                                   c.rotation, c.rotation, DIM**-0.5)

    def dense(self, backend):
        """The same attention with every key and value in BF16, as the BF16 tiers (no history)."""
        keys, values = self.all_keys.contiguous(), self.all_values.contiguous()
        return backend.tiered_attention(self.query, keys, values, self.mask, None, 0, None, None, DIM**-0.5)

    def sdpa(self):
        from torch.nn.attention.bias import causal_lower_right

        groups = Q_HEADS // KV_HEADS
        k = self.all_keys.repeat_interleave(groups, 1)
        v = self.all_values.repeat_interleave(groups, 1)
        mask = causal_lower_right(self.query.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(self.query, k, v, attn_mask=mask, scale=DIM**-0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="32768,100000")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--chunks", default="8192", help="query chunk lengths, comma-separated")
    p.add_argument("--mask", action="store_true", help="the causal mask as a tensor (a padded batch's path)")
    p.add_argument("--quick", action="store_true", help="the backend's choice, the two history routes "
                   "forced, and the kernel over BF16 K/V only")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: outputs checked, nothing timed")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.smoke:
        from oscar_hf.kernels.triton.interpreter import kernel_device

        harness.DEVICE = str(kernel_device())  # "cpu", with the interpreter's loop-bound workaround in place
        contexts, args.batch, args.chunks = [SINK + 256 + 64], 1, "16"
    rows = []
    print("| context | batch | chunk | configuration | ms | vs SDPA |" if not args.smoke else
          "| context | batch | chunk | configuration | max abs error vs reference |")
    print("|---:|---:|---:|---|---:|---:|" if not args.smoke else "|---:|---:|---:|---|---:|")
    for context, length in [(c, int(n)) for c in contexts for n in args.chunks.split(",")]:
        chunk = Chunk(args.batch, context, length, TritonBackend(), mask=args.mask)
        if args.smoke:
            want = chunk.reference().float()
        else:
            from triton.testing import do_bench

            sdpa_ms = do_bench(chunk.sdpa, warmup=5, rep=50, return_mode="median")
            rows.append(dict(context=context, batch=args.batch, chunk=length, config="SDPA (BF16 K/V)",
                             ms=sdpa_ms, mask=args.mask))
            print(f"| {context} | {args.batch} | {length} | SDPA over BF16 K/V | {sdpa_ms:.2f} | 1.00 |",
                  flush=True)
        configurations = candidates()
        if args.quick:
            configurations = {name: configurations[name] for name in (DEFAULT_ROW, UNPACKED_ROW, DEQUANTIZED_ROW)}
        configurations[DENSE_ROW] = {}
        for name, options in configurations.items():
            backend = TritonBackend(**options)
            run = (lambda b=backend: chunk.dense(b)) if name == DENSE_ROW else (lambda b=backend: chunk.oscar(b))
            row = dict(context=context, batch=args.batch, chunk=length, config=name, mask=args.mask)
            try:
                if args.smoke:
                    expected = chunk.dense(ReferenceBackend()).float() if name == DENSE_ROW else want
                    row["max_abs_error"] = (run().float() - expected).abs().max().item()
                    print(f"| {context} | {args.batch} | {length} | {name} | {row['max_abs_error']:.2e} |")
                else:
                    row["ms"] = do_bench(run, warmup=5, rep=50, return_mode="median")
                    print(f"| {context} | {args.batch} | {length} | {name} | {row['ms']:.2f} | "
                          f"{row['ms'] / sdpa_ms:.2f} |", flush=True)
            except Exception as error:  # a configuration the GPU cannot hold (shared memory, registers)
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                print(f"| {context} | {args.batch} | {length} | {name} | {row['error']} | |", flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
