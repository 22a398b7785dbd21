"""Passkey retrieval, generated locally: filler text with a random 5-digit key at a given depth, then greedy
generation through each cache (`retrieval.run_probes`); a probe is a hit when the key appears in the output. For
facts in real text, with distractors, see `needles`.

Prompt (the classic passkey template, built at the token level so every method sees the same ids):
  intro · filler × n (the needle after round(depth · n) fillers) · question
  needle = "The pass key is K. Remember it. K is the pass key. "
The haystack is cut so the prompt length is a multiple of `align` (32: the quanto KIVI-layout cache needs
prefixes that are multiples of its group size).

    oscar-passkey --model smollm2 --lengths 2048,4096,8160 --depths 0.1,0.5,0.9 --out out/passkey
"""

from __future__ import annotations

import argparse
import random

import torch

from oscar_hf.eval.cli_options import comma_separated, fraction, positive_int
from oscar_hf.eval.retrieval import Probe, add_common_arguments, run_cli

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


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
    start = len(intro) + at
    return Probe(len(ids), depth, key, torch.tensor([ids]), span=(start, start + len(needle)))


def make_probes(tokenizer, lengths, depths, seed: int = 0, align: int = 32) -> list[Probe]:
    rng = random.Random(seed)
    return [make_probe(tokenizer, length, depth, f"{rng.randint(10000, 99999)}", align)
            for length in lengths for depth in depths]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oscar-passkey", description=__doc__.split("\n\n")[0])
    add_common_arguments(p, out="out/passkey", max_new_tokens=8)
    p.add_argument("--lengths", type=comma_separated(positive_int, "2048,4096"), default="2048,4096,8160",
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", type=comma_separated(fraction, "0.1,0.5"), default="0.1,0.5,0.9",
                   help="where the key sits, as fractions of the filler, comma-separated")
    args = p.parse_args(argv)

    def make(tokenizer):
        return make_probes(tokenizer, args.lengths, args.depths, seed=args.seed)

    return run_cli(args, "oscar-passkey", argv, make, "Passkey retrieval", "passkey")


if __name__ == "__main__":
    raise SystemExit(main())
