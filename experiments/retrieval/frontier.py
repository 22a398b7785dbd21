"""The retrieval frontier: fact copy accuracy against stored bits per history element, one point per format of
`levers.py` (and per rotation), with its perplexity change; a markdown table and a plot. `--needles` adds a panel
of greedy hits through the real cache, one point per `label=bits=needles.md=method`: the hits of `method` (as
`--methods` names it) in the summary an `oscar-needles` run wrote. `make_frontier.sh` draws the one in
docs/results/levers:

  python -m experiments.retrieval.frontier docs/results/levers/levers.jsonl --out docs/results/levers \
      --needles "hadamard=2.5=docs/results/needles-cpu-hadamard/needles.md=oscar" ...
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
    lines = [("| rotation | format | bits/element | fact tokens copied | probes: fact copied (upper bound) | "
              "probes: BF16's answer repeated through the fact (lower bound) | ppl vs BF16 | KL |"),
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rotations']} | `{r['format']}` | {r['bits']:.2f} | {r['copy']:.0%} | {r['probes']} | "
                     f"{r.get('exact') or '–'} | {r['ppl_delta']:+.1%} | {r['kl']:.3f} |")
    return "\n".join(lines)


def method_hits(path: str) -> dict[str, tuple[int, int]]:
    """(hits, probes) per method name of an `oscar-needles` summary (`needles.md`). Its first table has one row per
    method, labelled for reading, in the order the methods first appear in the table of outputs below it, whose rows
    start with the method's name."""
    with open(path) as f:
        tables = [block.splitlines() for block in f.read().split("\n\n") if block.startswith("| method |")]
    if len(tables) != 2:
        raise ValueError(f"{path}: expected the hits table and the outputs table of an oscar-needles run, "
                         f"found {len(tables)} tables starting with '| method |'")
    (header, _, *summary), (_, _, *outputs) = tables
    total = [cell.strip() for cell in header.split("|")].index("total")
    methods = list(dict.fromkeys(row.split(" | ")[0].removeprefix("| ") for row in outputs))
    if len(methods) != len(summary):
        raise ValueError(f"{path}: {len(summary)} rows of hits for {len(methods)} methods ({methods}) in the outputs")
    return {method: tuple(map(int, row.split("|")[total].split("/"))) for method, row in zip(methods, summary)}


def greedy_points(specs: list[str]) -> list[tuple[str, float, int, int, int]]:
    """(label, bits, hits, probes, BF16 hits) per `label=bits=needles.md=method`; BF16 hits are 0 in a run without
    bf16."""
    points = []
    for spec in specs:
        label, bits, path, method = spec.split("=")
        totals = method_hits(path)
        if method not in totals:
            raise ValueError(f"{spec}: {path} has no method {method!r}; it has {sorted(totals)}")
        points.append((label, float(bits), *totals[method], totals.get("bf16", (0, 0))[0]))
    return points


def plot(rows: list[dict], path: str, greedy: list | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if greedy else 1, figsize=(15 if greedy else 8, 5), squeeze=False)
    if greedy:
        ax = axes[0][1]
        for label, bits, hits, probes, _ in greedy:
            ax.scatter([bits], [hits])
            ax.annotate(label, (bits, hits), fontsize=7, xytext=(3, 3), textcoords="offset points")
        bf16 = max(p[4] for p in greedy)
        ax.axhline(bf16, color="grey", lw=0.8, ls="--")
        ax.axhline(0.9 * bf16, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("stored bits per history element (head_dim 64)")
        ax.set_ylabel(f"greedy hits of {greedy[0][3]} probes (BF16 dashed, 90% of it dotted)")
        ax.set_title("Greedy hits through the real cache")
    ax = axes[0][0]
    for rotation in sorted({r["rotations"] for r in rows}):
        mine = [r for r in rows if r["rotations"] == rotation]
        ax.scatter([r["bits"] for r in mine], [r["copy"] for r in mine], label=rotation)
        for r in mine:
            ax.annotate(r["format"].split(" ")[0], (r["bits"], r["copy"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("stored bits per history element ((scale, zero) pairs counted)")
    ax.set_ylabel("fact tokens copied (teacher-forced, vs BF16's answer)")
    ax.set_title("SmolLM2-135M needle suite, decode-equivalent simulation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default="out/levers")
    p.add_argument("--needles", nargs="*", default=[], help="label=bits=needles.md=method")
    args = p.parse_args(argv)
    rows = load(args.results)
    greedy = greedy_points(args.needles)
    os.makedirs(args.out, exist_ok=True)
    plot(rows, os.path.join(args.out, "frontier.png"), greedy)
    text = table(rows)
    if greedy:
        bf16 = max(p[4] for p in greedy)  # runs of one method carry no BF16 row: the suite's BF16 hits
        text += ("\n\n| recipe (greedy, real cache) | bits/element | hits | vs BF16 |\n|---|---:|---:|---:|\n"
                 + "\n".join(f"| {label} | {bits:.2f} | {hits}/{probes} | {hits / bf16:.0%} |"
                              for label, bits, hits, probes, _ in greedy))
    with open(os.path.join(args.out, "frontier.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
