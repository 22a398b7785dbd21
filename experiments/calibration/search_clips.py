"""Clip-ratio search for one rotation configuration of SmolLM2-135M on held-out *calibration* text.

The statistics of collect_smollm2.py come from the first tokens of the calibration plays (Hamlet); the search uses
Macbeth, a calibration play the statistics never saw, and never the evaluation plays.

  python -m experiments.calibration.search_clips --moments out/moments_20k.pt --config qqt/sst/shared/all \
      --per-layer --out out/clips_ref_layer.json
"""

import argparse
import json
import time

from experiments.calibration.evaluate_smollm2 import build, load_moments
from oscar_hf.calibrate.clip_search import clip_grid, search_clip_ratios
from oscar_hf.calibrate.data import Document, token_sequences
from oscar_hf.calibrate.pipeline import calibration_layers
from oscar_hf.eval.assets import load_smollm2, play_text


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moments")
    parser.add_argument("--config", required=True)
    parser.add_argument("--per-layer", action="store_true")
    parser.add_argument("--play", default="macbeth_gut.txt")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--lowest", type=float, default=0.75)
    parser.add_argument("--query-stride", type=int, default=4)
    parser.add_argument("--encoder", default="minmax", choices=["minmax", "lloyd"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    layers, kv_heads, head_dim = calibration_layers(model)
    moments = load_moments([args.moments] if args.moments else [])
    rotations = build(args.config, moments, layers, kv_heads, head_dim)[0]
    sequences = token_sequences(tokenizer, [Document(text=play_text(args.play))], args.tokens, args.context)
    start = time.time()
    grid = clip_grid(head_dim, args.lowest)
    choice = search_clip_ratios(model, sequences, rotations, layers, head_dim, per_layer=args.per_layer,
                                key_grid=grid, value_grid=grid, default_value_clip=0.92, progress=True,
                                query_stride=args.query_stride, encoder=args.encoder)
    result = {"key": choice.key, "value": choice.value, "errors": choice.errors, "args": vars(args),
              "seconds": time.time() - start}
    json.dump(result, open(args.out, "w"), indent=1)
    print("key", choice.key)
    print("value", choice.value)
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
