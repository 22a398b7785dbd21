"""Where retrieval breaks: per layer and query head, whether attention still finds a needle in the quantized history
and whether its values come back intact.

A probe (`retrieval.Probe`, the fact at `value_span`) and the answer BF16 gives for it are fed as a prefill of the
prompt followed by the answer, token by token, through the decode-equivalent simulation (`decode_equivalent`). The
queries that matter are the answer positions that predict the fact's own tokens ("copy queries"). Per layer and query
head, averaged over the copy queries, with the model kept on the BF16 trajectory (`propagate=False`) so that each
layer's numbers are its own and not errors carried in from the layers before:

- `mass_bf16` / `mass_quantized`: attention probability on the fact's tokens with exact vs quantized history keys;
- `rank_bf16` / `rank_quantized`: how many other cached tokens score above the fact's best token (0: the fact wins);
- `value_error`: ‖Σ_fact P (V̂ − V)‖ / ‖Σ_fact P V‖, the fact's value read-out error under the exact weights;
- `readout_error`: ‖Σ_fact P̂ V̂ − Σ_fact P V‖ / ‖Σ_fact P V‖, attention and values together.

End to end, `copy_accuracy` is the share of the fact's answer tokens the quantized model predicts (argmax) when the
answer is teacher-forced with the errors propagating through the layers, the way the cache decodes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from oscar_hf.demotion import in_history
from oscar_hf.eval.decode_equivalent import LayerProbe, SimulationPlan, simulate_logits
from oscar_hf.eval.retrieval import answer_values
from oscar_hf.kernels.reference.attention import gqa_mix, gqa_scores

METRICS = ("mass_bf16", "mass_quantized", "rank_bf16", "rank_quantized", "value_error", "readout_error")


def copy_targets(tokenizer, answer_ids: Sequence[int], value: str) -> list[int]:
    """Indices i of the answer tokens that spell `value` in the decoded answer (empty when it is not there)."""
    pieces = [tokenizer.decode(list(answer_ids[: i + 1]), skip_special_tokens=True) for i in range(len(answer_ids))]
    text = pieces[-1] if pieces else ""
    at = text.lower().find(value.lower())
    if at < 0:
        return []
    ends = [len(p) for p in pieces]
    starts = [0] + ends[:-1]
    return [i for i, (a, b) in enumerate(zip(starts, ends)) if b > at and a < at + len(value)]


@dataclass
class NeedleAttention:
    """Per (layer, query head) means over the copy queries of one or more probes (lists `[layers][q_heads]`)."""

    layers: list[int]
    probes: int
    queries: int
    mass_bf16: list[list[float]]
    mass_quantized: list[list[float]]
    rank_bf16: list[list[float]]
    rank_quantized: list[list[float]]
    value_error: list[list[float]]
    readout_error: list[list[float]]
    copy_accuracy: float  # end to end, errors propagated (teacher-forced argmax on the fact's tokens)

    def tensor(self, metric: str) -> torch.Tensor:
        return torch.tensor(getattr(self, metric))


class _Recorder:
    """Collects the per-head needle statistics of every layer from the simulation's `LayerProbe`s."""

    def __init__(self, span: tuple[int, int], queries: torch.Tensor):
        self.span, self.queries = span, queries
        self.stats: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, probe: LayerProbe) -> None:
        a, b = self.span
        t = self.queries.to(probe.query.device)
        q = probe.query[:, :, t]
        exact = gqa_scores(q, probe.keys, probe.scaling, probe.softcap)
        positions = torch.arange(probe.keys.shape[2], device=q.device)
        band = in_history(positions[None, :], probe.history[:, t, None], probe.sink)[:, None]
        if not bool(band[..., a:b].all()):
            raise ValueError(f"the fact's tokens [{a}, {b}) are not all in the quantized history of the copy queries")
        quantized = torch.where(band, gqa_scores(q, probe.keys_hat, probe.scaling, probe.softcap), exact)
        mask = probe.mask[:, :, t]
        stats = {}
        probs = {}
        for name, scores in (("bf16", exact), ("quantized", quantized)):
            scores = scores.masked_fill(~mask, float("-inf"))
            probs[name] = torch.softmax(scores, dim=-1)
            stats[f"mass_{name}"] = probs[name][..., a:b].sum(-1)
            best = scores[..., a:b].amax(-1, keepdim=True)
            stats[f"rank_{name}"] = (scores > best).sum(-1).float()
        reference = gqa_mix(probs["bf16"][..., a:b], probe.values[:, :, a:b])
        norm = reference.norm(dim=-1).clamp_min(1e-12)
        value_only = gqa_mix(probs["bf16"][..., a:b], probe.values_hat[:, :, a:b])
        both = gqa_mix(probs["quantized"][..., a:b], probe.values_hat[:, :, a:b])
        stats["value_error"] = (value_only - reference).norm(dim=-1) / norm
        stats["readout_error"] = (both - reference).norm(dim=-1) / norm
        # [B, Hq, T] -> per head, summed over queries (divided once all probes are in)
        self.stats[probe.layer_idx] = {k: v.sum(dim=(0, 2)).cpu() for k, v in stats.items()}


@torch.no_grad()
def needle_attention(model, tokenizer, probes: Sequence, answers: Sequence[Sequence[int]],
                     template, row_format=None, progress: bool = True,
                     with_copy_accuracy: bool = True) -> NeedleAttention:
    """Needle statistics of `template`'s cache settings (an unused `OscarCache`) over `probes` (`retrieval.Probe`s
    with a `value_span`), each with the answer tokens BF16 gave for it; a probe that asks for several facts is traced
    on its first, the one at `value_span`. Probes whose answer does not contain the fact, or whose fact's first token
    is predicted by the prefill alone, are skipped; at least one must remain. `row_format` replaces the cache's
    quantizer (see `SimulationPlan`). `with_copy_accuracy=False` skips the propagated forward (`copy_accuracy` is then
    NaN)."""
    device = next(model.parameters()).device
    sums: dict[int, dict[str, torch.Tensor]] = {}
    queries_total, used, hits = 0, 0, 0
    for probe, answer in tqdm(list(zip(probes, answers)), desc="needle attention", disable=not progress, leave=False):
        # `value_span` locates the first asked fact only: its value is the one traced
        targets = [i for i in copy_targets(tokenizer, answer, answer_values(probe.answer)[0]) if i > 0]
        if not targets or probe.value_span[0] < 0:
            continue
        prompt = probe.length
        ids = torch.cat([probe.input_ids, torch.tensor([list(answer)])], dim=1).to(device)
        queries = torch.tensor([prompt + i - 1 for i in targets])
        recorder = _Recorder(probe.value_span, queries)
        plan = SimulationPlan.from_cache(template, prefill=prompt, recorder=recorder, propagate=False,
                                         row_format=row_format)
        simulate_logits(model, ids, plan)
        for layer, stats in recorder.stats.items():
            into = sums.setdefault(layer, {k: torch.zeros_like(v) for k, v in stats.items()})
            for k, v in stats.items():
                into[k] += v
        if with_copy_accuracy:
            plan = SimulationPlan.from_cache(template, prefill=prompt, row_format=row_format)
            predicted = simulate_logits(model, ids, plan)[0, queries.to(device)].argmax(-1).cpu()
            hits += int((predicted == ids[0, queries + 1].cpu()).sum())
        queries_total += len(targets)
        used += 1
    if not used:
        raise ValueError("no probe has an answer that spells its fact after the first answer token (the answers miss "
                         "every fact, or the tokenizer does not decode back to the text it encoded)")
    layers = sorted(sums)
    table = {m: [(sums[layer][m] / queries_total).tolist() for layer in layers] for m in METRICS}
    accuracy = hits / queries_total if with_copy_accuracy else math.nan
    return NeedleAttention(layers, used, queries_total, copy_accuracy=accuracy, **table)


def layer_sensitivity(stats: NeedleAttention) -> torch.Tensor:
    """`[layers]` how much each layer's quantized history costs retrieval: the fact's attention mass it loses (BF16
    mass minus quantized, summed over heads) plus its value read-out error weighted by the BF16 mass, each scaled by
    its largest layer value so both halves count alike. Higher means keep this layer at higher precision first."""
    return _sensitivity(*_losses(stats, lambda t: t.sum(-1)))


def kv_head_sensitivity(stats: NeedleAttention, kv_heads: int) -> torch.Tensor:
    """`[layers, kv_heads]` the score of `layer_sensitivity` per KV head: its query heads' (GQA group's) lost mass
    and misread values, each scaled by its largest (layer, KV head) value."""
    return _sensitivity(*_losses(stats, lambda t: t.reshape(t.shape[0], kv_heads, -1).sum(-1)))


def _losses(stats: NeedleAttention, pool) -> tuple[torch.Tensor, torch.Tensor]:
    mass = stats.tensor("mass_bf16")
    return pool(mass - stats.tensor("mass_quantized")), pool(stats.tensor("value_error") * mass)


def _sensitivity(lost: torch.Tensor, misread: torch.Tensor) -> torch.Tensor:
    return lost / lost.abs().max().clamp_min(1e-12) + misread / misread.abs().max().clamp_min(1e-12)


def retrieval_heads(stats: NeedleAttention, top: int = 12) -> list[tuple[int, int]]:
    """(layer, query head) of the `top` heads that put the most BF16 attention on the fact."""
    mass = stats.tensor("mass_bf16")
    order = mass.flatten().argsort(descending=True)[:top]
    return [(stats.layers[int(i) // mass.shape[1]], int(i) % mass.shape[1]) for i in order]


def report_table(results: dict[str, NeedleAttention], top: int = 12) -> str:
    """Markdown: per method, the copy accuracy and, for the heads BF16 retrieves with, mass / rank / errors."""
    lines = []
    for name, stats in results.items():
        lines += [f"### {name}: copy accuracy {stats.copy_accuracy:.0%} ({stats.queries} fact tokens, "
                  f"{stats.probes} probes)", "",
                  "| layer | head | mass BF16 | mass quantized | rank BF16 | rank quantized | value error | "
                  "read-out error |", "|---|---|---|---|---|---|---|---|"]
        for layer, head in retrieval_heads(stats, top):
            row = stats.layers.index(layer)
            cells = [getattr(stats, m)[row][head] for m in METRICS]
            lines.append(f"| {layer} | {head} | " + " | ".join(f"{c:.3f}" if i in (0, 1, 4, 5) else f"{c:.1f}"
                                                                 for i, c in enumerate(cells)) + " |")
        layer_mass = stats.tensor("mass_bf16").sum(-1)
        kept = stats.tensor("mass_quantized").sum(-1)
        worst = (layer_mass - kept).argsort(descending=True)[:6].tolist()
        lines += ["", "Layers losing the most fact mass (BF16 mass summed over heads → quantized): " + ", ".join(
            f"{stats.layers[i]} ({float(layer_mass[i]):.2f} → {float(kept[i]):.2f})" for i in worst), ""]
    return "\n".join(lines)


def plot(results: dict[str, NeedleAttention], path: str) -> str | None:
    """Heatmaps (layers × query heads) per method: BF16 fact mass, mass lost to the quantized keys, value error.
    Returns the path, or None without matplotlib. An explicit `Figure`, saved without pyplot: no backend is chosen
    or changed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    names = list(results)
    fig = Figure(figsize=(12, 3.2 * len(names) + 0.9))
    axes = fig.subplots(len(names), 3, squeeze=False)
    for row, name in enumerate(names):
        stats = results[name]
        mass = stats.tensor("mass_bf16")
        lost = mass - stats.tensor("mass_quantized")
        reach = float(lost.abs().max().clamp_min(1e-6))
        panels = (("fact mass, BF16 keys", mass, "viridis", None),
                  ("fact mass lost to the quantized keys", lost, "RdBu_r", (-reach, reach)),
                  ("fact value read-out error", stats.tensor("value_error"), "magma", None))
        for col, (title, data, cmap, limits) in enumerate(panels):
            ax = axes[row][col]
            image = ax.imshow(data.T.numpy(), aspect="auto", cmap=cmap, origin="lower",
                              vmin=None if limits is None else limits[0], vmax=None if limits is None else limits[1])
            ax.set_title(f"{name}: {title}", fontsize=9)
            ax.set_xlabel("layer")
            ax.set_ylabel("query head")
            fig.colorbar(image, ax=ax)
    fig.suptitle("Where retrieval breaks: the fact's attention per layer and query head")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_report(results: dict[str, NeedleAttention], out: str, command: str) -> str:
    """`needle_attention.json`, `.md` and `.png` in `out`; returns the markdown."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "needle_attention.json"), "w") as f:
        json.dump({"command": command, "results": {k: asdict(v) for k, v in results.items()}}, f)
    picture = plot(results, os.path.join(out, "needle_attention.png"))
    text = (f"# Where retrieval breaks: the fact's attention per layer and head\n\nCommand: `{command}`\n\n"
            + ("![heatmaps](needle_attention.png)\n\n" if picture else "") + report_table(results))
    with open(os.path.join(out, "needle_attention.md"), "w") as f:
        f.write(text)
    return text
