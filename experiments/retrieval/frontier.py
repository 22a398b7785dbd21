"""The retrieval frontier: fact copy accuracy against stored bits per history element, one point per row format of
`levers.py` (and per rotation), with its perplexity change; a markdown table and a plot.

  python -m experiments.retrieval.frontier out/levers/levers.jsonl --out docs/results/levers
"""

from __future__ import annotations

import argparse
import json
import os


def load(paths: list[str]) -> list[dict]:
    rows = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    rows[(row["rotations"], row["format"])] = row  # a later run of a format replaces an earlier
    return sorted(rows.values(), key=lambda r: (r["rotations"], r["bits"], r["format"]))


def table(rows: list[dict]) -> str:
    lines = ["| rotation | format | bits/element | fact tokens copied | probes: fact copied (upper bound) | "
             "probes: BF16's answer repeated through the fact (lower bound) | ppl vs BF16 | KL |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rotations']} | `{r['format']}` | {r['bits']:.2f} | {r['copy']:.0%} | {r['probes']} | "
                     f"{r.get('exact', '–')} | {r['ppl_delta']:+.1%} | {r['kl']:.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for rotation in sorted({r["rotations"] for r in rows}):
        mine = [r for r in rows if r["rotations"] == rotation]
        ax.scatter([r["bits"] for r in mine], [r["copy"] for r in mine], label=rotation)
        for r in mine:
            ax.annotate(r["format"].split(" ")[0], (r["bits"], r["copy"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("stored bits per history element (fp16 scale pairs counted)")
    ax.set_ylabel("fact tokens copied (teacher-forced, vs BF16's answer)")
    ax.set_title("Retrieval frontier, SmolLM2-135M (needle suite, decode-equivalent simulation)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default="out/levers")
    args = p.parse_args(argv)
    rows = load(args.results)
    os.makedirs(args.out, exist_ok=True)
    plot(rows, os.path.join(args.out, "frontier.png"))
    text = table(rows)
    with open(os.path.join(args.out, "frontier.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
