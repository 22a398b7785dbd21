"""Rows, comparisons and the final report of `python -m bench.multi_gpu` (see its docstring)."""

from __future__ import annotations

import glob
import json
import os


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(f"wrote {path}", flush=True)


def row(part: str, check: str, status: str, detail: str = "") -> dict:
    return dict(part=part, check=check, status=status, detail=detail)


def compare_greedy(reference: dict, other: dict) -> dict:
    """Tokens equal, or the first mismatch with the reference's margin and the logit difference at that step."""
    ref_tokens, tokens = reference["tokens"], other["tokens"]
    mismatch = (ref_tokens != tokens).any(0).nonzero()
    first = int(mismatch[0]) if len(mismatch) else None
    upto = ref_tokens.shape[1] if first is None else first + 1
    diff = (reference["logits"][:, :upto] - other["logits"][:, :upto]).abs()
    result = dict(tokens_equal=first is None, first_mismatch=first, steps=ref_tokens.shape[1],
                  max_logit_diff=float(diff.max()), logit_scale=float(reference["logits"].abs().max()))
    if first is None:
        return dict(result, status="PASS")
    ref_logits = reference["logits"][:, first]
    rows = (ref_tokens[:, first] != tokens[:, first]).nonzero()[:, 0]
    margin = max(float(ref_logits[r, ref_tokens[r, first]] - ref_logits[r, tokens[r, first]]) for r in rows)
    near_tie = margin <= float(diff[:, first].max())
    return dict(result, margin_at_mismatch=margin, status="PASS (near-tie)" if near_tie else "FAIL")


def describe(comparison: dict) -> str:
    if comparison["tokens_equal"]:
        return f"{comparison['steps']} tokens equal; max logit diff {comparison['max_logit_diff']:.2e}"
    return (f"first mismatch at step {comparison['first_mismatch']}/{comparison['steps']}: reference margin "
            f"{comparison['margin_at_mismatch']:.3g}, logit diff {comparison['max_logit_diff']:.3g}")


def lm_eval_outputs(folder: str) -> dict:
    """Results per task and samples per task and doc id from an lm-eval `--output_path` folder."""
    results_file = sorted(glob.glob(os.path.join(folder, "**", "results_*.json"), recursive=True))[-1]
    samples = {}
    for path in glob.glob(os.path.join(folder, "**", "samples_*.jsonl"), recursive=True):
        task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
        with open(path) as f:
            samples[task] = {doc["doc_id"]: doc["filtered_resps"] for doc in map(json.loads, f)}
    return dict(results=json.load(open(results_file))["results"], samples=samples)


def response_diff(a, b) -> float:
    """Largest difference between two samples' responses: |x - y| for numbers (also when lm-eval wrote them as
    strings, as it does for loglikelihood_rolling), else 0/inf for strings and flags."""
    if isinstance(a, str) and isinstance(b, str):
        try:
            a, b = float(a), float(b)
        except ValueError:
            pass
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return max((response_diff(x, y) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else float("inf")
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b))
    return 0.0 if a == b else float("inf")


def write_report(out: str) -> int:
    """OUT/results.json and a markdown table of every part's rows, the throughput table and the steps that failed;
    returns the number of FAIL rows (-1 when there is nothing to report)."""
    rows = []
    throughput_rows, throughput_info = _throughput_table(out)
    for name in ("device_map", "tp_generate", "throughput", "lm_eval"):
        path = os.path.join(out, f"{name}.json")
        rows += throughput_rows if name == "throughput" else json.load(open(path))["rows"] if os.path.exists(path) else []
    steps = []
    if os.path.exists(os.path.join(out, "steps.tsv")):
        with open(os.path.join(out, "steps.tsv")) as f:
            steps = [dict(zip(("part", "step", "rc", "seconds", "log"), line.rstrip("\n").split("\t"))) for line in f]
    for step in steps:
        if step["rc"] == "nolm_eval":
            rows.append(row(step["part"], "lm-eval runs", "SKIP", "lm_eval cannot be imported: carry its wheels"))
        elif step["rc"] != "0":
            what = {"timeskip": "not run: no time left", "124": "timed out"}.get(step["rc"], f"exit {step['rc']}")
            rows.append(row(step["part"], f"step {step['step']}", "FAIL",
                            f"{what} after {step['seconds']} s; see {os.path.basename(step['log'])}"))
    rows.sort(key=lambda r: (r["part"] != "prepare", r["part"]))  # stable: each part's rows together, in order
    lines = ["| part | check | status | detail |", "|---|---|---|---|"]
    lines += [f"| {r['part']} | {r['check']} | {r['status']} | {r['detail']} |" for r in rows]
    table = "\n".join(lines)
    failed = [r for r in rows if r["status"].startswith("FAIL")]
    write_json(os.path.join(out, "results.json"),
               dict(rows=rows, throughput=throughput_info, steps=steps, failed=len(failed), table=table))
    print(table)
    print("\n" + throughput_info.get("table", ""))
    return len(failed) if rows else -1


def _throughput_table(out: str) -> tuple[list[dict], dict]:
    runs = {}
    for name in ("1gpu", "tp2"):
        path = os.path.join(out, f"throughput-{name}.json")
        if os.path.exists(path):
            runs[name] = json.load(open(path))
    if not runs:
        return [], {}
    keyed = {name: {(r["context"], r["batch"]): r for r in run["rows"]} for name, run in runs.items()}
    keys = sorted(set().union(*keyed.values()))
    lines = ["| ctx | bs | 1 GPU ms/step | TP=2 ms/step | 1 GPU tok/s | TP=2 tok/s | TP speedup | peak GB (1 GPU / "
             "TP rank 0) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for key in keys:
        one, two = (keyed.get(name, {}).get(key, {"error": "not run"}) for name in ("1gpu", "tp2"))
        cell = lambda r, f, fmt: fmt.format(r[f]) if "error" not in r else r["error"][:40]  # noqa: E731
        speedup = f"{one['step_ms'] / two['step_ms']:.2f}x" if "error" not in one and "error" not in two else ""
        lines.append(f"| {key[0]} | {key[1]} | {cell(one, 'step_ms', '{:.2f}')} | {cell(two, 'step_ms', '{:.2f}')} | "
                     f"{cell(one, 'tokens_per_s', '{:.1f}')} | {cell(two, 'tokens_per_s', '{:.1f}')} | {speedup} | "
                     f"{cell(one, 'peak_GB', '{:.1f}')} / {cell(two, 'peak_GB', '{:.1f}')} |")
        for name, r in (("1 GPU", one), ("TP=2", two)):
            if "error" in r:
                rows.append(row("c. throughput", f"{name} ctx {key[0]} bs {key[1]}", "FAIL", r["error"][:200]))
    rows.append(row("c. throughput", "decode measured (table below)", "FAIL" if rows else "PASS",
                    "; ".join(f"{n}: {json.dumps(run['info'])}" for n, run in runs.items())))
    return rows, dict(runs=runs, table="\n".join(lines))
