"""`oscar-diagnostics` (or `python -m oscar_hf.eval.diagnostics`): quality diagnostics of KV caches on a long
held-out text.

Examples (SmolLM2-135M on CPU, King Lear):

    oscar-diagnostics --quick                              # about a minute: hadamard vs BF16 on 512 tokens
    oscar-diagnostics --model smollm2 --text lear_gut.txt --tokens 2048 --prefill 512 --out out/quality \\
        --rotations /path/to/rotations                     # every method; without --rotations the OSCAR rows
                                                           # are hadamard and hadamard4 (data-free)

Methods are named as everywhere in oscar-hf: the `OscarConfig` presets (`oscar_hf.config.PRESETS`), `hadamard4`,
`oscar4`, `bf16` and the peer caches (`oscar_hf.eval.diagnostics.methods`). The BF16 reference row is always
computed, once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
import transformers
from transformers.utils import logging

from oscar_hf.eval.assets import load_model, play_tokens, shakespeare_folder
from oscar_hf.eval.cli_options import (
    add_logging_argument,
    add_model_arguments,
    add_progress_argument,
    check_rotations,
    configure_logging,
    non_negative_int,
    positive_int,
    resolve_device,
    resolve_dtype,
    timed,
)
from oscar_hf.eval.diagnostics.methods import ROTATION_METHODS, builtin_methods, select_methods
from oscar_hf.eval.diagnostics.report import terminal_table, write_report, write_results_json
from oscar_hf.eval.diagnostics.run import RunSettings, run_methods

logger = logging.get_logger(__name__)

# what a run measures when no option says otherwise: every method, decode-exact chunks, the simulation
FULL = dict(methods=None, tokens=2048, prefill=512, chunk=8, replay_chunk=8, generate=32, simulate=True)
# `--quick`: about a minute on a CPU for SmolLM2 (docs/quality.md has the measured time). 512 tokens, 128 of them
# scored after a 384-token prefill that already holds 64 history tokens under the default layout (64 sink + 256
# recent); chunks of 32 (not decode-exact: a query may see up to 31 more recent tokens in BF16), no simulation
# (it repeats the through-cache numbers), no greedy continuation (about 2 s a token through the CPU reference).
QUICK = dict(methods="hadamard", tokens=512, prefill=384, chunk=32, replay_chunk=32, generate=0, simulate=False)


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
    p = argparse.ArgumentParser(prog="oscar-diagnostics", description=__doc__.split("\n\n")[0],
                                epilog=f"Methods: {', '.join(builtin_methods())}.")
    add_model_arguments(p, default_model="smollm2")
    p.add_argument("--quick", action="store_true",
                   help="a one-minute check: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()
                                                           if k != "simulate") + ", no simulation (each overridable)")
    p.add_argument("--rotations", default=None,
                   help="calibrated rotations (folder/file/Hub id, or 'hadamard') for "
                        f"{', '.join(ROTATION_METHODS)}; those methods need them")
    p.add_argument("--methods", default=None,
                   help="comma-separated method names (default: bf16, the ablations, the OSCAR rows and the peers)")
    p.add_argument("--text", default="lear_gut.txt", help="held-out play (oscar_hf.assets.EVALUATION_PLAYS) or a file")
    p.add_argument("--tokens", type=positive_int, default=None, help=f"text length (default: {FULL['tokens']})")
    p.add_argument("--prefill", type=positive_int, default=None, help=f"prefill tokens (default: {FULL['prefill']})")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="forward size after the prefill for ppl/KL through the caches (default: 8, decode-exact here)")
    p.add_argument("--replay-chunk", type=positive_int, default=None,
                   help="forward size of the per-layer replay (1 = decode; default: 8, decode-exact here)")
    p.add_argument("--generate", type=non_negative_int, default=None,
                   help=f"greedy tokens for the agreement length (0: skip; default: {FULL['generate']})")
    p.add_argument("--simulation", action=argparse.BooleanOptionalAction, default=None,
                   help="the decode-equivalent simulation of the OSCAR rows (default: on; off with --quick)")
    p.add_argument("--sink", type=non_negative_int, default=None, help="OSCAR sink_tokens override")
    p.add_argument("--recent", type=non_negative_int, default=None, help="OSCAR recent_tokens override")
    p.add_argument("--block", type=positive_int, default=None, help="OSCAR demote_block override")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", default=None, help="output folder (default: out/diagnostics, out/diagnostics-quick)")
    add_progress_argument(p)
    add_logging_argument(p)
    return p


def resolve_settings(args: argparse.Namespace) -> dict:
    """The run's settings: each option given, else the `--quick` or full default."""
    defaults = QUICK if args.quick else FULL
    chosen = {k: getattr(args, k) for k in ("methods", "tokens", "prefill", "chunk", "replay_chunk", "generate")}
    chosen["simulate"] = args.simulation
    return {k: defaults[k] if v is None else v for k, v in chosen.items()}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    configure_logging(args.verbosity)
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = resolve_settings(args)
    options = {k: v for k, v in (("sink_tokens", args.sink), ("recent_tokens", args.recent),
                                 ("demote_block", args.block)) if v is not None}
    try:  # every argument is checked before the model loads
        methods = select_methods(chosen["methods"], args.rotations, **options)
        check_rotations(args.rotations)
    except ValueError as error:
        p.error(str(error))
    if not os.path.isfile(args.text) and not os.path.isfile(os.path.join(shakespeare_folder(), args.text)):
        p.error(f"--text {args.text!r} is neither a file nor a play of the corpus (e.g. lear_gut.txt)")
    if not 0 < chosen["prefill"] < chosen["tokens"] - 1:
        p.error(f"--prefill {chosen['prefill']} must leave tokens to score in --tokens {chosen['tokens']}")
    device = resolve_device(args.device)
    out = args.out or ("out/diagnostics-quick" if args.quick else "out/diagnostics")
    with timed(f"loading {args.model}", logger):
        model, tokenizer = load_model(args.model, resolve_dtype(args.dtype), device)
    ids = load_text_ids(tokenizer, args.text, chosen["tokens"]).to(device)
    settings = RunSettings(tokens=chosen["tokens"], prefill=chosen["prefill"], chunk=chosen["chunk"],
                           replay_chunk=chosen["replay_chunk"], generate=chosen["generate"],
                           progress=not args.no_progress, simulate=chosen["simulate"])
    command = "oscar-diagnostics " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    title = f"KV-cache quality: {args.model}, {args.text}, {settings.tokens} tokens"
    meta = {**vars(settings), "model": args.model, "dtype": args.dtype, "rotations": args.rotations,
            "device": device, "transformers": transformers.__version__, "torch": torch.__version__, **options}

    def save_partial(results):
        write_results_json(results, out, command, meta, title)

    names = ", ".join(m.name for m in methods if m.name != "bf16")
    if not args.quick:
        logger.info("%d method(s) after the BF16 reference, %d tokens (oscar-diagnostics --quick: a one-minute check)",
                    sum(m.name != "bf16" for m in methods), settings.tokens)
    with timed(f"BF16 reference and {names or 'nothing else'} on {settings.tokens} tokens", logger):
        results = run_methods(model, ids, methods, settings, on_result=save_partial)
    path = write_report(results, out, title, command, meta)
    print(terminal_table(results))
    logger.info("report: %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
