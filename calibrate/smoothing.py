"""Per-channel key smoothing: the scales `s` that `Rotations(key_smoothing=...)` stores.

The history stores keys as `(k / s) @ R` and the query is rotated by `(q * s) @ R`, so a score `q . k` is unchanged
before quantization. After it, with the rounding error of a rotated row spread evenly over its channels, the error
of a score goes as `(sum_c q_c^2 s_c^2) * (sum_c k_c^2 / s_c^2)`, which is smallest (Cauchy-Schwarz) at
`s_c = sqrt(rms(k_c) / rms(q_c))`: the root mean squares of each post-RoPE key and query channel, per layer and KV
head (a GQA group's queries pooled), over calibration text. Each root mean square is taken over the channel's RoPE
pair, so both channels of a pair share a scale that does not depend on the positions measured (`ChannelPower`). The
scales of a head are normalized to a geometric mean of 1 (their overall size changes nothing). Measured in
`docs/retrieval.md` ("Per-channel key smoothing").

    python -m oscar_hf.calibrate.smoothing --model smollm2 --rotations <folder | hadamard> --out <folder>

then `python -m oscar_hf.calibrate.retrieval_layers --model smollm2 --rotations <folder>` ranks the heads under the
smoothed keys (a ranking made without them picks other heads).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable, Sequence

import torch
from transformers.utils import logging

from oscar_hf.calibrate.capture import feed
from oscar_hf.eval.assets import CALIBRATION_PLAYS
from oscar_hf.profile import SMOOTHING_RULE, ChannelPower
from oscar_hf.rotations.io import SAFETENSORS_NAME
from oscar_hf.rotations.rotations import Rotations

logger = logging.get_logger(__name__)

# Tokens of the first calibration play the scales are measured on. Most scales settle by then, but those of slow
# RoPE channels keep moving with the length (the rotation shares a pair's energy between its two channels only over
# enough positions), so longer text suits longer contexts (docs/retrieval.md, "How much text the scales need")
DEFAULT_TOKENS = 2048


def key_smoothing(model, sequences: Iterable[torch.Tensor], chunk_tokens: int = 2048,
                  progress: bool | str = False) -> dict[int, torch.Tensor]:
    """`{layer: [Hkv, d]}` key smoothing scales (module docstring) from the model's attention over `sequences`
    (token id tensors `[1, L]` or `[B, L]`), for every layer whose attention goes through transformers'
    interface."""
    power = ChannelPower.for_model(model)
    feed(model, sequences, chunk_tokens=chunk_tokens, progress=progress, observer=power)
    return power.scales()


def smooth_keys(rotations: Rotations, model, sequences: Sequence[torch.Tensor], text: str,
                chunk_tokens: int = 2048, progress: bool | str = False) -> Rotations:
    """`rotations` with the key smoothing of `key_smoothing` over `sequences` for the layers they rotate, the rule,
    the token count and `text` (where the sequences come from) recorded in the metadata."""
    return attach_key_smoothing(rotations, key_smoothing(model, sequences, chunk_tokens, progress), sequences, text)


def attach_key_smoothing(rotations: Rotations, scales: dict[int, torch.Tensor], sequences: Sequence[torch.Tensor],
                         text: str) -> Rotations:
    """`rotations` with `scales` for the layers they rotate, and the rule, the token count of `sequences` and
    `text` recorded in the metadata."""
    description = json.dumps({"rule": SMOOTHING_RULE,
                              "tokens": sum(ids.shape[-1] for ids in sequences), "text": text})
    return rotations.with_key_smoothing({i: s for i, s in scales.items() if i in rotations.key}, description)


def main(argv: list[str] | None = None) -> int:
    from oscar_hf.eval.assets import load_model, play_tokens
    from oscar_hf.eval.cli_options import add_model_arguments, add_progress_argument, resolve_device, resolve_dtype
    from oscar_hf.model_support import attention_shape

    p = argparse.ArgumentParser(prog="python -m oscar_hf.calibrate.smoothing",
                                description="Add per-channel key smoothing to a model's rotations.")
    add_model_arguments(p)
    p.add_argument("--rotations", required=True, help='a rotations folder or "hadamard"')
    p.add_argument("--out", required=True, help="folder to write the smoothed rotations to")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens of the first calibration play to measure on (default {DEFAULT_TOKENS})")
    add_progress_argument(p)
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error(f"--tokens {args.tokens} must be at least 1")
    start = time.time()
    fitted = None if args.rotations == "hadamard" else Rotations.from_pretrained(args.rotations)
    objective = fitted.metadata.get("key_objective", "hadamard") if fitted is not None else "hadamard"
    if objective != "hadamard":
        # smoothing added after the fit leaves a key rotation fitted to the raw keys and queries, which the history
        # no longer holds: on SmolLM2 that cost 5 of 13 needles (docs/retrieval.md, "The calibrated default")
        logger.warning(f"{args.rotations}: the key rotation was fitted ({objective}) to unsmoothed keys; smoothing "
                       "them now leaves it fitted to keys the history does not hold. Fit and smooth together with "
                       "oscar-calibrate (it smooths by default), or smooth Hadamard rotations here.")
    model, tokenizer = load_model(args.model, resolve_dtype(args.dtype), resolve_device(args.device))
    shape = attention_shape(model.config)
    if fitted is None:
        rotations = Rotations.hadamard(shape.oscar_layer_ids, shape.head_dim)
        rotations.metadata.update(model=args.model, objective="hadamard")
    else:
        rotations = fitted
    text = play_tokens(tokenizer, CALIBRATION_PLAYS[0], args.tokens)
    smoothed = smooth_keys(rotations, model, [text], CALIBRATION_PLAYS[0], progress=not args.no_progress)
    smoothed.save_pretrained(args.out)
    scales = smoothed.key_smoothing
    spread = max(float(s.max() / s.min()) for s in scales.values())
    print(f"key smoothing for {len(scales)} layers (largest ratio of two scales in a head: {spread:.1f}); wrote "
          f"{os.path.join(args.out, SAFETENSORS_NAME)} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
