"""Markdown report, JSON results, a terminal-width table and the per-layer figure of a diagnostics run."""

from __future__ import annotations

import json
import math
import os
import shutil
import textwrap
from dataclasses import dataclass

from oscar_hf.config import PRESETS
from oscar_hf.eval.diagnostics.layers import LayerErrors
from oscar_hf.eval.diagnostics.run import REFERENCE, MethodResult

OSCAR_LAYOUT_ROWS = tuple(PRESETS) + ("hadamard4", "oscar4")
PANELS = (
    ("key_mse", "K reconstruction MSE"),
    ("value_mse", "V reconstruction MSE"),
    ("attention_kl", "attention-score KL(P || P̂)"),
    ("output_relative_mse", "attention-block output rel. MSE"),
)


@dataclass(frozen=True)
class Column:
    """One number of the side-by-side table: its markdown header, its terminal header and how it is printed."""

    attribute: str
    header: str
    short: str
    digits: int = 3


# in the order a narrow terminal keeps them (the markdown table puts them in `MARKDOWN_ORDER`)
COLUMNS = (
    Column("perplexity", "ppl", "ppl", 2),
    Column("next_token_kl", "next-token KL", "KL"),
    Column("top1_agreement", "top-1", "top-1"),
    Column("bits_per_element_bf16", "bits/elem (BF16 model)", "bits", 2),
    Column("mean_attention_kl", "mean attn KL", "attn KL"),
    Column("mean_output_relative_mse", "mean out relMSE", "out relMSE"),
    Column("greedy_agreement", "greedy agree", "greedy"),
    Column("decode_perplexity", "decode-eq. ppl", "sim ppl", 2),
    Column("decode_next_token_kl", "decode-eq. KL", "sim KL"),
    Column("bits_per_element", "bits/elem (as run)", "bits run", 2),
)
MARKDOWN_ORDER = ("bits_per_element", "bits_per_element_bf16", "perplexity", "next_token_kl", "top1_agreement",
                  "decode_perplexity", "decode_next_token_kl", "mean_attention_kl", "mean_output_relative_mse",
                  "greedy_agreement")


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4):
        return f"{value:.2e}"
    return f"{value:.{digits}f}"


def _measured_columns(results: list[MethodResult]) -> list[Column]:
    """The columns some row has a number for (a run without the simulation has no decode-eq. columns)."""
    return [c for c in COLUMNS if any(not r.error and _fmt(getattr(r, c.attribute)) != "n/a" for r in results)]


def results_table(results: list[MethodResult]) -> str:
    """The side-by-side table (markdown): one row per method name, then what each name is (`label`)."""
    measured = {c.attribute: c for c in _measured_columns(results)}
    columns = [measured[a] for a in MARKDOWN_ORDER if a in measured]
    lines = ["| method | " + " | ".join(c.header for c in columns) + " |", "|---|" + "---|" * len(columns)]
    for r in results:
        if r.error:
            lines.append(f"| {r.name} | failed: {r.error} |" + " |" * (len(columns) - 1))
            continue
        lines.append(f"| {r.name} | " + " | ".join(_fmt(getattr(r, c.attribute), c.digits) for c in columns) + " |")
    lines += [""] + [f"- `{r.name}`: {r.label}" for r in results]
    return "\n".join(lines)


def terminal_width() -> int:
    """Columns of the terminal (100 when there is none, e.g. output to a file)."""
    return shutil.get_terminal_size((100, 24)).columns


def terminal_table(results: list[MethodResult], width: int | None = None) -> str:
    """The side-by-side table as plain text no wider than `width` (default: the terminal's): the method names,
    as many numbers as fit (in `COLUMNS` order), then what each name is, wrapped to the width."""
    width = terminal_width() if width is None else width
    measured = _measured_columns(results)
    names = [r.name for r in results]
    cells = {c.attribute: [_fmt(getattr(r, c.attribute), c.digits) for r in results] for c in measured}
    name_width = max(len("method"), *map(len, names))
    chosen, used = [], name_width
    for c in measured:
        column_width = max(len(c.short), *(len(v) for v in cells[c.attribute]))
        if used + 2 + column_width > width and chosen:
            break
        chosen.append((c, column_width))
        used += 2 + column_width
    lines = ["  ".join(["method".ljust(name_width)] + [c.short.rjust(w) for c, w in chosen])]
    lines.append("-" * min(used, width))
    for i, r in enumerate(results):
        if r.error:
            line = f"{r.name.ljust(name_width)}  failed: {' '.join(r.error.split())}"
            lines.append(line if len(line) <= width else line[: width - 1] + "…")
            continue
        lines.append("  ".join([r.name.ljust(name_width)] + [cells[c.attribute][i].rjust(w) for c, w in chosen]))
    left_out = [c.short for c in measured[len(chosen):]]
    if left_out:
        lines.append(textwrap.fill(f"(not shown at {width} columns: {', '.join(left_out)}; every column is in "
                                   "report.md)", width))
    lines.append("")
    for r in results:
        lines.append(textwrap.fill(f"{r.name}: {r.label}", width, subsequent_indent="    "))
    return "\n".join(lines)


def layer_figure(results: list[MethodResult], title: str = ""):
    """A matplotlib `Figure` of the per-layer curves per method, one panel per error (log scale), titled
    "Per-layer errors: `title`"; None when no row has per-layer errors (the BF16 reference has none: they are zero
    by definition).

    Each curve is labelled with its method name, as the rows of `results_table` and `terminal_table` are. Solid
    lines: OSCAR-layout rows; dashed: peer caches. Layers with zero error (kept exact) are gaps. The figure is built
    without pyplot, so no backend is chosen or changed; raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    rows = [r for r in results if not r.error and r.layers and r.name != REFERENCE]
    if not rows:
        return None
    fig = Figure(figsize=(5 * len(PANELS), 4.4))
    axes = fig.subplots(1, len(PANELS))
    for ax, (key, panel) in zip(axes, PANELS):
        for r in rows:
            xs = [e.layer_idx for e in r.layers]
            ys = [getattr(e, key) if getattr(e, key) > 0 else math.nan for e in r.layers]  # exact layers: gaps
            style = "-" if r.name in OSCAR_LAYOUT_ROWS else "--"
            ax.plot(xs, ys, style, marker=".", label=r.name)
        ax.set_yscale("log")
        ax.set_title(panel)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, title="method")
    fig.suptitle(f"Per-layer errors: {title}" if title else "Per-layer errors")
    fig.tight_layout()
    return fig


def plot_layers(results: list[MethodResult], path: str, title: str = "") -> str | None:
    """Save `layer_figure(results, title)` as a PNG at `path` (no pyplot, no backend switch); returns the path, or
    None when there is nothing to plot (then no file is written). Raises ImportError without matplotlib."""
    fig = layer_figure(results, title)
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    return path


def write_results_json(results: list[MethodResult], out_dir: str, command: str, settings: dict,
                       title: str = "") -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump({"title": title, "settings": settings, "command": command,
                   "results": [r.as_dict() for r in results]}, f, indent=1)
    return path


def _notes(results: list[MethodResult]) -> list[str]:
    """What the measured columns of `results_table` mean."""
    measured = {c.attribute for c in _measured_columns(results)}
    greedy = "greedy_agreement" in measured
    notes = [
        ("perplexity", f"- BF16: the reference, computed once (one full-precision forward over the text"
                       f"{' and its greedy continuation' if greedy else ''}); not replayed as a method, so its "
                       "per-layer errors are zero by definition."),
        ("perplexity", "- ppl / next-token KL / top-1: through the real cache, the reference's prefill K/V through "
                       "the cache's own update, then chunked forwards; KL and top-1 against the reference on the same "
                       "tokens."),
        ("decode_perplexity", "- decode-eq.: decode-equivalent simulation (prefill, then token by token), OSCAR "
                              "methods only; the BF16 row is the cache-free forward."),
        ("mean_attention_kl", "- mean attn KL / out relMSE: mean over layers of the per-layer errors with "
                              "decode-style queries over the cache's real tier layout (full-precision inputs per "
                              "layer)."),
        ("bits_per_element", "- bits/elem: bytes the cache holds after the text (codes, scales, zeros, norms, "
                             "full-precision windows) per cached K/V element; 'BF16 model' counts float32 tensors at "
                             "16 bits."),
        ("greedy_agreement", "- greedy agree: leading tokens of a greedy continuation of the whole text equal to "
                             "BF16's."),
    ]
    return [text for attribute, text in notes if attribute in measured]


def write_report(results: list[MethodResult], out_dir: str, title: str, command: str, settings: dict) -> str:
    """Write report.md, results.json and layers.png (when matplotlib is installed and a row has per-layer errors)
    into `out_dir`; returns the report path. The report links the figure only when this call wrote it."""
    write_results_json(results, out_dir, command, settings, title)
    try:
        plot = plot_layers(results, os.path.join(out_dir, "layers.png"), title)
        missing = "no row has per-layer errors"
    except ImportError:  # matplotlib is part of the [eval] extra; re-render later with `python -m ...report`
        plot = None
        missing = ("matplotlib is not installed: pip install 'oscar-hf[eval]', then re-render with "
                   f"`python -m oscar_hf.eval.diagnostics.report {os.path.join(out_dir, 'results.json')}`")
    lines = [
        f"# {title}", "", f"Command: `{command}`", "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), "",
        results_table(results), "",
        *_notes(results),
        "",
        f"![per-layer errors]({os.path.basename(plot)})" if plot else f"(No per-layer figure: {missing}.)",
        "", "## Per-layer errors", "",
    ]
    for r in results:
        if r.error or not r.layers or r.name == REFERENCE:
            continue
        lines += [f"### {r.name}: {r.label}", "",
                  "| layer | attn KL | out relMSE | K MSE | V MSE | K relMSE | V relMSE |",
                  "|---|---|---|---|---|---|---|"]
        for e in r.layers:
            lines.append(f"| {e.layer_idx} | {_fmt(e.attention_kl)} | {_fmt(e.output_relative_mse)} | "
                         f"{_fmt(e.key_mse)} | {_fmt(e.value_mse)} | {_fmt(e.key_relative_mse)} | "
                         f"{_fmt(e.value_relative_mse)} |")
        lines.append("")
    steps = ("capture", "chunked_scoring", "decode_simulation", "layer_replay", "greedy")
    lines += ["## Timings (s)", "", "| method | " + " | ".join(steps) + " |", "|---|" + "---|" * len(steps)]
    for r in results:
        lines.append(f"| {r.name} | " + " | ".join(_fmt(r.seconds.get(k), 1) for k in steps) + " |")
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
    p.add_argument("--title", default=None, help="report and figure title (default: the first JSON's)")
    args = p.parse_args(argv)
    merged: dict[str, MethodResult] = {}
    commands, settings, titles = [], {}, []
    for path in args.results_json:
        results, data = load_results(path)
        commands.append(data["command"])
        settings = settings or data["settings"]
        titles.append(data.get("title"))
        for r in results:
            merged.setdefault(r.name, r)
    out = args.out or os.path.dirname(os.path.abspath(args.results_json[0]))
    title = args.title or titles[0] or "KV-cache quality"
    print(write_report(list(merged.values()), out, title, " ; ".join(commands), settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
