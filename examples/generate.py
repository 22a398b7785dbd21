"""Generate from SmolLM2-135M with a long prompt through OscarCache (CPU by default).

    python examples/generate.py [--rotations PATH_OR_REPO|hadamard] [--method ...] [--prompt-tokens 1500]
                                [--device cuda]

On a GPU this one call decodes eagerly (each layer's attention replayed from CUDA graphs): `generate` compiles the
decode step by itself only once a model's eager steps have cost what a compile does (`oscar_hf.compile_policy`).

The prompt is a scene of King Lear followed by a question; most of it ends up in the INT2 history. The default
rotations are the calibrated SmolLM2 ones with smoothed keys and a retrieval ranking, shipped in
`rotations/smollm2-135m-smoothed` (made by `oscar-calibrate`), so the cache is the ranked 2-bit default `oscar-next`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import DynamicCache

from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name
from oscar_hf.config import PRESETS
from oscar_hf.eval.assets import load_smollm2, play_text

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rotations", "smollm2-135m-smoothed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default=None, choices=sorted(PRESETS),
                        help="the preset (default: inferred from --rotations: oscar-next for the shipped ones, "
                             "whose KV heads are ranked by retrieval, and for 'hadamard', on the model's data-free "
                             "profile)")
    parser.add_argument("--rotations", default=SHIPPED if os.path.isdir(SHIPPED) else "hadamard",
                        help="'hadamard', 'identity', a folder or a Hub repo id (default: the shipped SmolLM2 ones)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.to(args.device)
    scene = tokenizer.decode(tokenizer(play_text("lear_gut.txt")).input_ids[: args.prompt_tokens])
    messages = [{"role": "user", "content": scene + "\n\nWho are the daughters of King Lear in this text?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"].to(args.device)
    name = cache_argument_name(model)

    outputs = {}
    for label, cache in (("BF16 DynamicCache", DynamicCache(config=model.config)),
                         ("OscarCache", OscarCache(model, rotations=args.rotations, method=args.method))):
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **{name: cache})
        seconds = time.perf_counter() - start
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        outputs[label] = text
        print(f"\n== {label} ({seconds:.1f} s) ==\n{text.strip()}")
    print(f"\n{cache!r}")
    print(f"layer 0 tiers: {cache.layers[0]!r}")
    dense = cache.bits_per_element() and 32 / cache.bits_per_element()
    print(f"stored: {cache.nbytes() / 2**20:.2f} MiB, {cache.bits_per_element():.2f} bits per K/V element "
          f"({dense:.1f}x smaller than the float32 DynamicCache)")
    same = outputs["BF16 DynamicCache"] == outputs["OscarCache"]
    print(f"identical to BF16: {same}")


if __name__ == "__main__":
    main()
