"""How much text the key smoothing scales need: the smoothing rule (`oscar_hf.profile.ChannelPower`) on SmolLM2 from N
tokens of the first calibration play, and from 2,048 tokens of each other calibration play, against the scales of
8,192 tokens of the first play, both with a scale per channel and with the package's rule, one scale per RoPE pair.
The scales depend on the model's post-RoPE attention only, not on the rotations.

    python -m experiments.retrieval.smoothing_text [--out docs/results/smoothing-text.md]

Per source it prints the median and the 99th percentile over every (layer, KV head, channel) of |log2(s / s_ref)|
(0.05 is a 3.5% difference in a scale), and the largest ratio of two scales within a head (how far smoothing
reshapes a head at all).
"""

from __future__ import annotations

import argparse
import time

import torch

from oscar_hf.calibrate.capture import feed
from oscar_hf.eval.assets import CALIBRATION_PLAYS, load_model, play_tokens
from oscar_hf.profile import ChannelPower

LENGTHS = (128, 256, 512, 1024, 2048, 4096)
REFERENCE_TOKENS = 8192


def _flat(scales: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.cat([scales[layer].flatten() for layer in sorted(scales)])


def scales_of(model, ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """(a scale per channel, the package's scales: one per RoPE pair) from one pass over `ids`."""
    single, tied = ChannelPower(), ChannelPower.for_model(model)

    def both(*args) -> None:
        single(*args)
        tied(*args)

    feed(model, [ids], observer=both)
    return single.scales(), tied.scales()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = p.parse_args()
    start = time.time()
    model, tokenizer = load_model("smollm2", torch.float32, "cpu")
    first = CALIBRATION_PLAYS[0]
    reference, reference_tied = scales_of(model, play_tokens(tokenizer, first, REFERENCE_TOKENS))
    ref, ref_tied = _flat(reference).log2(), _flat(reference_tied).log2()
    spread = max(float(s.max() / s.min()) for s in reference.values())
    sources = [(f"{first}, {n} tokens", first, n) for n in LENGTHS]
    sources += [(f"{play}, 2048 tokens", play, 2048) for play in CALIBRATION_PLAYS[1:]]
    lines = ["| scales from | per channel: median abs(log2 s / s_ref) | 99th percentile | largest | "
             "per RoPE pair: median | 99th percentile | largest |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, play, tokens in sources:
        scales, tied = scales_of(model, play_tokens(tokenizer, play, tokens))
        cells = []
        for got, want in ((_flat(scales).log2(), ref), (_flat(tied).log2(), ref_tied)):
            error = (got - want).abs()
            cells += [f"{error.median():.3f}", f"{error.quantile(0.99):.3f}", f"{error.max():.3f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = "\n".join([
        "Command: `python -m experiments.retrieval.smoothing_text` (SmolLM2-135M-Instruct, float32, CPU; "
        f"{time.time() - start:.0f} s)", "",
        f"Reference: {REFERENCE_TOKENS} tokens of {first}; the largest ratio of two of its scales within a head is "
        f"{spread:.1f}.", "", *lines, ""])
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
