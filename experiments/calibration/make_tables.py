"""Merge the JSON results of evaluate_smollm2.py into markdown tables.

Perplexity files scored on disjoint play sets combine exactly (each play is scored with fresh caches): NLL, KL
and top-1 are token-weighted means. Proxy files are averaged over plays per layer (each play weighs the same).

  python -m experiments.calibration.make_tables --ppl out/ppl_*.json --proxy out/proxy_final_*.json \
      --configs experiments/calibration/final_configs.txt
"""

import argparse
import json
import math
from collections import defaultdict


def merge_ppl(paths):
    """config -> {plays: set, nll, kl, top1, tokens}."""
    table = defaultdict(lambda: {"plays": set(), "nll": 0.0, "kl": 0.0, "top1": 0.0, "tokens": 0})
    for path in paths:
        result = json.load(open(path))
        plays = tuple(result["args"]["plays"])
        for name, row in result["configs"].items():
            entry = table[name]
            if set(plays) & entry["plays"]:
                continue  # the same config on the same plays in two files: keep the first
            n = row["tokens"]
            entry["plays"] |= set(plays)
            entry["nll"] += math.log(row["ppl"]) * n
            entry["kl"] += row["kl"] * n
            entry["top1"] += row["top1"] * n
            entry["tokens"] += n
    return table


def merge_proxy(paths):
    """config -> {"kl": mean over layers, "rel_mse": ..., "layers": {layer: (kl, rel_mse)}} averaged over files."""
    sums = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0]))
    for path in paths:
        for name, row in json.load(open(path))["configs"].items():
            for layer, values in row["layers"].items():
                cell = sums[name][int(layer)]
                cell[0] += values["kl"]
                cell[1] += values["rel_mse"]
                cell[2] += 1
    out = {}
    for name, layers in sums.items():
        per_layer = {i: (c[0] / c[2], c[1] / c[2]) for i, c in sorted(layers.items())}
        out[name] = {"kl": sum(v[0] for v in per_layer.values()) / len(per_layer),
                     "rel_mse": sum(v[1] for v in per_layer.values()) / len(per_layer), "layers": per_layer}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ppl", nargs="*", default=[])
    parser.add_argument("--proxy", nargs="*", default=[])
    parser.add_argument("--configs", help="file with one configuration per line (table order)")
    parser.add_argument("--per-layer", nargs="*", default=[], help="configurations for a per-layer table")
    parser.add_argument("--plot", default=None, help="PNG of the --per-layer configurations' per-layer curves")
    args = parser.parse_args()
    ppl, proxy = merge_ppl(args.ppl), merge_proxy(args.proxy)
    order = [line.strip() for line in open(args.configs)] if args.configs else sorted(set(ppl) | set(proxy))
    order = ["bf16"] + [c for c in order if c and c != "bf16"]
    bf16 = math.exp(ppl["bf16"]["nll"] / ppl["bf16"]["tokens"]) if "bf16" in ppl else None
    print("| configuration | ppl | vs BF16 | next-token KL | top-1 | mean attn KL | mean out relMSE | plays |")
    print("|---|---|---|---|---|---|---|---|")
    for name in order:
        row, p = ppl.get(name), proxy.get(name)
        cells = [f"`{name}`"]
        if row and row["tokens"]:
            value = math.exp(row["nll"] / row["tokens"])
            cells += [f"{value:.2f}", f"{100 * (value / bf16 - 1):+.1f}%" if bf16 else "",
                      f"{row['kl'] / row['tokens']:.4f}", f"{row['top1'] / row['tokens']:.3f}"]
        else:
            cells += ["", "", "", ""]
        cells += [f"{p['kl']:.4f}", f"{p['rel_mse']:.4f}"] if p else ["", ""]
        cells.append(str(len(row["plays"])) if row else "")
        print("| " + " | ".join(cells) + " |")
    if args.per_layer:
        print()
        print("| layer | " + " | ".join(f"`{c}` KL / relMSE" for c in args.per_layer) + " |")
        print("|---" * (len(args.per_layer) + 1) + "|")
        layers = sorted(proxy[args.per_layer[0]]["layers"])
        for i in layers:
            cells = [f"{proxy[c]['layers'][i][0]:.3f} / {proxy[c]['layers'][i][1]:.4f}" for c in args.per_layer]
            print(f"| {i} | " + " | ".join(cells) + " |")
    if args.plot:
        plot_layers(proxy, args.per_layer, args.plot)


def plot_layers(proxy, names, path):
    """Per-layer attention KL and output relative MSE, one curve per configuration (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name in names:
        layers = sorted(proxy[name]["layers"])
        for axis, k in zip(axes, (0, 1)):
            axis.plot(layers, [proxy[name]["layers"][i][k] for i in layers], marker="o", markersize=3, label=name)
    for axis, title in zip(axes, ("attention-score KL (nats)", "attention output relative MSE")):
        axis.set(title=title, xlabel="layer", yscale="log")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
