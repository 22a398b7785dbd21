"""Issue #44: rank KV heads by what the 2-bit history costs them, instead of by induction.

    python -m experiments.retrieval.sensitivity --out <folder> [--score error|kl|product] [--tokens 2048]
        [--text random|generated] [--generated 2048]

The data-free profile (`oscar_hf.profile`) feeds a random block twice and ranks KV heads by induction. This
ranks them by the damage itself, on that block (`--text random`) or on tokens the model samples from its BOS token
(`--text generated`): over sampled queries of the second half, each KV head's attention output (and its
attention distribution) with the history tier stored as `oscar-next`'s 2-bit rows (keys smoothed by the profile's
scales, Hadamard-rotated, sigma rows with one-byte pairs; sink and recent window exact) against the exact one.
`--score error`: mean relative squared error of the output; `kl`: mean KL(exact || 2-bit) of the attention;
`product`: error divided by 1 + the head's induction rank. Writes the data-free rotations with that ranking (the
smoothing unchanged), prints its overlap with the induction ranking; measure it with `oscar-needles --rotations
<folder> --methods oscar-next ...`.
"""

from __future__ import annotations

import argparse
import json

import torch

from experiments.retrieval.data_free import overlap
from oscar_hf.attention import oscar_attention
from oscar_hf.config import PRESETS
from oscar_hf.eval.assets import load_model
from oscar_hf.kernels.reference.quantize import fake_quantize
from oscar_hf.profile import PROFILE_SEED, PROFILE_TOKENS, data_free_rotations, profile_length, random_tokens
from oscar_hf.rotations.math import hadamard_matrix
from oscar_hf.rotations.rotations import RETRIEVAL_HEADS_KEY, RETRIEVAL_LAYERS_KEY, RETRIEVAL_RANKING_KEY


class HistoryDamage:
    """Per layer `[Hkv]` (output error, attention KL) of 2-bit history rows, over ~`queries` rows of the second half
    of a forward of 2 x `period` tokens."""

    def __init__(self, period: int, scales: dict[int, torch.Tensor], sink: int, recent: int, queries: int = 256):
        cfg = PRESETS["oscar-next"]
        self.quantize = lambda x: fake_quantize(x, cfg.bits, cfg.key_clip_ratio, cfg.scale_dtype, cfg.encoder)
        self.period, self.scales, self.sink, self.recent, self.queries = period, scales, sink, recent, queries
        self.error: dict[int, torch.Tensor] = {}
        self.kl: dict[int, torch.Tensor] = {}

    def __call__(self, call) -> None:
        query, key, value = call.query.float(), call.key.float(), call.value.float()
        _, q_heads, _, dim = query.shape
        kv_heads, n, layer = key.shape[1], self.period, call.module.layer_idx
        group = q_heads // kv_heads
        h = hadamard_matrix(dim, torch.float32).to(query.device)
        rows = torch.arange(n, 2 * n - 1, max(1, (n - 1) // self.queries), device=query.device)
        cols = torch.arange(2 * n, device=query.device)
        future = cols[None, :] > rows[:, None]
        history = (cols[None, :] >= self.sink) & (cols[None, :] < rows[:, None] + 1 - self.recent)
        errors, kls = [], []
        for head in range(kv_heads):
            s = (self.scales[layer][head].to(query.device) if layer in self.scales
                 else torch.ones(dim, device=query.device))
            k = key[:, head] / s
            q = query[:, head * group:(head + 1) * group][:, :, rows] * s  # [B, G, rows, d]
            kq = self.quantize(k @ h) @ h.T
            vq = self.quantize(value[:, head] @ h) @ h.T
            exact = (q @ k.transpose(-1, -2)) * call.scaling
            mixed = torch.where(history, (q @ kq.transpose(-1, -2)) * call.scaling, exact)
            p = exact.masked_fill(future, float("-inf")).softmax(-1)
            pq = mixed.masked_fill(future, float("-inf")).softmax(-1)
            out = p @ value[:, head][:, None]
            hist = pq * history
            out_q = hist @ vq[:, None] + (pq - hist) @ value[:, head][:, None]
            errors.append(((out_q - out).pow(2).sum(-1) / out.pow(2).sum(-1).clamp_min(1e-12)).mean())
            kls.append((p * (p.clamp_min(1e-30).log() - pq.clamp_min(1e-30).log())).sum(-1).mean())
        self.error[layer], self.kl[layer] = torch.stack(errors).cpu(), torch.stack(kls).cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--score", choices=["error", "kl", "product"], default="error")
    parser.add_argument("--tokens", type=int, default=PROFILE_TOKENS)
    parser.add_argument("--text", choices=["random", "generated"], default="random",
                        help="generated: score on --generated tokens the model samples from its BOS token (its own "
                        "text, still no data) instead of the random block fed twice")
    parser.add_argument("--generated", type=int, default=2048)
    args = parser.parse_args()
    model, _ = load_model(args.model)
    rotations = data_free_rotations(model, args.tokens)
    scales = {i: rotations.key_smoothing[i] for i in rotations.key_smoothing}
    if args.text == "generated":
        tokens = args.generated // 2
        bos = model.generation_config.bos_token_id
        torch.manual_seed(PROFILE_SEED)
        with torch.no_grad():
            ids = model.generate(torch.tensor([[bos]], device=model.device), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=2 * tokens - 1, min_new_tokens=2 * tokens - 1)
    else:
        tokens = profile_length(model, args.tokens)
        ids = random_tokens(model.config.get_text_config().vocab_size, tokens, PROFILE_SEED).repeat(1, 2)
    cfg = PRESETS["oscar-next"]
    damage = HistoryDamage(tokens, scales, cfg.sink_tokens, cfg.recent_tokens)  # queries from the second half
    with torch.no_grad(), oscar_attention(model, damage):
        model(input_ids=ids.to(model.device), use_cache=False)
    by_induction = [tuple(pair) for pair in json.loads(rotations.metadata[RETRIEVAL_HEADS_KEY])]
    rank_of = {pair: r for r, pair in enumerate(by_induction)}
    score = {}
    for layer in damage.error:
        for head in range(len(damage.error[layer])):
            e, kl = float(damage.error[layer][head]), float(damage.kl[layer][head])
            score[(layer, head)] = {"error": e, "kl": kl,
                                    "product": e / (1 + rank_of.get((layer, head), len(rank_of)))}[args.score]
    heads = sorted(score, key=lambda x: -score[x])
    layers = sorted({i for i, _ in heads}, key=lambda i: -max(score[(i, h)] for (j, h) in heads if j == i))
    print("| rank | layer, KV head | output error | attention KL | induction rank |\n|---:|---|---:|---:|---:|")
    for r, (i, h) in enumerate(heads[:12]):
        print(f"| {r} | {i}, {h} | {float(damage.error[i][h]):.4f} | {float(damage.kl[i][h]):.4f} | "
              f"{rank_of.get((i, h))} |")
    print(f"top-9 KV heads shared with the induction ranking: {overlap(heads, by_induction, 9)}")
    rotations.metadata.update({RETRIEVAL_LAYERS_KEY: json.dumps([int(i) for i in layers]),
                               RETRIEVAL_HEADS_KEY: json.dumps([[int(i), int(h)] for i, h in heads]),
                               RETRIEVAL_RANKING_KEY: f"2-bit history damage ({args.score}) on {args.text} tokens"})
    rotations.save_pretrained(args.out)


if __name__ == "__main__":
    main()
