"""Evaluate rotation sets on held-out Shakespeare (EVALUATION_PLAYS) with SmolLM2-135M.

  proxy: per-layer attention-score KL and attention-output relative MSE (oscar_hf.calibrate.attention_error), one BF16
         forward per sequence, every configuration measured on the same inputs;
  ppl:   perplexity, next-token KL vs BF16 and top-1 agreement through OscarCache (oscar_hf.eval.perplexity.compare_caches,
         prefill 512 then chunks of 64), plus the cache's stored bits per element.

Configurations are named `<key objective>/<value objective>/<shared|head>/<all|tiered>` from a moments file of
collect_smollm2.py (`<set>.<all|tiered>` for a file given as `--moments <set>=<path>`),
or `hadamard`, `quarot`, `identity`, or `file:<folder>`; `@k=<ratio>,v=<ratio>` overrides the
clip ratios (`none` = no clip), `@clips=<json file>` applies a clip choice of search_clips.py, `@meta` the one recorded in a `file:` folder; a trailing
`+lloyd` / `+gaussian_lm` swaps the row encoder (oscar_hf.calibrate.encoders; same stored format), `+konly` / `+vonly`
(proxy only) quantizes one side, `+balanced` / `+balanced0.5` stores keys through the experimental
non-orthogonal transform of oscar_hf.calibrate.transforms (per KV head, from the configuration's moments, full or half
strength; in the cache via a patched backend whose history attention uses the query-side transform).

  python -m experiments.calibration.evaluate_smollm2 --moments out/moments_20k.pt --mode proxy \
      --configs hadamard identity qqt/sst/shared/all --plays lear_gut.txt --tokens 2048 --out out/proxy.json
"""

import argparse
import json
import time

import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, Rotations
from oscar_hf.calibrate.attention_error import AttentionErrorProbe, Candidate
from oscar_hf.calibrate.capture import feed
from oscar_hf.calibrate.clip_search import apply_clip_ratios, clip_ratios_from_metadata
from oscar_hf.calibrate.encoders import ENCODERS, fake_quantizer
from oscar_hf.calibrate.pipeline import calibration_layers, rotations_from_moments
from oscar_hf.calibrate.transforms import balanced_key_transform
from oscar_hf.compat import cache_argument_name
from oscar_hf.eval.assets import load_smollm2, play_tokens
from oscar_hf.eval.perplexity import compare_caches
from oscar_hf.kernels.reference.attention import history_partial
from oscar_hf.kernels.reference.backend import ReferenceBackend
from oscar_hf.kernels.reference.quantize import pack_codes
from oscar_hf.layer import OscarLayer
from oscar_hf.rotations.math import rotate

DEFAULT_CLIPS = (0.96, 0.92)


def parse_ratio(text):
    return None if text == "none" else float(text)


class EncoderBackend(ReferenceBackend):
    """The reference backend with another row encoder for demotion (experiment only; same stored format)."""

    def __init__(self, encoder, history_chunk=4096):
        super().__init__(history_chunk)
        self.encoder = encoder

    def demote(self, x, rotation, clip_ratio, bits, codes_out, scale_zero_out, encoder="minmax"):
        codes, scale_zero = self.encoder(rotate(x, rotation), bits, clip_ratio, scale_zero_out.dtype)
        codes_out.copy_(pack_codes(codes, bits))
        scale_zero_out.copy_(scale_zero)


class TransformBackend(EncoderBackend):
    """EncoderBackend whose history attention rotates queries by a layer's query-side transform `A⁻ᵀ`."""

    def __init__(self, encoder, query_side, history_chunk=4096):
        super().__init__(encoder, history_chunk)
        self.query_side = query_side

    def history_attention(self, query, history, key_rotation, value_rotation, mask, scaling, softcap=None):
        return history_partial(query, history, self.query_side.to(query.device), value_rotation, mask, scaling,
                               softcap, chunk=self.history_chunk)


def install_encoder(cache, encoder, transforms=None):
    """Make every OscarLayer of a fresh cache demote with `encoder`; with `transforms` (layer -> (A, A⁻ᵀ)) store
    keys as `Q(k A)` and attend to them with `q A⁻ᵀ` (experiment only: the core applies orthogonal rotations)."""
    for layer in cache.layers:
        if isinstance(layer, OscarLayer):
            if transforms is None:
                layer.backend = EncoderBackend(encoder)
            else:
                forward_side, query_side = transforms[layer.layer_idx]
                layer.key_rotation = forward_side
                layer.backend = TransformBackend(encoder, query_side)
    return cache


def key_transforms(name, moments, layers):
    """layer -> (A, A⁻ᵀ) for a `+balanced[strength]` configuration, else None."""
    strength = next((o[len("balanced"):] for o in name.split("+")[1:] if o.startswith("balanced")), None)
    if strength is None:
        return None
    tiers = name.split("+")[0].split("@")[0].split("/")[-1]
    chosen = moment_set(moments, tiers if "/" in name.split("+")[0] else "all")
    return {i: balanced_key_transform(chosen["query"][i], chosen["key"][i], float(strength or 1.0)) for i in layers}


def split_options(name):
    """(configuration without options, encoder name, quantize keys, quantize values)."""
    parts = name.split("+")
    options = set(parts[1:])
    encoder = next((o for o in options if o in ENCODERS), "minmax")
    return parts[0], encoder, "vonly" not in options, "konly" not in options


def moment_set(moments, tiers):
    """`moments[tiers]`; `<set>.<tiers>` picks a named moments file given as `--moments <set>=<path>`."""
    if "." in tiers:
        name, _, tiers = tiers.partition(".")
        return moments[name][tiers]
    return moments["default"][tiers]


def load_moments(items):
    """`--moments` items `path` or `name=path` -> {name: moments}; the first (or unnamed) is "default"."""
    result = {}
    for k, item in enumerate(items or []):
        name, _, path = item.rpartition("=")
        result[name or ("default" if "default" not in result else str(k))] = torch.load(path)["moments"]
    if result and "default" not in result:
        result["default"] = next(iter(result.values()))
    return result


def build(name, moments, layers, kv_heads, head_dim):
    """(rotations or None, method, key clip, value clip) of a configuration name."""
    base, _, override = split_options(name)[0].partition("@")
    key_clip, value_clip = DEFAULT_CLIPS
    method = "oscar"
    if base == "identity":
        rotations, method, key_clip, value_clip = None, "identity", None, None
    elif base == "clip":
        rotations, method = None, "clip"
    elif base in ("hadamard", "quarot"):
        rotations, method = Rotations.hadamard(layers, head_dim), base
        if base == "quarot":
            key_clip = value_clip = None
    elif base.startswith("file:"):
        rotations = Rotations.from_pretrained(base[5:])
    else:
        key_obj, value_obj, grouping, tiers = base.split("/")
        rotations = rotations_from_moments(moment_set(moments, tiers), key_obj, value_obj, grouping == "head", layers,
                                           kv_heads, head_dim)
    if override == "meta":  # the clip ratios (and encoder) recorded in a rotations file by oscar-calibrate
        key_clip, value_clip = clip_ratios_from_metadata(rotations.metadata)
    elif override.startswith("clips="):
        choice = json.load(open(override[6:]))
        key_clip = {int(i): r for i, r in choice["key"].items()} if isinstance(choice["key"], dict) else choice["key"]
        value_clip = ({int(i): r for i, r in choice["value"].items()} if isinstance(choice["value"], dict)
                      else choice["value"])
    elif override:
        parts = dict(p.split("=") for p in override.split(","))
        key_clip = parse_ratio(parts.get("k", str(key_clip)))
        value_clip = parse_ratio(parts.get("v", str(value_clip)))
    return rotations, method, key_clip, value_clip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moments", nargs="*", help="moments files of collect_smollm2.py: path or name=path")
    parser.add_argument("--mode", choices=["proxy", "ppl"], required=True)
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--plays", nargs="+", default=["lear_gut.txt"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--query-stride", type=int, default=1, help="proxy: measure every n-th query")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    layers, kv_heads, head_dim = calibration_layers(model)
    moments = load_moments(args.moments)
    built = {name: build(name, moments, layers, kv_heads, head_dim) for name in args.configs}
    sequences = [play_tokens(tokenizer, play, args.tokens) for play in args.plays]
    start = time.time()
    results = {"args": vars(args), "configs": {}}
    if args.mode == "proxy":
        candidates = {}
        for name, (r, _, k, v) in built.items():
            _, encoder, keys, values = split_options(name)
            transforms = key_transforms(name, moments, layers)
            candidates[name] = Candidate(r, k, v, quantizer=fake_quantizer(ENCODERS[encoder]), quantize_keys=keys,
                                         quantize_values=values, key_transforms=transforms)
        probe = AttentionErrorProbe(candidates, layers, sink=64, recent=256, query_stride=args.query_stride)
        feed(model, sequences, chunk_tokens=args.tokens, observer=probe)
        summary = probe.summary()
        for name in args.configs:
            per_layer = probe.errors[name]
            results["configs"][name] = {**summary[name], "layers": {i: {"kl": e.kl, "rel_mse": e.rel_mse}
                                                                    for i, e in sorted(per_layer.items())}}
            print(f"{name:45s} attn-KL {summary[name]['kl']:.4f}  out-relMSE {summary[name]['rel_mse']:.4f}")
    else:
        def factory(rotations, method, key_clip, value_clip, encoder, transforms):
            def make():
                if method == "identity":
                    cache = OscarCache(model, rotations="identity", method="identity")
                elif rotations is None:
                    cache = OscarCache(model, rotations="identity", method=method)
                else:
                    cache = OscarCache(model, rotations=rotations, method=method)
                cache = apply_clip_ratios(cache, key_clip, value_clip)
                if encoder == "minmax" and transforms is None:
                    return cache
                return install_encoder(cache, ENCODERS[encoder], transforms)
            return make

        factories = {"bf16": lambda: DynamicCache(config=model.config)}
        factories.update({name: factory(*spec, split_options(name)[1], key_transforms(name, moments, layers))
                          for name, spec in built.items()})
        totals = {name: [0.0, 0.0, 0.0, 0] for name in factories}
        for ids in sequences:
            scores = compare_caches(model, ids, factories, prefill=args.prefill, chunk=args.chunk, progress=False)
            for name, s in scores.items():
                t = totals[name]
                t[0] += s.nll * s.tokens; t[1] += s.kl * s.tokens; t[2] += s.top1_agreement * s.tokens; t[3] += s.tokens
        probe_cache = factories[args.configs[0]]()
        model(input_ids=sequences[0], use_cache=True, **{cache_argument_name(model): probe_cache})
        bits = probe_cache.bits_per_element()
        for name, (nll, kl, top1, n) in totals.items():
            row = {"ppl": float(torch.tensor(nll / n).exp()), "kl": kl / n, "top1": top1 / n, "tokens": n}
            results["configs"][name] = row
            print(f"{name:45s} ppl {row['ppl']:.2f}  KL {row['kl']:.4f}  top1 {row['top1']:.4f}")
        results["bits_per_element_at_context"] = bits
        print(f"cache bits/element at {args.tokens} tokens (BF16 tiers included): {bits:.3f}")
    results["seconds"] = time.time() - start
    json.dump(results, open(args.out, "w"), indent=1)
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
