"""Per-layer error decomposition through any KV cache, with decode-style queries over its real tier layout.

1. `capture_attention_inputs` runs the model once in full precision and keeps, per layer, the post-RoPE query,
   key and value `[1, H, L, D]` and the attention module (for its output projection).
2. `replay_layer_errors` feeds those exact K/V into a fresh cache, layer by layer, on the schedule of a prefill of
   `prefill` tokens followed by forwards of `chunk` tokens (1 = decoding), through the cache's own
   `layer.update` (what the model's attention would receive). Each forward's full-precision queries attend to
   what the cache returns (OSCAR: its tiers with the history dequantized), and are compared with attention over
   the exact K/V. Every layer therefore sees full-precision inputs: the errors are per-layer, not propagated.

Per layer, over the queries of the forwards after the prefill (`metrics.py` for the definitions):
- `attention_kl`: mean over query heads and queries of KL(P || P̂) of the attention-score distributions;
- `output_relative_mse`: ‖O − Ô‖² / ‖O‖² of the attention-block output after the output projection,
  `O = o_proj(P V)`, `Ô = o_proj(P̂ V̂)`;
- `key_mse` / `value_mse` (and relative versions): over all cached tokens of the final cache state against the exact
  K/V (full-precision tiers included, so it reflects what the cache stores).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from oscar_hf.attention import AttentionCall, oscar_attention
from oscar_hf.eval.diagnostics.metrics import attention_kl, squared_error_sums
from oscar_hf.kernels.reference.attention import gqa_mix, gqa_scores
from oscar_hf.layer import OscarLayer


@dataclass
class CapturedLayer:
    layer_idx: int
    module: torch.nn.Module
    query: torch.Tensor  # [1, Hq, L, D] float32
    key: torch.Tensor  # [1, Hkv, L, D], model dtype
    value: torch.Tensor
    scaling: float


@torch.no_grad()
def capture_attention_inputs(model, input_ids: torch.Tensor) -> tuple[list[CapturedLayer], torch.Tensor]:
    """Full-precision forward over `input_ids` `[1, L]`: (per-layer attention inputs, logits `[1, L, vocab]`)."""
    if input_ids.shape[0] != 1:
        raise ValueError("capture_attention_inputs takes one sequence (batch 1)")
    store: list[CapturedLayer] = []

    def capture(call: AttentionCall) -> None:  # observes only: the forward runs unchanged
        store.append(CapturedLayer(call.layer_idx, call.module, call.query.detach().float(), call.key.detach(),
                                   call.value.detach(), call.scaling))

    with oscar_attention(model, capture):
        logits = model(input_ids=input_ids, use_cache=False).logits
    return sorted(store, key=lambda c: c.layer_idx), logits


@dataclass
class LayerErrors:
    layer_idx: int
    attention_kl: float
    output_relative_mse: float
    key_mse: float
    value_mse: float
    key_relative_mse: float
    value_relative_mse: float
    queries: int


@dataclass
class _Sums:
    kl: float = 0.0
    rows: int = 0
    out_err: float = 0.0
    out_norm: float = 0.0
    queries: int = 0
    final: dict = field(default_factory=dict)


def _update(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append `[1, Hkv, n, D]` to one cache layer and return the full K/V its attention would see."""
    if isinstance(layer, OscarLayer):
        layer.update(keys, values)
        return layer.dense_kv()
    return layer.update(keys, values)


def _settle(layer) -> None:
    if isinstance(layer, OscarLayer):
        layer.settle()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, first_query: int):
    """Scores `[Hq, n, Lk]`, probabilities and outputs `[n, Hq * D]` of queries at positions `first_query + i`."""
    n, lk = q.shape[2], k.shape[2]
    scores = gqa_scores(q, k, scaling)
    rows = torch.arange(first_query, first_query + n, device=q.device)[:, None]
    mask = torch.arange(lk, device=q.device)[None, :] <= rows
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = gqa_mix(probs, v)
    return scores[0], mask, out[0].transpose(0, 1).reshape(n, -1)


@torch.no_grad()
def replay_layer_errors(captured: list[CapturedLayer], cache, prefill: int, chunk: int = 1,
                        progress: bool = True, desc: str = "replay") -> list[LayerErrors]:
    """Replay the captured K/V through `cache` (fresh, batch 1) and measure per-layer errors (module docstring)."""
    results = []
    total = sum(len(range(prefill, c.key.shape[2], chunk)) for c in captured)
    bar = tqdm(total=total, desc=desc, disable=not progress, leave=False)
    for cap in captured:
        layer = cache.layers[cap.layer_idx]
        length = cap.key.shape[2]
        if not 0 < prefill < length:
            raise ValueError(f"prefill={prefill} must be inside the {length}-token text")
        o_proj = getattr(cap.module, "o_proj", None)
        sums = _Sums()
        _update(layer, cap.key[:, :, :prefill], cap.value[:, :, :prefill])
        seen_k = seen_v = None
        for start in range(prefill, length, chunk):
            end = min(start + chunk, length)
            _settle(layer)
            seen_k, seen_v = _update(layer, cap.key[:, :, start:end], cap.value[:, :, start:end])
            q = cap.query[:, :, start:end]
            ref_scores, mask, ref_out = _attend(q, cap.key[:, :, :end], cap.value[:, :, :end], cap.scaling, start)
            test_scores, _, test_out = _attend(q, seen_k, seen_v, cap.scaling, start)
            kl_rows = attention_kl(ref_scores, test_scores, mask, reduce=False)
            sums.kl += kl_rows.sum().item()
            sums.rows += kl_rows.numel()
            if o_proj is not None:
                ref_out, test_out = o_proj(ref_out.to(o_proj.weight.dtype)), o_proj(test_out.to(o_proj.weight.dtype))
            err, norm = squared_error_sums(ref_out, test_out)
            sums.out_err += err
            sums.out_norm += norm
            sums.queries += end - start
            bar.update(1)
        k_err, k_norm = squared_error_sums(cap.key, seen_k)
        v_err, v_norm = squared_error_sums(cap.value, seen_v)
        elements = cap.key.numel()
        results.append(LayerErrors(
            cap.layer_idx, sums.kl / max(sums.rows, 1), sums.out_err / sums.out_norm if sums.out_norm else 0.0,
            k_err / elements, v_err / elements, k_err / k_norm if k_norm else 0.0, v_err / v_norm if v_norm else 0.0,
            sums.queries,
        ))
    bar.close()
    return results


@torch.no_grad()
def prefill_by_replay(cache, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Fill a fresh cache with a prefill's K/V `[B, Hkv, P, D]` per layer, exactly as a prefill forward would
    (every cache here attends to a prefill in full precision and quantizes/demotes only for later queries)."""
    for idx, (k, v) in enumerate(zip(keys, values)):
        layer = cache.layers[idx]
        layer.update(k, v)
        _settle(layer)
