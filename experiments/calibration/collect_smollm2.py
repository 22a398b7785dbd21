"""Collect every calibration moment of SmolLM2-135M on the Shakespeare calibration plays, for several `Tiers`.

Usage: python -m experiments.calibration.collect_smollm2 --tokens 20480 --context 2048 --out out/moments_20k.pt
One forward pass feeds all tier settings at once (a fan-out observer); a second pass makes the `sst` moment.
`--moments query key value` and `--tiers all` restrict the work (the softmax moments cost the most).
"""

import argparse
import time

import torch

from oscar_hf.calibrate.capture import feed
from oscar_hf.calibrate.data import load_documents, token_sequences
from oscar_hf.calibrate.pipeline import calibration_layers
from oscar_hf.calibrate.statistics import MOMENTS, MomentCollector, Tiers
from oscar_hf.eval.assets import load_smollm2

TIER_SETTINGS = {"all": Tiers(), "tiered": Tiers(sink=64, recent=256)}


def fan_out(collectors):
    def observe(*args):
        for c in collectors:
            c(*args)
    return observe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--data", default="shakespeare:calibration")
    parser.add_argument("--moments", nargs="+", default=list(MOMENTS), choices=MOMENTS)
    parser.add_argument("--tiers", nargs="+", default=list(TIER_SETTINGS), choices=list(TIER_SETTINGS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    sequences = token_sequences(tokenizer, load_documents(args.data), args.tokens, args.context)
    layers, kv_heads, head_dim = calibration_layers(model)
    first = (set(args.moments) - {"sst"}) | ({"query"} if "sst" in args.moments else set())
    start = time.time()
    collectors = {name: MomentCollector(layers, kv_heads, head_dim, first, TIER_SETTINGS[name]) for name in args.tiers}
    feed(model, sequences, args.chunk_tokens, progress="pass 1", total_tokens=args.tokens,
         observer=fan_out(list(collectors.values())))
    pass1 = time.time() - start
    result = {name: {m: c.means(m) for m in first} for name, c in collectors.items()}
    if "sst" in args.moments:
        second = {name: MomentCollector(layers, kv_heads, head_dim, {"sst"}, TIER_SETTINGS[name],
                                        query_moments=result[name]["query"]) for name in collectors}
        feed(model, sequences, args.chunk_tokens, progress="pass 2", total_tokens=args.tokens,
             observer=fan_out(list(second.values())))
        for name, c in second.items():
            result[name]["sst"] = c.means("sst")
    elapsed = time.time() - start
    torch.save({"moments": result, "tokens": sum(s.shape[1] for s in sequences), "sequences": len(sequences),
                "context": args.context, "data": args.data, "seconds": elapsed, "pass1_seconds": pass1}, args.out)
    print(f"{len(sequences)} sequences, {sum(s.shape[1] for s in sequences)} tokens; pass 1 {pass1:.0f} s, total {elapsed:.0f} s")


if __name__ == "__main__":
    main()
