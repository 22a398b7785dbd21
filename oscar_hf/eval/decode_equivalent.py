"""Decode-equivalent evaluation: one forward over a whole sequence whose attention sees exactly what an
`OscarCache` would show each query if the sequence were fed as a prefill followed by token-by-token decoding.

Why it is exact. A history token is quantized per row (one token of one KV head), so its dequantized key/value
`K̂_p, V̂_p` do not depend on when or by whom it is read. What changes from query to query is only *which* cached
tokens are quantized, and that follows from the cache's demotion rule (`oscar_hf.demotion`): the query at position
t, computed in the forward that starts at s, sees positions `S <= p < S + N_s` quantized and every other `p <= t` in
BF16, where `N_s` is the history length left by the forwards before s (`demotion.history_lengths`).

The simulation computes two score matrices per layer (`q·K` and `q·K̂`, the latter in the rotated basis, as the
cache does), picks per (t, p) which one applies, applies the causal/padding mask, takes one softmax, and mixes `V`
and `V̂` with the same selection. It is O(L²) like ordinary attention; `tests/test_simulate.py` checks it against
real token-by-token decoding through `OscarCache`. It runs as a hook of the "oscar" attention (`oscar_hf.attention`).

```python
from oscar_hf import OscarCache
from oscar_hf.eval.decode_equivalent import simulate_logits
template = OscarCache(model.config, rotations="hadamard")   # only its settings and rotations are used
logits = simulate_logits(model, input_ids, template, prefill=512)  # [B, L, vocab], decode-equivalent
```

Batches: every row is simulated as if decoded alone (batch 1, no padding). Right padding (lm-eval's) is harmless
because attention is causal; `prefill` may differ per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from oscar_hf.attention import AttentionCall, oscar_attention
from oscar_hf.config import OscarConfig
from oscar_hf.demotion import history_lengths, in_history
from oscar_hf.kernels.reference.attention import gqa_mix, gqa_scores
from oscar_hf.kernels.reference.quantize import fake_quantize
from oscar_hf.layer import OscarLayer
from oscar_hf.rotations.math import expand_heads, rotate

QUERY_BLOCK = 256  # queries per score block (bounds memory at [B, Hq, QUERY_BLOCK, L] floats)


@dataclass
class SimulationPlan:
    """What the simulated attention needs: the cache settings, rotations per layer, and the forward schedule.

    `prefill` is one int for the batch or one per row; `chunk` is the size of the forwards after the prefill.
    `recorder`, when set, is called once per OSCAR layer with a `LayerProbe`.
    `propagate=False` returns the BF16 attention output (the model stays on the BF16 trajectory) while the
    recorder still sees the quantized one.
    `row_format`, when set, replaces the cache's quantizer: `row_format(rows, layer_idx, side)` gets the rotated
    float32 rows `[B, Hkv, L, d]` of one layer's keys (`side="key"`) or values and returns them as a history of
    that format would read them back (how formats the cache does not store are studied).
    """

    config: OscarConfig
    rotations: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
    prefill: int | Sequence[int] = 1
    chunk: int = 1
    recorder: Callable | None = None
    propagate: bool = True
    layer_configs: dict[int, OscarConfig] = field(default_factory=dict)  # per-layer settings (clips, code width)
    row_format: Callable[[torch.Tensor, int, str], torch.Tensor] | None = None
    # per layer, what the query is rotated by where it is not the key rotation (smoothed keys: `OscarLayer`)
    query_rotations: dict[int, torch.Tensor] = field(default_factory=dict)
    _history: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_cache(cls, cache, prefill: int | Sequence[int] = 1, chunk: int = 1, **kwargs) -> "SimulationPlan":
        """Settings and rotations of an (unused) `OscarCache`: `OscarCache(model.config, rotations, method, ...)`."""
        layers = [layer for layer in cache.layers if isinstance(layer, OscarLayer)]
        rotations = {layer.layer_idx: (layer.key_rotation, layer.value_rotation) for layer in layers}
        configs = {layer.layer_idx: layer.config for layer in layers}
        queries = {layer.layer_idx: layer.query_rotation for layer in layers
                   if layer.query_rotation is not layer.key_rotation}
        return cls(cache.oscar_config, rotations, prefill=prefill, chunk=chunk, layer_configs=configs,
                   query_rotations=queries, **kwargs)

    def history(self, batch: int, length: int, device) -> torch.Tensor:
        """`[batch, length]` history length seen by each query (cached per shape)."""
        prefills = [self.prefill] * batch if isinstance(self.prefill, int) else list(self.prefill)
        if len(prefills) != batch:
            raise ValueError(f"{len(prefills)} prefill lengths for a batch of {batch} rows")
        key = (tuple(prefills), length, str(device))
        if key not in self._history:
            cfg = self.config
            rows = [history_lengths(length, p, cfg.sink_tokens, cfg.recent_tokens, cfg.demote_block, self.chunk)
                    for p in prefills]
            self._history = {key: torch.stack(rows).to(device)}
        return self._history[key]

    def __call__(self, call: AttentionCall) -> torch.Tensor | None:
        """The "oscar" attention hook: the decode-equivalent attention of an OSCAR layer; None (the exact path)
        for the layers the cache keeps in BF16 (sliding-window layers)."""
        if call.layer_idx not in self.rotations:
            return None
        return simulate_attention(call.module, call.query, call.key, call.value, call.attention_mask, self,
                                  call.scaling, call.softcap)


@dataclass
class LayerProbe:
    """One layer's simulated attention, handed to `SimulationPlan.recorder` (all float32, model basis).

    `query` `[B, Hq, L, D]`; `keys`/`values` and their dequantized `keys_hat`/`values_hat` `[B, Hkv, L, D]`;
    `history` `[B, L]` (query t sees `[sink, sink + history[t])` quantized); `mask` bool `[B or 1, 1, L, L]`
    (True = attend); `output_bf16` / `output_quantized` `[B, L, Hq, D]` before the output projection.
    """

    layer_idx: int
    module: torch.nn.Module
    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    keys_hat: torch.Tensor
    values_hat: torch.Tensor
    history: torch.Tensor
    sink: int
    mask: torch.Tensor
    scaling: float
    softcap: float | None
    output_bf16: torch.Tensor
    output_quantized: torch.Tensor


def reconstruct(x: torch.Tensor, rotation: torch.Tensor | None, config: OscarConfig, side: str):
    """Rows `x` `[B, H, L, d]` of one layer's keys (`side="key"`) or values as the history stores them,
    dequantized: float32, in the *rotated* basis (a layer's `high_precision_heads` at their own settings)."""
    rotated = rotate(x, None if rotation is None else rotation.to(x.device))
    if not config.quantize:
        return rotated.to(x.dtype).float()
    out = fake_quantize(rotated, config.bits, getattr(config, f"{side}_clip_ratio"), config.scale_dtype,
                        config.encoder)
    heads = [head for _, head in config.high_precision_heads]
    if heads:
        high = config.high_precision()
        out[:, heads] = fake_quantize(rotated[:, heads], high.bits, getattr(high, f"{side}_clip_ratio"),
                                      high.scale_dtype, high.encoder)
    return out


def simulate_attention(module, query, key, value, attention_mask, plan: SimulationPlan, scaling: float,
                       softcap: float | None = None) -> torch.Tensor:
    """Decode-equivalent attention of one OSCAR layer; returns `[B, L, Hq, D]` in the query dtype."""
    layer_idx = module.layer_idx
    batch, q_heads, length, _ = query.shape
    if key.shape[2] != length:
        raise ValueError(f"the simulation runs without a cache: got {length} queries but {key.shape[2]} keys")
    cfg = plan.config
    key_rotation, value_rotation = plan.rotations[layer_idx]
    groups = q_heads // key.shape[1]
    key_r = None if key_rotation is None else key_rotation.to(query.device, torch.float32)
    value_r = None if value_rotation is None else value_rotation.to(query.device, torch.float32)
    query_r = plan.query_rotations.get(layer_idx)
    query_r = key_r if query_r is None else query_r.to(query.device, torch.float32)
    if plan.row_format is None:
        layer_cfg = plan.layer_configs.get(layer_idx) or cfg.for_layer(layer_idx)
        k_hat = reconstruct(key, key_rotation, layer_cfg, "key")
        v_hat = reconstruct(value, value_rotation, layer_cfg, "value")
    else:
        k_hat = plan.row_format(rotate(key, key_r), layer_idx, "key")
        v_hat = plan.row_format(rotate(value, value_r), layer_idx, "value")
    q = query.float()
    q_rot = rotate(q, expand_heads(query_r, groups))
    k, v = key.float(), value.float()
    history = plan.history(batch, length, query.device)
    positions = torch.arange(length, device=query.device)
    if attention_mask is None:
        rows = torch.arange(length, device=query.device)
        mask = (rows[None, :] <= rows[:, None])[None, None]
    else:
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    outputs, bf16_outputs = [], []
    for start in range(0, length, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, length)
        m = mask[:, :, start:end]
        band = in_history(positions[None, :], history[:, start:end, None], cfg.sink_tokens)[:, None]
        exact = gqa_scores(q[:, :, start:end], k, scaling, softcap)
        scores = torch.where(band, gqa_scores(q_rot[:, :, start:end], k_hat, scaling, softcap), exact)
        probs = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1).nan_to_num_(0.0)
        hist_out = gqa_mix(probs * band, v_hat)
        out = gqa_mix(probs * ~band, v) + rotate(hist_out, expand_heads(value_r, groups), transpose=True)
        outputs.append(out)
        if plan.recorder is not None or not plan.propagate:
            bf16 = torch.softmax(exact.masked_fill(~m, float("-inf")), dim=-1).nan_to_num_(0.0)
            bf16_outputs.append(gqa_mix(bf16, v))
    out = torch.cat(outputs, dim=2).transpose(1, 2)
    out_bf16 = torch.cat(bf16_outputs, dim=2).transpose(1, 2) if bf16_outputs else None
    if plan.recorder is not None:
        plan.recorder(LayerProbe(
            layer_idx, module, q, k, v,
            rotate(k_hat, query_r, transpose=True), rotate(v_hat, value_r, transpose=True),
            history, cfg.sink_tokens, mask, scaling, softcap, out_bf16, out,
        ))
    chosen = out if plan.propagate else out_bf16
    return chosen.to(query.dtype).contiguous()


@torch.no_grad()
def simulate_logits(model, input_ids: torch.Tensor, cache_or_plan, prefill: int | Sequence[int] = 1,
                    chunk: int = 1, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-equivalent logits `[B, L, vocab]` for `input_ids` `[B, L]`.

    `cache_or_plan` is an `OscarCache` (its settings and rotations are used; it is not filled) or a
    `SimulationPlan`. Positions `t < prefill` are computed as a prefill (all BF16); later positions as the
    forwards of `chunk` tokens that follow it (chunk=1: decoding).
    """
    plan = cache_or_plan if isinstance(cache_or_plan, SimulationPlan) else SimulationPlan.from_cache(
        cache_or_plan, prefill=prefill, chunk=chunk)
    with oscar_attention(model, plan):
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
