"""Markdown report, JSON results and matplotlib per-layer plots of a diagnostics run."""

from __future__ import annotations

import json
import math
import os

from oscar_hf.eval.diagnostics.layers import LayerErrors
from oscar_hf.eval.diagnostics.run import MethodResult

OSCAR_LAYOUT_ROWS = ("identity", "quarot", "clip", "hadamard", "oscar", "oscar4")
PANELS = (
    ("key_mse", "K reconstruction MSE"),
    ("value_mse", "V reconstruction MSE"),
    ("attention_kl", "attention-score KL(P || P̂)"),
    ("output_relative_mse", "attention-block output rel. MSE"),
)


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4):
        return f"{value:.2e}"
    return f"{value:.{digits}f}"


def results_table(results: list[MethodResult]) -> str:
    """The side-by-side table (markdown)."""
    header = ("| method | bits/elem (fp32 run) | bits/elem (BF16 model) | ppl | next-token KL | top-1 | "
              "decode-eq. ppl | decode-eq. KL | mean attn KL | mean out relMSE | greedy agree |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        if r.error:
            lines.append(f"| {r.label} | failed: {r.error} |" + " |" * (header.count("|") - 3))
            continue
        lines.append("| " + " | ".join([
            r.label, _fmt(r.bits_per_element, 2), _fmt(r.bits_per_element_bf16, 2), _fmt(r.perplexity, 2),
            _fmt(r.next_token_kl), _fmt(r.top1_agreement), _fmt(r.decode_perplexity, 2),
            _fmt(r.decode_next_token_kl), _fmt(r.mean_attention_kl), _fmt(r.mean_output_relative_mse),
            _fmt(r.greedy_agreement),
        ]) + " |")
    return "\n".join(lines)


def plot_layers(results: list[MethodResult], path: str) -> str:
    """Per-layer curves per method, one panel per error (log scale); the BF16 reference is left out.

    Solid lines: OSCAR-layout rows; dashed: peer caches. Layers with zero error (kept exact) are gaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for ax, (key, title) in zip(axes, PANELS):
        for r in results:
            if r.error or r.name == "bf16" or not r.layers:
                continue
            xs = [e.layer_idx for e in r.layers]
            ys = [getattr(e, key) if getattr(e, key) > 0 else math.nan for e in r.layers]  # exact layers: gaps
            style = "-" if r.name in OSCAR_LAYOUT_ROWS else "--"
            ax.plot(xs, ys, style, marker=".", label=r.name)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results_json(results: list[MethodResult], out_dir: str, command: str, settings: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump({"settings": settings, "command": command, "results": [r.as_dict() for r in results]}, f, indent=1)
    return path


def write_report(results: list[MethodResult], out_dir: str, title: str, command: str, settings: dict) -> str:
    """Write report.md, results.json and layers.png into `out_dir`; returns the report path."""
    write_results_json(results, out_dir, command, settings)
    try:
        plot = plot_layers(results, os.path.join(out_dir, "layers.png"))
    except ImportError:  # matplotlib is part of the [eval] extra; re-render later with `python -m ...report`
        plot = "layers.png"
    lines = [
        f"# {title}", "", f"Command: `{command}`", "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), "",
        results_table(results), "",
        "- ppl / next-token KL / top-1: through the real cache, a prefill forward then chunked forwards; KL and "
        "top-1 against BF16 (DynamicCache) on the same tokens.",
        "- decode-eq.: decode-equivalent simulation (prefill, then token by token), OSCAR methods only; the BF16 row "
        "is the cache-free forward.",
        "- mean attn KL / out relMSE: mean over layers of the per-layer errors with decode-style queries over the "
        "cache's real tier layout (full-precision inputs per layer).",
        "- bits/elem: bytes the cache holds after the text (codes, scales, zeros, norms, full-precision windows) "
        "per cached K/V element; 'BF16 model' counts float32 tensors at 16 bits.",
        "- greedy agree: leading tokens of a greedy continuation of the whole text equal to BF16's.",
        "", f"![per-layer errors]({os.path.basename(plot)})", "",
        "## Per-layer errors", "",
    ]
    for r in results:
        if r.error or not r.layers or r.name == "bf16":
            continue
        lines += [f"### {r.label}", "", "| layer | attn KL | out relMSE | K MSE | V MSE | K relMSE | V relMSE |",
                  "|---|---|---|---|---|---|---|"]
        for e in r.layers:
            lines.append(f"| {e.layer_idx} | {_fmt(e.attention_kl)} | {_fmt(e.output_relative_mse)} | "
                         f"{_fmt(e.key_mse)} | {_fmt(e.value_mse)} | {_fmt(e.key_relative_mse)} | "
                         f"{_fmt(e.value_relative_mse)} |")
        lines.append("")
    lines += ["## Timings (s)", "", "| method | " + " | ".join(["capture", "chunked_scoring", "decode_simulation",
                                                                 "layer_replay", "greedy"]) + " |",
              "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | " + " | ".join(_fmt(r.seconds.get(k), 1) for k in
                                                   ("capture", "chunked_scoring", "decode_simulation",
                                                    "layer_replay", "greedy")) + " |")
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def load_results(path: str) -> tuple[list[MethodResult], dict]:
    """(results, file dict) from a results.json written by `write_report`."""
    with open(path) as f:
        data = json.load(f)
    results = []
    for d in data["results"]:
        layers = [LayerErrors(**e) for e in d.pop("layers")]
        results.append(MethodResult(**d, layers=layers))
    return results, data


def main(argv: list[str] | None = None) -> int:
    """Re-render report.md and layers.png from a results.json (e.g. one produced on another machine)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m oscar_hf.eval.diagnostics.report")
    p.add_argument("results_json", nargs="+", help="one or more results.json (rows merged by method, first wins)")
    p.add_argument("--out", default=None, help="folder (default: the first JSON's folder)")
    p.add_argument("--title", default="KV-cache quality")
    args = p.parse_args(argv)
    merged: dict[str, MethodResult] = {}
    commands, settings = [], {}
    for path in args.results_json:
        results, data = load_results(path)
        commands.append(data["command"])
        settings = settings or data["settings"]
        for r in results:
            merged.setdefault(r.name, r)
    out = args.out or os.path.dirname(os.path.abspath(args.results_json[0]))
    print(write_report(list(merged.values()), out, args.title, " ; ".join(commands), settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
