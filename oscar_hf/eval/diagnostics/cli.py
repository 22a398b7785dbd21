"""`oscar-diagnostics` (or `python -m oscar_hf.eval.diagnostics`): quality diagnostics of KV caches on a long
held-out text.

Example (SmolLM2-135M on CPU, King Lear, every method):

    oscar-diagnostics --model smollm2 --text lear_gut.txt --tokens 2048 --prefill 512 \
        --out out/quality --rotations /path/to/rotations   # omit --rotations: OSCAR rows use Hadamard
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
import transformers

from oscar_hf.eval.assets import load_model, play_tokens
from oscar_hf.eval.diagnostics.methods import DEFAULT_METHODS, builtin_methods
from oscar_hf.eval.diagnostics.report import write_report, write_results_json
from oscar_hf.eval.diagnostics.run import RunSettings, run_methods


def load_text_ids(tokenizer, text: str, tokens: int) -> torch.Tensor:
    """`[1, tokens]` ids of a Shakespeare play file name (oscar_hf.assets) or of a text file path."""
    if os.path.isfile(text):
        with open(text, encoding="utf-8", errors="replace") as f:
            ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, :tokens]
        if ids.shape[1] < tokens:
            raise ValueError(f"{text} has only {ids.shape[1]} tokens, {tokens} requested")
        return ids
    return play_tokens(tokenizer, text, tokens)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oscar-diagnostics", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help='"smollm2" (offline SmolLM2-135M) or a path / Hub id')
    p.add_argument("--rotations", default=None, help="calibrated rotations for the oscar rows (folder/file/Hub id)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, first must be bf16 (default: {','.join(DEFAULT_METHODS)})")
    p.add_argument("--text", default="lear_gut.txt", help="held-out play (oscar_hf.assets.EVALUATION_PLAYS) or a file")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--chunk", type=int, default=8,
                   help="forward size after the prefill for ppl/KL through the caches (8 = decode-exact here)")
    p.add_argument("--replay-chunk", type=int, default=8,
                   help="forward size of the per-layer replay (1 = decode; 8 = decode-exact here)")
    p.add_argument("--generate", type=int, default=32, help="greedy tokens for the agreement length (0: skip)")
    p.add_argument("--sink", type=int, default=None, help="OSCAR sink_tokens override")
    p.add_argument("--recent", type=int, default=None, help="OSCAR recent_tokens override")
    p.add_argument("--block", type=int, default=None, help="OSCAR demote_block override")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="out/diagnostics")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {k: v for k, v in (("sink_tokens", args.sink), ("recent_tokens", args.recent),
                                 ("demote_block", args.block)) if v is not None}
    available = builtin_methods(args.rotations, **options)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {sorted(available)}")
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), args.device)
    ids = load_text_ids(tokenizer, args.text, args.tokens).to(args.device)
    settings = RunSettings(tokens=args.tokens, prefill=args.prefill, chunk=args.chunk,
                           replay_chunk=args.replay_chunk, generate=args.generate, progress=not args.no_progress)
    command = "oscar-diagnostics " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    title = f"KV-cache quality: {args.model}, {args.text}, {args.tokens} tokens"
    meta = {**vars(settings), "model": args.model, "dtype": args.dtype, "rotations": args.rotations,
            "device": args.device, "transformers": transformers.__version__, "torch": torch.__version__, **options}

    def save_partial(results):
        write_results_json(results, args.out, command, meta)

    results = run_methods(model, ids, [available[n] for n in names], settings, on_result=save_partial)
    path = write_report(results, args.out, title, command, meta)
    print(open(path).read().split("\n## Per-layer")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
