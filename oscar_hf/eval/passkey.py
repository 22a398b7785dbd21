"""Passkey retrieval (needle in a haystack), generated locally: filler text with a random 5-digit key at a given
depth, then greedy generation through each cache; a probe is a hit when the key appears in the output.

Prompt (the classic passkey template, built at the token level so every method sees the same ids):
  intro · filler × n (the needle after round(depth · n) fillers) · question
  needle = "The pass key is K. Remember it. K is the pass key. "
The haystack is cut so the prompt length is a multiple of `align` (32: the quanto KIVI-layout cache needs
prefixes that are multiples of its group size).

    oscar-passkey --model smollm2 --lengths 2048,4096,8160 --depths 0.1,0.5,0.9 --out out/passkey
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class Probe:
    length: int  # prompt tokens
    depth: float
    key: str
    input_ids: torch.Tensor  # [1, length]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def make_probe(tokenizer, target_length: int, depth: float, key: str, align: int = 32) -> Probe:
    """A prompt of exactly `target_length - target_length % align` tokens with `key` at `depth` in [0, 1].

    The haystack is the filler sentence repeated and cut to length (it may end mid-sentence); the needle goes
    in at the filler boundary nearest to `depth`.
    """
    intro, filler, needle, question = (_ids(tokenizer, t) for t in (INTRO, FILLER, NEEDLE.format(key=key), QUESTION))
    length = target_length - target_length % align
    haystack = length - len(intro) - len(needle) - len(question)
    if haystack < len(filler):
        raise ValueError(f"target_length={target_length} leaves no room for filler")
    stream = (filler * (haystack // len(filler) + 1))[:haystack]
    at = round(depth * haystack / len(filler)) * len(filler)
    at = min(at, haystack - haystack % len(filler))
    ids = intro + stream[:at] + needle + stream[at:] + question
    return Probe(len(ids), depth, key, torch.tensor([ids]))


def make_probes(tokenizer, lengths, depths, seed: int = 0, align: int = 32) -> list[Probe]:
    rng = random.Random(seed)
    return [make_probe(tokenizer, length, depth, f"{rng.randint(10000, 99999)}", align)
            for length in lengths for depth in depths]


@dataclass
class ProbeResult:
    method: str
    length: int
    depth: float
    key: str
    output: str
    hit: bool
    seconds: float


def run_passkey(model, tokenizer, probes: list[Probe], methods, max_new_tokens: int = 8, shared_prefill: bool = True,
                progress: bool = True) -> list[ProbeResult]:
    """Greedy-generate `max_new_tokens` after each probe through a fresh cache of every method."""
    from oscar_hf.eval.diagnostics.generation import full_precision_prefill, greedy_through_cache

    results = []
    device = next(model.parameters()).device
    bar = tqdm(total=len(probes) * len(methods), desc="passkey", disable=not progress)
    for probe in probes:
        prompt = probe.input_ids.to(device)
        prefill = full_precision_prefill(model, prompt) if shared_prefill else None
        for method in methods:
            start = time.time()
            try:
                tokens = greedy_through_cache(model, method.build(model), max_new_tokens, prefill=prefill,
                                              prompt=prompt)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
            except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
                text = f"<error {type(e).__name__}: {e}>"
            results.append(ProbeResult(method.name, probe.length, probe.depth, probe.key, text,
                                       probe.key in text, time.time() - start))
            bar.update(1)
        del prefill
    bar.close()
    return results


def summary_table(results: list[ProbeResult], labels: dict[str, str]) -> str:
    lengths = sorted({r.length for r in results})
    methods = list(dict.fromkeys(r.method for r in results))
    header = "| method | " + " | ".join(f"{n} tok" for n in lengths) + " | total |"
    lines = [header, "|" + "---|" * (len(lengths) + 2)]
    for m in methods:
        rows = [r for r in results if r.method == m]
        cells = []
        for n in lengths:
            at = [r for r in rows if r.length == n]
            cells.append(f"{sum(r.hit for r in at)}/{len(at)}")
        lines.append(f"| {labels.get(m, m)} | " + " | ".join(cells) + f" | {sum(r.hit for r in rows)}/{len(rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from oscar_hf.eval.assets import load_model
    from oscar_hf.eval.diagnostics.methods import DEFAULT_METHODS, builtin_methods

    p = argparse.ArgumentParser(prog="oscar-passkey", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rotations", default=None)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--lengths", default="2048,4096,8160")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--no-shared-prefill", action="store_true", help="plain generate (one prefill per method)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="out/passkey")
    args = p.parse_args(argv)
    available = builtin_methods(args.rotations)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {sorted(available)}")
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), args.device)
    methods = [available[n] for n in names]
    probes = make_probes(tokenizer, [int(x) for x in args.lengths.split(",")],
                         [float(x) for x in args.depths.split(",")], seed=args.seed)
    start = time.time()
    results = run_passkey(model, tokenizer, probes, methods, args.max_new_tokens, not args.no_shared_prefill)
    elapsed = time.time() - start
    os.makedirs(args.out, exist_ok=True)
    command = "oscar-passkey " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    with open(os.path.join(args.out, "passkey.json"), "w") as f:
        json.dump({"command": command, "seconds": elapsed, "results": [asdict(r) for r in results]}, f, indent=1)
    table = summary_table(results, {m.name: m.label for m in methods})
    with open(os.path.join(args.out, "passkey.md"), "w") as f:
        f.write(f"# Passkey retrieval\n\nCommand: `{command}` ({elapsed:.0f} s)\n\n{table}\n\n"
                "| method | length | depth | key | output |\n|---|---|---|---|---|\n")
        for r in results:
            f.write(f"| {r.method} | {r.length} | {r.depth} | {r.key} | {r.output.strip()!r} |\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
