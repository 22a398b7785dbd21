"""Issue #44's data-free question: rotations a model needs no text for, that still retrieve.

    python -m experiments.retrieval.data_free --out <folder> [--tokens 2048] [--seed 0] [--no-smooth-keys]
        [--no-ranking]

Writes `oscar_hf.profile.data_free_rotations(model)` (Hadamard rotations, key smoothing and induction rankings from
random tokens: what `OscarCache(model)` stores on), or an ablation without the smoothing or without the rankings,
then prints how the rankings overlap the needle-probe rankings of the calibrated files. Measure a folder with
`oscar-needles --rotations <folder> --methods oscar-mixed,oscar-next ...` (docs/retrieval.md).
"""

from __future__ import annotations

import argparse

from oscar_hf.eval.assets import load_model
from oscar_hf.profile import PROFILE_TOKENS, data_free_rotations
from oscar_hf.rotations import Rotations
from oscar_hf.rotations.rotations import RETRIEVAL_HEADS_KEY, RETRIEVAL_LAYERS_KEY


def overlap(first: list, second: list, top: int) -> int:
    """Entries the first `top` of two rankings share (layers, or (layer, KV head) pairs)."""
    return len({tuple(x) if isinstance(x, list) else x for x in first[:top]}
               & {tuple(x) if isinstance(x, list) else x for x in second[:top]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=PROFILE_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-smooth-keys", action="store_true", help="the rankings alone, no key smoothing")
    parser.add_argument("--no-ranking", action="store_true")
    parser.add_argument("--compare", nargs="*", default=["rotations/smollm2-135m-hadamard-smoothed",
                                                        "rotations/smollm2-135m-smoothed"])
    args = parser.parse_args()
    model, _ = load_model(args.model)
    rotations = data_free_rotations(model, args.tokens, args.seed, smooth_keys=not args.no_smooth_keys)
    if args.no_ranking:
        for key in (RETRIEVAL_LAYERS_KEY, RETRIEVAL_HEADS_KEY):
            rotations.metadata.pop(key, None)
    rotations.save_pretrained(args.out)
    layers, heads = rotations.retrieval_layers(), rotations.retrieval_heads()
    print(f"{args.out}: layers by induction {layers[:6]}, KV heads {heads[:6]}")
    for folder in args.compare:
        other = Rotations.from_pretrained(folder)
        print(f"  vs {folder}: top-3 layers share {overlap(layers, other.retrieval_layers(), 3)}, top-6 "
              f"{overlap(layers, other.retrieval_layers(), 6)}; top-9 KV heads share "
              f"{overlap(heads, other.retrieval_heads(), 9)}")


if __name__ == "__main__":
    main()
