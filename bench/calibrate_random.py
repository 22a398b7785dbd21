"""Save a random-weight model of a real model's attention shapes beside a tokenizer, for timing `oscar-calibrate`.

    python -m bench.calibrate_random --tokenizer TOKENIZER_DIR --out MODEL_DIR [--layers 36] [--smoke]
    oscar-calibrate --model MODEL_DIR --data text.txt --tokens 20000 --clip-search layer --dtype bfloat16 --out R/

Calibration speed does not depend on weight values (the rotations of a random model mean nothing): this measures
the pipeline's time and memory on a GPU at Qwen3-8B shapes, with the tokenizer's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch

from bench.harness import QWEN3_8B, random_qwen3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="folder with tokenizer.json / tokenizer_config.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=QWEN3_8B["num_hidden_layers"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()

    vocab = json.load(open(os.path.join(args.tokenizer, "tokenizer.json")))["model"]["vocab"]
    options = dict(QWEN3_8B, num_hidden_layers=args.layers, vocab_size=len(vocab) + 64, bos_token_id=1, eos_token_id=2)
    if args.smoke:
        options.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = random_qwen3(options, device)
    model.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(args.tokenizer, name)):
            shutil.copy(os.path.join(args.tokenizer, name), args.out)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B random parameters to {args.out}")


if __name__ == "__main__":
    main()
